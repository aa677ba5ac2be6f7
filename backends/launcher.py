"""Launch the rank programs of a compiled plan as processes on this machine.

`launch(out_dir, steps=N)` takes the lock of `out_dir` (compiler/driver/outdir.py), starts one
process per rank (`<out>/rank_<r>/program.py`, under `jax.distributed` with gloo collectives on
CPU), with the coordinator on a free port of the loopback (`127.0.0.1`, where process 0 then listens
only: backends/cluster.py), and watches them. `platform="gpu"` gives each
process its ranks' GPUs (backends/placement.py: `CUDA_VISIBLE_DEVICES`,
`PCOMPILE_LOCAL_DEVICE_IDS`; fewer GPUs than ranks is refused before anything starts);
`platform="cpu"` (the default) runs every process on CPU devices.

* progress: rank 0's `train.log` lines are echoed as they appear;
* liveness: every process sends a heartbeat (phase, steps done) twice a second on a pipe. A
  process silent for `heartbeat_timeout` seconds (never more than the current deadline) is
  named as stopped; when a process has not finished start-up within `startup_timeout` seconds
  (start-up includes `jax.distributed` and compiling the first step) or a later step within
  `timeout` seconds, the launcher names the process the others wait for (fewest steps done,
  not inside a step's collectives);
* a process that fails: the launcher names the one that failed first (a process that had
  stopped beating, else one killed by a signal, else the earliest failure a process reported
  before exiting), not the others' follow-on errors (a process that `jax.distributed` aborted
  because another one left counts last); a process that exits with status 0 before its run
  is over (its last heartbeat was not "finish": a library's `os._exit(0)`) is named at once;
* either way it stops the others (SIGTERM and SIGCONT to each rank's process group, SIGKILL
  after `stop_grace` seconds) and returns non-zero with a message naming the rank, what
  happened and the tail of its log (`<out>/rank_<r>/run.log`, stdout and stderr; each run
  writes it as a fresh file, never through a link that was at its place: `fresh_file`);
* `resume=True` continues from the newest step every rank holds intact (checked here, passed
  to the ranks as `--resume-step`); a fresh run gets a new run id (`PCOMPILE_RUN_ID`), and an
  earlier run's checkpoints stay until it has written one on every rank (the ranks then remove
  them: backends/async_checkpoint.py), which the launcher says before and, when the run wrote
  none, after;
* a coordinator port taken between choosing and binding it is retried on another port;
* Ctrl-C stops every rank and returns 130;
* at the end every rank's train.log must report the same losses.

`pcompile MODEL.py --devices N ... --run --steps S` calls this after compiling, through
`run_launched` (the progress and the summary, as `RunOptions` say).
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pcompile.backends.run_options import RunOptions

TAIL_LINES = 25
EXIT_COORDINATOR_PORT = 75  # backends/jax/rank_process.py: process 0 could not listen
EXIT_USER_ERROR = 2  # backends/jax/rank_runtime.py: a RankError, which it says in one line
HEARTBEAT_FD = "PCOMPILE_HEARTBEAT_FD"  # backends/jax/rank_process.py writes heartbeats there
SHARE_KEY_ENV = "PCOMPILE_SHARE_KEY"  # backends/jax/shared_compile.py keys its digest with it
RUN_ID_ENV = "PCOMPILE_RUN_ID"  # backends/jax/rank_loop.py tags the run's checkpoints with it
_PORT_ERRORS = ("address already in use", "failed to start rpc server", "failed to add port",
                "errno 98")


class LaunchError(Exception):
    """A problem found before any rank started (missing files, bad arguments)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def fresh_file(out_dir: str, folder: str, name: str) -> int:
    """A new, empty file `out_dir/folder/name` open for writing (`folder` is created when
    missing). Whatever was at its place (the previous log, a symbolic link, a hard link to a
    file elsewhere) is replaced, never written through; a `folder` that is a symbolic link is
    refused (LaunchError): run outputs are written only inside `out_dir`."""
    path = os.path.join(out_dir, folder, name)
    top = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            os.mkdir(folder, 0o777, dir_fd=top)
        except FileExistsError:
            pass
        try:
            sub = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise LaunchError(
                    f"{os.path.join(out_dir, folder)} is a symbolic link or not a folder; "
                    "pcompile writes a rank's logs only into its own folder inside --out: "
                    "remove it and compile again") from None
            raise
    finally:
        os.close(top)
    try:
        for _ in range(3):
            try:
                os.unlink(name, dir_fd=sub)
            except FileNotFoundError:
                pass
            try:  # O_EXCL: never follows a link, even one made since the unlink
                return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o666, dir_fd=sub)
            except FileExistsError:
                continue
        raise LaunchError(f"cannot create {path}: something keeps putting a file in its place")
    finally:
        os.close(sub)


def tail(path: str, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a log, without third-party noise (gloo's connection lines,
    which stay in the file: backends/run_report.py `without_noise`)."""
    from pcompile.backends.run_report import without_noise

    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = without_noise(f.read())
    except OSError:
        return "(no log)\n"
    return "".join(text.splitlines(keepends=True)[-lines:])


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == 124:
        return "exit status 124 (watchdog: a step or collective timed out)"
    if code == 3:
        return "exit status 3: the loss is not finite"
    return f"exit status {code}"


@dataclass
class _Proc:
    """One rank process and what the launcher knows of it."""

    process: int  # process index
    ranks: list[int]
    popen: subprocess.Popen[bytes]
    log: str
    beats: int  # read end of its heartbeat pipe
    spawned: float  # time.monotonic()
    progressed: float  # last time its count of steps done grew (spawn until then)
    last_beat: float | None = None
    phase: str = "start"
    done: int | None = None
    first_done: int | None = None
    failed_at: float | None = None  # time.time() the process reported its failure
    error: str = ""  # the one-line error it reported (its heartbeat's last words)
    reading: int | None = None  # the step whose batch it reads (phase "data")
    exited_at: float | None = None  # time.time() the launcher saw it exit
    code: int | None = None
    buffer: bytes = b""

    @property
    def rank(self) -> int:
        return self.ranks[0]

    @property
    def name(self) -> str:
        if len(self.ranks) == 1:
            return f"rank {self.ranks[0]}"
        return f"ranks {self.ranks[0]}-{self.ranks[-1]} (process {self.process})"

    def starting(self) -> bool:
        return self.done is None or self.done == self.first_done


@dataclass
class LaunchResult:
    """How a launch ended. `losses`: rank 0's train.log (every step, a resumed run's earlier
    ones included); `resumed_from`: the step a --resume continued from (0: a fresh run), so
    this run trained `len(losses) - resumed_from` steps; `report`: rank 0's report lines
    (time to first step, the run's summary: backends/run_report.py)."""

    code: int
    failed_rank: int | None = None
    message: str = ""
    losses: list[str] = field(default_factory=list)
    resumed_from: int = 0
    report: list[str] = field(default_factory=list)

    @property
    def trained(self) -> int:
        """Steps trained by this run."""
        return max(0, len(self.losses) - self.resumed_from)


@dataclass(frozen=True)
class Deadlines:
    """How long the launcher waits (seconds): for start-up (spawn to the first step done,
    which includes `jax.distributed` start-up and compiling the step), for each later step,
    and for a heartbeat (a stopped or frozen process; never more than the current deadline)."""

    startup: float = 600.0
    step: float = 300.0
    heartbeat: float = 30.0

    def of(self, proc: _Proc) -> float:
        return self.startup if proc.starting() else self.step


def _num_ranks(out_dir: str) -> int:
    """The plan's rank count (plan.json validated against its schema, compiler/driver/plan.py)."""
    from pcompile.compiler.driver.plan import PlanError, read_plan

    try:
        return read_plan(out_dir).devices
    except PlanError as exc:
        raise LaunchError(str(exc)) from None


def launch(
    out_dir: str,
    *,
    steps: int,
    processes: int | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    timeout: float = 300.0,
    startup_timeout: float = 600.0,
    heartbeat_timeout: float = 30.0,
    fail_on_nan: bool = True,
    echo: Callable[[str], None] = print,
    python: str | None = None,
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    stop_grace: float = 3.0,
    port_attempts: int = 3,
    extra_args: list[str] | None = None,
    platform: str = "cpu",
    gpus: int = 0,
) -> LaunchResult:
    """Run `steps` training steps of the plan in `out_dir` with one process per rank (or
    `processes` processes, each running N/processes ranks), holding the lock of `out_dir`
    (compiler/driver/outdir.py) meanwhile. `platform`: "cpu" (virtual CPU devices) or "gpu" (one of
    the `gpus` visible GPUs per rank, backends/placement.py)."""
    from pcompile.compiler.driver.outdir import out_lock
    from pcompile.ir.errors import PcompileError

    try:
        with out_lock(out_dir) as out:
            return _launch(out, steps, processes, checkpoint_every, resume,
                           Deadlines(startup_timeout, timeout, heartbeat_timeout), fail_on_nan,
                           echo, python, env, host, stop_grace, port_attempts, extra_args,
                           platform, gpus)
    except PcompileError as exc:
        raise LaunchError(str(exc)) from None


def resume_step(out_dir: str, steps: int, echo: Callable[[str], None] | None = None) -> int:
    """The step `--resume` continues from: the newest that every rank holds intact (newer,
    damaged ones are reported through `echo`). LaunchError when there is none, or when it is
    beyond `steps`."""
    from pcompile.backends.checkpoint_files import resume_point
    from pcompile.backends.checkpoint_merge import folder_plan_id

    folder = os.path.join(out_dir, "checkpoints")
    # checkpoints of another plan are passed over here, before any rank starts (the ranks
    # refused them only after starting and compiling)
    point = resume_point(folder, _num_ranks(out_dir), folder_plan_id(out_dir))
    if point.step is None:
        why = "".join(f"\n  {line}" for line in point.skipped)
        raise LaunchError(f"--resume: no step has an intact checkpoint of every rank in {folder}"
                          f"{why or ' (there is none)'}; run without --resume to start afresh")
    for line in point.skipped:
        if echo is not None:
            echo(f"pcompile launcher: passed over damaged checkpoint {line}")
    if point.step > steps:
        raise LaunchError(f"--resume: the checkpoint is at step {point.step}, beyond --steps "
                          f"{steps}; ask for at least {point.step} steps")
    return point.step


def _launch(out_dir: str, steps: int, processes: int | None, checkpoint_every: int,
            resume: bool, deadlines: Deadlines, fail_on_nan: bool,
            echo: Callable[[str], None], python: str | None, env: dict[str, str] | None,
            host: str, stop_grace: float, port_attempts: int,
            extra_args: list[str] | None, platform: str = "cpu",
            gpus: int = 0) -> LaunchResult:
    from pcompile.backends.placement import assign_devices, process_env

    n = _num_ranks(out_dir)
    procs = processes or n
    if n % procs:
        raise LaunchError(f"{n} ranks cannot be spread evenly over {procs} processes; choose a "
                          f"divisor of {n}")
    per = n // procs
    # Before anything starts: fewer GPUs than ranks is refused here (PcompileError).
    placement = (assign_devices(procs, n, gpus) if platform == "gpu"
                 else [None] * procs)
    program = os.path.join(out_dir, "program.py")  # every rank's SPMD program
    if not os.path.exists(program):
        raise LaunchError(f"missing rank program {program}; compile again")
    programs = [program] * procs
    ckpt = os.path.join(out_dir, "checkpoints")
    common = ["--steps", str(steps), "--timeout", str(deadlines.step),
              "--startup-timeout", str(deadlines.startup),
              "--fail-on-nan" if fail_on_nan else "--no-fail-on-nan", *(extra_args or [])]
    resumed_from = 0
    if resume:
        resumed_from = resume_step(out_dir, steps, echo)
        common += ["--resume", "--resume-step", str(resumed_from)]
        echo(f"pcompile launcher: resuming from step {resumed_from}")
    run_id = secrets.token_hex(8)
    earlier = [] if resume else _earlier_checkpoints(ckpt, n, run_id)
    if earlier:
        echo(f"pcompile launcher: {ckpt} holds checkpoints of an earlier run (step(s) "
             f"{', '.join(map(str, earlier))}): they stay until this run has written a "
             "checkpoint on every rank, then they are removed")
    if checkpoint_every:
        common += ["--checkpoint-every", str(checkpoint_every)]
    base_env = dict(os.environ if env is None else env)
    base_env["PYTHONUNBUFFERED"] = "1"
    base_env["PCOMPILE_LAUNCHER_PID"] = str(os.getpid())  # ranks exit when the launcher dies
    # The secret that authenticates the executable process 0 shares through the coordinator's
    # key-value store (backends/jax/shared_compile.py): fresh for every run, and only in the
    # environment of its ranks (which only this user can read).
    base_env[SHARE_KEY_ENV] = secrets.token_hex(32)
    base_env[RUN_ID_ENV] = run_id  # what this run's checkpoints are tagged with
    envs = [process_env(base_env, platform, devices, gpus) for devices in placement]
    result = LaunchResult(1)
    restore = _sigterm_as_interrupt()
    try:
        result = _attempts(programs, per, common, envs, python or sys.executable, echo,
                           stop_grace, out_dir, host, port_attempts, deadlines, resumed_from)
    finally:
        restore()
    if result.code == 0:
        result = _check_logs(out_dir, n, result, echo)
        result.report = _report(out_dir, echo)
    result.resumed_from = resumed_from
    if earlier:
        _settle_earlier(ckpt, n, run_id, echo)
    return result


def _earlier_checkpoints(folder: str, ranks: int, run_id: str) -> list[int]:
    """The steps in `folder` of checkpoints that run `run_id` did not write."""
    from pcompile.backends.checkpoint_files import run_steps

    return sorted({step for r in range(ranks)
                   for step, run in run_steps(folder, r).items() if run != run_id})


def _settle_earlier(folder: str, ranks: int, run_id: str, echo: Callable[[str], None]) -> None:
    """After a fresh run in a folder that held an earlier run's checkpoints: when this run has
    a step on every rank, the earlier ones go (the ranks remove them themselves unless the
    run ended first); else they are kept, and the launcher says so."""
    from pcompile.backends.checkpoint_files import prune_checkpoints, run_steps

    kept = _earlier_checkpoints(folder, ranks, run_id)
    if not kept:
        return
    per_rank = [run_steps(folder, r) for r in range(ranks)]
    ours = set.intersection(*({s for s, run in steps.items() if run == run_id}
                              for steps in per_rank))
    if ours:
        newest = max(ours)
        for r in range(ranks):
            prune_checkpoints(folder, r, newest, 0, run_id, newest)
        echo(f"pcompile launcher: removed the earlier run's checkpoints (step(s) "
             f"{', '.join(map(str, kept))}): step {newest} of this run is on every rank")
        return
    echo(f"pcompile launcher: this run wrote no checkpoint that every rank holds, so the "
         f"earlier run's checkpoints (step(s) {', '.join(map(str, kept))}) are kept in "
         f"{folder}: --resume continues from the newest of them")


def _report(out_dir: str, echo: Callable[[str], None]) -> list[str]:
    """Echo (and return) the report lines process 0 wrote into rank 0's run.log."""
    from pcompile.backends.run_report import report_lines

    try:
        with open(os.path.join(out_dir, "rank_0", "run.log"), encoding="utf-8",
                  errors="replace") as f:
            lines = report_lines(f.read())
    except OSError:
        return []
    for line in lines:
        if not line.startswith("resuming from step"):  # the launcher said it first
            echo(line)
    return lines


def _sigterm_as_interrupt() -> Callable[[], None]:
    """While launching, SIGTERM stops the ranks like Ctrl-C does (main thread only)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        signal.signal(signal.SIGTERM, old)

    return restore


def _attempts(programs: list[str], per: int, common: list[str], envs: list[dict[str, str]],
              python: str, echo: Callable[[str], None], stop_grace: float, out_dir: str,
              host: str, port_attempts: int, deadlines: Deadlines,
              resumed_from: int = 0) -> LaunchResult:
    result = LaunchResult(1)
    for attempt in range(port_attempts):
        port = free_port(host)
        result = _run_once(programs, per, f"{host}:{port}", common, envs, python, echo,
                           stop_grace, out_dir, deadlines, resumed_from)
        if result.code != -1:
            break
        echo(f"pcompile launcher: coordinator port {port} was taken; retrying on another port "
             f"({attempt + 2}/{port_attempts})")
    if result.code == -1:
        result.code = 1
        result.message = f"no free coordinator port after {port_attempts} attempts"
        echo(f"pcompile launcher: {result.message}")
    return result


def _spawn(p: int, program: str, per: int, coordinator: str, procs: int, common: list[str],
           env: dict[str, str], python: str, out_dir: str) -> _Proc:
    first = p * per  # the first rank this process runs: its folder holds the process's log
    log = os.path.join(out_dir, f"rank_{first}", "run.log")
    log_fd = fresh_file(out_dir, f"rank_{first}", "run.log")
    args = [python, program, "--coordinator", coordinator, "--num-processes", str(procs),
            "--process-id", str(p), *common]
    if p:
        args.append("--quiet")
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    env = dict(env, **{HEARTBEAT_FD: str(write_end)})
    try:
        with os.fdopen(log_fd, "wb") as f:
            popen = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=out_dir, pass_fds=(write_end,))
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    now = time.monotonic()
    return _Proc(p, list(range(p * per, (p + 1) * per)), popen, log, read_end, now, now)


def _run_once(programs: list[str], per: int, coordinator: str, common: list[str],
              envs: list[dict[str, str]], python: str, echo: Callable[[str], None],
              stop_grace: float, out_dir: str, deadlines: Deadlines,
              resumed_from: int = 0) -> LaunchResult:
    """One attempt; code -1 means 'the coordinator port was taken, try another'. The first
    `resumed_from` lines of rank 0's train.log (restored from the checkpoint) are not echoed."""
    ranks: list[_Proc] = []
    procs = len(programs)
    progress = os.path.join(out_dir, "rank_0", "train.log")
    try:
        os.unlink(progress)  # the rank rewrites it; do not echo an old one
    except OSError:
        pass
    try:
        for p, program in enumerate(programs):
            ranks.append(_spawn(p, program, per, coordinator, procs, common, envs[p], python,
                                out_dir))
        _write_launch_info(out_dir, coordinator, ranks)
        seen = [0, 0, resumed_from]
        told: set[str] = set()
        first_log = [0, 0]  # rank 0's run.log: the lines of its TimeMonitor callback
        while True:
            echoed = _echo_progress(progress, seen, echo)
            _echo_progress(ranks[0].log, first_log, echo, CALLBACK_LINES)
            for r in ranks:
                _read_beats(r)
            _echo_startup(ranks[0], told, echo)
            for r in ranks:
                if r.code is None:
                    r.code = r.popen.poll()
                    if r.code is not None:
                        r.exited_at = time.time()
                        _read_beats(r)
            failed = _first_failure(ranks)
            if failed is not None:
                _stop(ranks, stop_grace)
                text = tail(failed.log)
                if echoed == 0 and (failed.code == EXIT_COORDINATOR_PORT or any(
                        e in text.lower() for e in _PORT_ERRORS)):
                    return LaunchResult(-1)
                if failed.code is None or failed.code == 0:  # stopped, not exited
                    what = _silence(failed)
                else:
                    what = _describe(failed.code)
                said = failed.error.strip().split(": error: ", 1)[-1]
                if failed.code == 0:
                    message = (f"{failed.name} exited with status 0 before the run was over "
                               f"({_where(failed)}): something in the process ended it without "
                               "an error (os._exit(0) or sys.exit(0) in a library or the model "
                               f"file?); stopped the other ranks. Last lines of {failed.log}:\n"
                               f"{text}")
                elif failed.code == EXIT_USER_ERROR and said and "\n" not in said:
                    # the rank's own one-line message (a mistake in the data, a checkpoint
                    # that does not fit): no log tail to read
                    message = (f"{failed.name} failed first: {said} (stopped the other ranks; "
                               f"log: {failed.log})")
                else:
                    message = (f"{failed.name} failed first ({what}); stopped the other ranks. "
                               f"Last lines of {failed.log}:\n{text}")
                echo(f"pcompile launcher: {message}")
                return LaunchResult(1, failed.rank, message)
            stuck = _overdue(ranks, deadlines)
            if stuck is not None:
                proc, why = stuck
                _stop(ranks, stop_grace)
                message = (f"{why}; stopped every rank. Last lines of {proc.log}:\n"
                           f"{tail(proc.log)}")
                echo(f"pcompile launcher: {message}")
                return LaunchResult(1, proc.rank, message)
            if all(r.code == 0 for r in ranks):
                _echo_progress(progress, seen, echo)
                _echo_progress(ranks[0].log, first_log, echo, CALLBACK_LINES)
                return LaunchResult(0)
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(ranks, stop_grace)
        echo("pcompile launcher: interrupted; stopped every rank")
        return LaunchResult(130, None, "interrupted")
    except BaseException:
        _stop(ranks, stop_grace)
        raise
    finally:
        for r in ranks:
            os.close(r.beats)


def _read_beats(proc: _Proc) -> None:
    """Take in the heartbeat lines the process wrote since the last call."""
    import json

    while True:
        try:
            chunk = os.read(proc.beats, 65536)
        except BlockingIOError:
            break
        except OSError:
            break
        if not chunk:
            break
        proc.buffer += chunk
    *lines, proc.buffer = proc.buffer.split(b"\n")
    now = time.monotonic()
    for line in lines:
        try:
            beat = json.loads(line)
        except ValueError:
            continue
        if not isinstance(beat, dict):
            continue
        proc.last_beat = now
        proc.phase = str(beat.get("phase", proc.phase))
        reading = beat.get("batch")
        proc.reading = reading if isinstance(reading, int) else None
        done = beat.get("done")
        if isinstance(done, int):
            if proc.first_done is None:
                proc.first_done = done
            if done != proc.done:
                proc.done, proc.progressed = done, now
        if proc.phase == "failed" and proc.failed_at is None:
            at = beat.get("at")
            proc.failed_at = float(at) if isinstance(at, (int, float)) else time.time()
            error = beat.get("error")
            proc.error = error if isinstance(error, str) else ""


SILENT = 5.0  # seconds without a heartbeat after which a process counts as stopped


def _quiet_for(proc: _Proc, now: float) -> float:
    return now - (proc.last_beat if proc.last_beat is not None else proc.spawned)


def _silence(proc: _Proc) -> str:
    quiet = _quiet_for(proc, time.monotonic())
    since = (f"for {quiet:.0f} s" if proc.last_beat is not None
             else f"in the {quiet:.0f} s since it was started")
    return f"no heartbeat {since}: the process is stopped or frozen, {_where(proc)}"


FOLLOW_ON_GRACE = 3.0  # seconds to wait for the process a follow-on abort points at
# What jax.distributed's agent prints when it aborts a process because another task died.
_FOLLOW_ON = ("jax distributed service detected fatal errors",
              "another task died")


def _follows_another(proc: _Proc) -> bool:
    """Killed by SIGABRT from jax.distributed after another process left: a follow-on."""
    if proc.code != -signal.SIGABRT:
        return False
    text = tail(proc.log, 60).lower()
    return any(marker in text for marker in _FOLLOW_ON)


def _ended_early(proc: _Proc, ranks: list[_Proc] | None = None) -> bool:
    """Exited with status 0 before its run was over (its last heartbeat was not "finish"):
    something in the process ended it (a library's os._exit(0)), and the others will wait
    for it in their collectives (in jax.distributed's start-up when it never beat, until
    --startup-timeout). A program that never beat while no other process of the run did is
    not a rank program: no judgement."""
    if proc.code != 0 or proc.phase == "finish":
        return False
    return proc.last_beat is not None or any(r.last_beat is not None for r in ranks or [])


def _first_failure(ranks: list[_Proc]) -> _Proc | None:
    """The process whose failure came first, once any process has failed: a process that had
    already stopped beating (the others' errors follow from it), else one killed by a signal,
    else the earliest reported error."""
    bad = [r for r in ranks if r.code not in (None, 0) or _ended_early(r, ranks)]
    if not bad:
        return None
    now = time.monotonic()
    silent = [r for r in ranks if r.code is None and _quiet_for(r, now) > SILENT]
    if silent:
        return max(silent, key=lambda r: _quiet_for(r, now))
    # A process that jax.distributed aborted because another one left (the coordination service
    # closed) failed second, whatever its signal says: the one that left is looked for first,
    # for FOLLOW_ON_GRACE seconds, since it may be seen exiting after its follower.
    follow = [r for r in bad if _follows_another(r)]
    own = [r for r in bad if r not in follow]
    if not own:
        first = min(follow, key=lambda r: (r.exited_at or 0.0, r.rank))
        if time.time() - (first.exited_at or 0.0) < FOLLOW_ON_GRACE:
            return None
        return first
    signalled = [r for r in own if r.code is not None and r.code < 0]
    if signalled:
        return min(signalled, key=lambda r: (r.exited_at or 0.0, r.rank))
    bad = own
    return min(bad, key=lambda r: (r.failed_at if r.failed_at is not None
                                   else r.exited_at or 0.0, r.rank))


_PHASES = {
    "start": "starting (Python, imports)",
    "connect": "connecting to the other processes (jax.distributed)",
    "init": "making its parameter slices and optimizer state",
    "restore": "reading its checkpoint",
    "compile": "compiling the step (XLA) and running it the first time",
    "data": "reading its next batch (dataset())",
    "compute": "computing a step (its collectives wait for every rank)",
    "checkpoint": "writing a checkpoint",
    "finish": "finishing",
}


_PHASE_ORDER = {"start": 0, "connect": 1, "init": 2, "restore": 2, "data": 2, "checkpoint": 2,
                "compile": 3, "compute": 3, "finish": 4}

#: Start-up phases the launcher reports as rank 0 enters them (before its first step).
_STARTUP_PHASES = ("connect", "init", "restore", "compile")


def _where(proc: _Proc) -> str:
    step = "" if proc.done is None else f" after step {proc.done}"
    return f"last seen {_PHASES.get(proc.phase, proc.phase)}{step}"


def _overdue(ranks: list[_Proc], deadlines: Deadlines) -> tuple[_Proc, str] | None:
    """A live process that stopped beating, or the one the others wait for once a deadline
    passed: (process, why)."""
    now = time.monotonic()
    live = [r for r in ranks if r.code is None]
    stalled = [r for r in live
               if _quiet_for(r, now) > min(deadlines.heartbeat, deadlines.of(r))]
    if stalled:
        proc = max(stalled, key=lambda r: _quiet_for(r, now))
        return proc, f"{proc.name} stopped responding ({_silence(proc)})"
    late = [r for r in live if now - r.progressed > deadlines.of(r)]
    if not late:
        return None
    silent = [r for r in live if _quiet_for(r, now) > SILENT]
    if silent:  # stopped a while ago, short of the heartbeat limit: still the one to blame
        proc = max(silent, key=lambda r: _quiet_for(r, now))
        return proc, f"{proc.name} stopped responding ({_silence(proc)})"
    # The one the others wait for: fewest steps done, then the earliest phase.
    proc = min(live, key=lambda r: (-1 if r.done is None else r.done,
                                    _PHASE_ORDER.get(r.phase, 0), r.rank))
    limit = deadlines.of(proc)
    flag = "--startup-timeout" if proc.starting() else "--timeout"
    behind = [r for r in live if (r.done, r.phase) != (proc.done, proc.phase)]
    if not behind and proc.phase == "data":
        batch = f"the batch of step {proc.reading}" if proc.reading else "its next batch"
        return proc, (f"no rank got its next batch within {limit:.0f} s ({flag}): every rank is "
                      f"reading {batch} from dataset(); dataset() is blocked (a stalled read, a "
                      f"lock, a generator that waits for ever?). {proc.name} is named for its "
                      "log")
    if not behind:
        return proc, (f"no rank finished its step within {limit:.0f} s ({flag}): every rank is "
                      f"{_PHASES.get(proc.phase, proc.phase)}; a collective that never "
                      f"completes? {proc.name} is named for its log")
    return proc, (f"{proc.name} did not finish within {limit:.0f} s ({flag}); {_where(proc)}, "
                  "while the other ranks wait for it")


def _write_launch_info(out_dir: str, coordinator: str, ranks: list[_Proc]) -> None:
    """`<out>/launch.json`: which process runs which ranks (pid, log), for people and tests."""
    import json

    from pcompile.backends.atomic_files import atomic_write_text

    info = {"coordinator": coordinator, "launcher_pid": os.getpid(),
            "processes": [{"process": r.process, "ranks": r.ranks, "pid": r.popen.pid,
                           "log": r.log} for r in ranks]}
    atomic_write_text(os.path.join(out_dir, "launch.json"), json.dumps(info, indent=1) + "\n")


def _echo_startup(proc: _Proc, told: set[str], echo: Callable[[str], None]) -> None:
    """Say which start-up phase the first process has entered, once each, until its first
    step is done: a large model's start-up (parameters, the XLA compile) is not silent."""
    if not proc.starting() or proc.phase not in _STARTUP_PHASES or proc.phase in told:
        return
    told.add(proc.phase)
    elapsed = time.monotonic() - proc.spawned
    echo(f"pcompile launcher: {proc.name} is {_PHASES[proc.phase]} ({elapsed:.1f} s)")


#: the lines of rank 0's run.log that the launcher echoes as they come: MindSpore's
#: TimeMonitor callback (compiler/frontend/callbacks.py), which a model file's callbacks() may give
CALLBACK_LINES = ("Train epoch time: ",)


def _echo_progress(path: str, state: list[int], echo: Callable[[str], None],
                   only: tuple[str, ...] | None = None) -> int:
    """Echo the complete lines added to `path` since the last call (with `only`: those that
    start so). `state` is [bytes consumed, lines echoed, lines to pass over first (a resumed
    run's restored ones)]; returns the number of lines echoed so far."""
    try:
        with open(path, "rb") as f:
            f.seek(state[0])
            data = f.read()
    except OSError:
        return state[1]
    end = data.rfind(b"\n") + 1  # only complete lines
    for line in data[:end].decode("utf-8", errors="replace").splitlines():
        if len(state) > 2 and state[2] > 0:
            state[2] -= 1
            continue
        if only is not None and not line.startswith(only):
            continue
        echo(line)
        state[1] += 1
    state[0] += end
    return state[1]


def _stop(ranks: list[_Proc], grace: float) -> None:
    """SIGTERM every live rank's process group (and SIGCONT, so a stopped one takes it),
    SIGKILL what is left after `grace` s."""
    live = [r for r in ranks if r.popen.poll() is None]
    for r in live:
        _signal(r.popen, signal.SIGTERM)
        _signal(r.popen, signal.SIGCONT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(r.popen.poll() is None for r in live):
        time.sleep(0.05)
    for r in live:
        if r.popen.poll() is None:
            _signal(r.popen, signal.SIGKILL)
    for r in ranks:
        try:
            r.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if r.code is None:
            r.code = r.popen.returncode


def _signal(popen: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            popen.send_signal(sig)
        except ProcessLookupError:
            pass


def _check_logs(out_dir: str, n: int, result: LaunchResult,
                echo: Callable[[str], None]) -> LaunchResult:
    """Every rank's train.log must report the same steps and losses (within 1e-5)."""
    logs: list[list[str] | None] = []
    for r in range(n):
        path = os.path.join(out_dir, f"rank_{r}", "train.log")
        try:
            with open(path, encoding="utf-8") as f:
                logs.append(f.read().splitlines())
        except OSError:
            logs.append(None)
    if not logs or logs[0] is None:
        return result
    first = logs[0]
    for r, lines in enumerate(logs[1:], start=1):
        if lines is None:
            continue
        if len(lines) != len(first) or not all(_same(a, b) for a, b in zip(first, lines)):
            message = f"rank {r}'s train.log differs from rank 0's"
            echo(f"pcompile launcher: {message}")
            return LaunchResult(1, r, message, first)
    return LaunchResult(0, None, "", first)


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    head_a, _, la = a.rpartition(" ")
    head_b, _, lb = b.rpartition(" ")
    try:
        x, y = float(la), float(lb)
    except ValueError:
        return False
    return head_a == head_b and abs(x - y) <= 1e-5 * max(1.0, abs(y))


def run_launched(out_dir: str, devices: int, training: bool, options: RunOptions,
                 echo: Callable[..., None]) -> int:
    """`pcompile --run` with the rank programs in `out_dir`, one process per rank (`launch`,
    as `options` say): what starts, the progress (program/progress.py `run_monitor`), and the
    summary; the run's exit status. A refusal is a LaunchError."""
    from pcompile.program.progress import run_monitor

    n = devices
    procs = options.processes or n
    where = "one GPU per rank" if options.resolved_platform == "gpu" else "CPU devices"
    echo(f"launching {procs} process(es) for {n} rank(s) on {where}: {out_dir}/"
         "rank_*/program.py (logs: rank_*/run.log)")
    start = time.perf_counter()
    monitor = run_monitor(options.steps, options.print_every or 1, echo,
                          done=options.resume_step)
    try:
        result = launch(out_dir, steps=options.steps, processes=procs,
                        checkpoint_every=options.checkpoint_every,
                        resume=options.resume,
                        timeout=options.timeout or 300.0,
                        startup_timeout=options.startup_timeout or 600.0,
                        heartbeat_timeout=options.heartbeat_timeout or 30.0,
                        fail_on_nan=options.fail_on_nan,
                        echo=monitor,
                        platform=options.resolved_platform or "cpu",
                        gpus=options.gpus,
                        extra_args=options.rank_flags())
    finally:
        monitor.close()
    if result.code != 0:
        return int(result.code)
    if not training:
        echo(f"inference on {n} rank(s) in {time.perf_counter() - start:.2f} s (JAX, "
             f"{procs} process(es)); outputs: {out_dir}/rank_*/outputs.npz")
        return 0
    log = os.path.join(out_dir, "rank_0", "train.log")
    trained = result.trained
    steps_text = f"{trained} step{'s' if trained != 1 else ''}"
    if result.resumed_from:
        steps_text += (f" (steps {result.resumed_from + 1}..{len(result.losses)}, resumed "
                       f"from step {result.resumed_from})")
    echo(f"{steps_text} on {n} rank(s) in {time.perf_counter() - start:.2f} "
         f"s (JAX, {procs} process(es)); every rank reports the same loss; log: {log}; "
         f"checkpoints: {os.path.join(out_dir, 'checkpoints')}")
    return 0
