"""The training (or inference) loop of one rank process (`RankRunner`): each local rank's
parameters and optimizer state made on its own device or restored from a checkpoint, this
process's slices of every batch, the jitted SPMD step, train.log and metrics, periodic and
final checkpoints written in the background, the inference outputs.

Data: each process reads the data set its program names (`DATASET`, a
`compiler.runtime.DatasetSpec` written at compile time: the model file and how many arrays of
each batch are inputs and labels) and iterates `dataset()` like `compiler.runtime.batches`
(epochs restart it; without one, inputs()/labels() or a synthetic batch repeats), then cuts
each rank's part of every global batch by the input's layout (`LAYOUTS`, from
dataset_strategy). A `pcompile.dataset` object is read only for the rows of
this process's ranks' share of each batch (`compiler.runtime.batch_rows`; the whole batch
under full_batch), and the steps a resumed run skips are not read. The model file and
pcompile must be importable on every host, and `dataset()` must give the same batches in every
process (seed its random numbers).

Parameters: each rank makes its blocks of every parameter and optimizer state on its own device
(backends/jax/param_init.py; small blocks and the model's arrays on the host, the same values),
from `<out>/params.json` (backends/params.py).

Checkpoints: `<out>/checkpoints/rank_<r>/step_<S>.safetensors` and its index `step_<S>.json` at
the end and every `--checkpoint-every` steps (backends/checkpoint_files.py), written from a host
copy by a background thread while the loop goes on (backends/async_checkpoint.py), tagged with
the run's id (`_run_id`); an earlier run's checkpoints in the folder stay until this run has
one on every rank. `--resume` continues from the newest step that every rank holds intact
(verified against each index's manifest and against this program's layouts; damaged newer
steps are reported and passed over), restores train.log from the run's log, skips the batches
already seen, and so gives bit-identical losses.
`--fail-on-nan` (on by default) stops at the first step whose loss is not finite.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from pcompile.backends.jax.rank_process import (
    DISK_ERRNOS,
    PARAM_INIT_ENV,
    Heartbeat,
    NonFiniteLossError,
    RankError,
    Watchdog,
    fault_injection,
    output_path,
    write_error,
)
from pcompile.backends.jax.rank_report import RankReport, TrainLog
from pcompile.ir.errors import PcompileError

if TYPE_CHECKING:
    from pcompile.program.dataset import DatasetSpec

RUN_ID_ENV = "PCOMPILE_RUN_ID"  # the launcher names each run (backends/launcher.py)



#: this process's run id once shared through jax.distributed (`_run_id`)
_SHARED_RUN_ID: str | None = None

def _kv_client() -> Any:
    """jax.distributed's key-value client in a multi-process run (None: one process, or a JAX
    that keeps it elsewhere)."""
    import jax

    if jax.process_count() == 1:
        return None
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(distributed.global_state, "client", None)


class RankRunner:
    """The training (or inference) loop of one process."""

    def __init__(self, module: ModuleType, mesh: Any, local: list[int], out_dir: str,
                 args: SimpleNamespace, watchdog: Watchdog, heartbeat: Heartbeat,
                 timings: dict[str, float] | None = None) -> None:
        self.m = module
        # start-up phases so far (seconds; "start": the process's start, time.time())
        self.timings = timings or {"start": time.time()}
        self.heartbeat = heartbeat
        self.mesh = mesh
        self.local = local
        self.out_dir = out_dir
        self.args = args
        self.watchdog = watchdog
        self.ckpt_dir = os.path.abspath(args.checkpoint_dir or os.path.join(out_dir,
                                                                            "checkpoints"))
        self.params = list(module.PARAMS)
        self.inputs = [p for p in self.params if p[1] == "input"]
        self._out_shapes: list[tuple[int, ...]] = []  # the step's, once traced
        self.stored = [p for p in self.params if p[1] != "input"]
        from pcompile.ir.types import DType

        self.dtypes = {p[0]: DType[p[3]].np for p in self.params}
        consts = os.path.join(out_dir, "consts.npz")
        if os.path.exists(consts):
            from pcompile.backends.npz_files import load_npz

            module.DATA.update(load_npz(consts))

    # -- pieces --------------------------------------------------------------------------------
    def _rank_dir(self, rank: int) -> str:
        return os.path.join(self.out_dir, f"rank_{rank}")

    def _owns(self, name: str, rank: int) -> bool:
        """Whether `rank` holds stored value `name` (a pipeline stage holds its own; the
        program passes the others' through unchanged)."""
        stages = getattr(self.m, "PARAM_STAGES", None)
        if stages is None:
            return True
        return rank // int(self.m.RANKS_PER_STAGE) in stages[name]

    def _initial_state(self) -> dict[str, Any]:
        """Every stored value's global array, each local rank's block made on its own device
        (backends/jax/param_init.py) or, for small blocks and user arrays, on the host
        (backends/params.py); equal, bit for bit, to the single-device initialisation's block
        (another pipeline stage's values: zeros, never read)."""
        import jax

        from pcompile.backends.jax.param_init import make_blocks
        from pcompile.backends.jax.spmd import as_block
        from pcompile.backends.params import ParamsError, check_program, read_manifest

        try:
            sources = read_manifest(self.out_dir)
            check_program(self.out_dir, sources, {
                name: (self.m.LAYOUTS[name][0], dtype) for name, _, _, dtype in self.stored})
        except ParamsError as exc:
            raise RankError(str(exc)) from None
        where = self.args.param_init or os.environ.get(PARAM_INIT_ENV) or "auto"
        if where not in ("auto", "device", "host"):
            raise RankError(f"{PARAM_INIT_ENV}={where!r}: expected auto, device or host")
        start = time.perf_counter()
        jobs: list[tuple[Any, Any, Any]] = []
        pieces: dict[str, list[Any]] = {}  # a block, or the index of its job
        for name, _, shape, _ in self.stored:
            source = sources.get(name)
            if source is None:
                raise RankError(f"params.json has no entry for {name}; compile again")
            pieces[name] = []
            for r in self.local:
                device = self.mesh.devices.flat[r]
                if not self._owns(name, r):
                    pieces[name].append(jax.device_put(
                        as_block(np.zeros(shape, self.dtypes[name])), device))
                    continue
                bounds = self._layout(name).slice_bounds(r) if source.shape else ()
                pieces[name].append(len(jobs))
                jobs.append((source, bounds, device))
        made, counts = make_blocks(jobs, where)
        state = {name: self._stack([made[p] if isinstance(p, int) else p for p in arrays], shape)
                 for (name, _, shape, _), arrays in zip(self.stored, pieces.values())}
        for array in state.values():
            array.block_until_ready()
        seconds = time.perf_counter() - start
        total = counts["device"] + counts["host"]
        self._say(f"parameters and optimizer state of rank(s) {self.local[0]}..{self.local[-1]}: "
                  f"{total / 1e6:.2f} M values in {seconds:.2f} s "
                  f"({counts['device'] / 1e6:.2f} M made on the device, "
                  f"{counts['host'] / 1e6:.2f} M on the host)", force=True)
        return state

    def _stack(self, arrays: list[Any], shape: tuple[int, ...]) -> Any:
        """The global array (`spmd.blocked_shape`) of this process's ranks' blocks."""
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from pcompile.backends.jax.spmd import blocked_shape

        sharding = NamedSharding(self.mesh, P(tuple(self.mesh.axis_names)))
        return jax.make_array_from_single_device_arrays(blocked_shape(self.mesh.size, shape),
                                                        sharding, arrays)

    def _layout(self, name: str) -> Any:
        from pcompile.ir.layout import TensorLayout

        shape, dev, tmap = self.m.LAYOUTS[name]
        return TensorLayout(tuple(dev), tuple(tmap), tuple(shape))

    def _slice(self, name: str, array: np.ndarray, rank: int, first_row: int = 0) -> np.ndarray:
        """`rank`'s part of an input from `array`, rows first_row.. of the global batch."""
        from pcompile.program.dataset import slice_rows

        return slice_rows(array, self._layout(name), rank, first_row)

    def _put(self, name: str, pieces: dict[int, np.ndarray], shape: tuple[int, ...]) -> Any:
        from pcompile.backends.jax.spmd import put_blocks

        return put_blocks(self.mesh, pieces, tuple(shape), self.dtypes[name])

    def _dataset_spec(self) -> DatasetSpec:
        """The program's `DATASET` (program/dataset.py); a program written before it names
        only its model file, whose `inputs()` count is read (compiler/driver/runtime.py)."""
        from pcompile.program.dataset import DatasetSpec

        literal = getattr(self.m, "DATASET", None)
        if literal is not None:
            return DatasetSpec.from_literal(literal)
        from pcompile.compiler.driver.runtime import spec_of_model_file

        return spec_of_model_file(self.m.MODEL_FILE, len(self.inputs))

    def _batches(self, steps: int, skip: int = 0) -> Iterator[Any]:
        """(epoch, step, arrays, first_row) per step (compiler.runtime.iter_rank_batches): a
        pcompile.dataset object is read only for the rows of this process's ranks' share of
        each global batch, and its first `skip` steps not at all. Each batch is checked as it
        is read (compiler/driver/data_checks.py); see `_reading`."""
        from pcompile.compiler.driver.runtime import spec_batches
        from pcompile.program.dataset import batch_rows

        expected = [(name, tuple(self.m.LAYOUTS[name][0]), self.dtypes[name])
                    for name, *_ in self.inputs]
        rows = batch_rows([self._layout(name) for name, *_ in self.inputs], self.local)
        try:
            spec = self._dataset_spec()
            batches = spec_batches(spec, expected, steps, rows=rows, skip=skip)
        except PcompileError as exc:
            raise RankError(str(exc)) from None
        return self._reading(batches)

    def _reading(self, batches: Iterator[Any]) -> Iterator[Any]:
        """`batches`, each read while the heartbeat says so (phase "data": the launcher names
        a dataset() that blocks, not a collective) under the watchdog's --timeout (the first,
        which calls dataset(): --startup-timeout); a mistake in the data, or a dataset() that
        fails, is one RankError naming the batch (compiler/driver/data_checks.py)."""
        step = 0
        while True:
            step += 1
            self.heartbeat.set(phase="data", batch=step)
            self.watchdog.arm(self.args.startup_timeout if step == 1 else self.args.timeout,
                              f"reading the batch of step {step} from dataset()",
                              why="dataset() is blocked (a stalled read, a lock, a generator "
                                  "that waits for ever?)")
            try:
                item = next(batches)
            except StopIteration:
                return
            except PcompileError as exc:
                raise RankError(str(exc)) from None
            yield item

    def _function(self, donate: bool = False) -> Any:
        """The jitted SPMD step; `donate`: it reuses the buffers of the stored values it
        returns updated (training)."""
        import jax.numpy as jnp
        from jax import lax

        from pcompile.backends.jax.shared_compile import SharedStep
        from pcompile.backends.jax.spmd import spmd_function

        step = self.m.step
        mean_loss = self.m.PARALLEL_MODE == "data_parallel" and self.m.TRAINING
        axes = tuple(self.m.AXES)

        def body(*arrays: Any) -> Any:
            outs = list(step(*arrays))
            if mean_loss:  # each rank's loss is its own batch's; report their mean
                outs.append(lax.pmean(jnp.asarray(outs[0], jnp.float32), axes))
            return outs

        n = len(self.inputs)
        updated = set(self.m.OUTPUTS[1:])
        pipeline = hasattr(self.m, "PIPELINE")
        # a pipeline program's step is assembled per tick (pipeline.run_step): no donation there
        donated = tuple(n + i for i, (name, *_) in enumerate(self.stored)
                        if donate and not pipeline and name in updated)
        shapes = [shape for _, _, shape, _ in self.inputs + self.stored]
        jitted = spmd_function(body, self.mesh, shapes, donated, check_vma=not pipeline,
                               out_shapes=self._out_shapes)
        # compiled by process 0 only, when the processes run the same program on one host
        return SharedStep(jitted, f"{self.m.PLAN_ID}/{'train' if donate else 'infer'}")

    def _expected_layouts(self, rank: int) -> dict[str, dict[str, Any]]:
        """The layout entry (checkpoint_files.layout_entry) of every value `rank` holds."""
        return {name: {"shape": list(self.m.LAYOUTS[name][0]), "dtype": dt,
                       "dev_matrix": list(self.m.LAYOUTS[name][1]),
                       "tensor_map": [list(e) if isinstance(e, tuple) else e
                                      for e in self.m.LAYOUTS[name][2]]}
                for name, _, _, dt in self.stored if self._owns(name, rank)}

    def _load_values(self, resume_step: int) -> tuple[dict[int, dict[str, np.ndarray]],
                                                      dict[str, Any], dict[int, list[str]]]:
        """This process's ranks' values read from their checkpoints of `resume_step`, checked
        against this program (plan, layouts, slice shapes, dtypes), and their train.log lines;
        anything wrong is one RankError."""
        from pcompile.backends.checkpoint_files import (
            CheckpointError,
            checkpoint_log,
            checkpoint_path,
            program_problem,
            read_checkpoint,
        )

        values: dict[int, dict[str, np.ndarray]] = {}
        lines: dict[int, list[str]] = {}
        meta: dict[str, Any] = {}
        runs: dict[int, Any] = {}
        for r in self.local:
            path = checkpoint_path(self.ckpt_dir, r, resume_step)
            try:
                arrays, meta_r = read_checkpoint(path, r)
                lines[r] = checkpoint_log(path, meta_r)
            except CheckpointError as exc:
                raise RankError(f"cannot resume from step {resume_step}: {exc}") from None
            if meta_r.get("plan_id") != self.m.PLAN_ID:
                raise RankError(
                    f"checkpoint of step {resume_step} was written by plan "
                    f"{meta_r.get('plan_id')}, this program is plan {self.m.PLAN_ID}; "
                    "resume with the same model and options, or start afresh without --resume")
            problem = program_problem(meta_r, arrays, r, self._expected_layouts(r))
            if problem:
                raise RankError(f"cannot resume from step {resume_step}: {path}: {problem} "
                                "(written by another program, or edited); resume from a "
                                "checkpoint of this program, or start afresh without --resume")
            values[r], meta, runs[r] = arrays, meta_r, meta_r.get("run")
            for name, _, shape, _ in self.stored:  # another pipeline stage's: never read
                if not self._owns(name, r):
                    values[r].setdefault(name, np.zeros(shape, self.dtypes[name]))
        if len(set(runs.values())) > 1:
            raise RankError(f"cannot resume from step {resume_step}: its checkpoints are of "
                            "different runs (" + ", ".join(f"rank {r}: {run}"
                                                            for r, run in runs.items()) + ")")
        return values, meta, lines

    def _run_id(self, resumed: dict[str, Any] | None) -> str:
        """The id this run's checkpoints carry: a resumed run keeps the one it continues;
        else the launcher's (PCOMPILE_RUN_ID), else one process 0 makes and shares through
        jax.distributed's key-value store, else (one process) a new one."""
        import secrets

        import jax

        from pcompile.backends.checkpoint_files import RUN_ID

        if resumed is not None and isinstance(resumed.get("run"), str):
            return str(resumed["run"])
        given = os.environ.get(RUN_ID_ENV)
        if given:
            if not RUN_ID.fullmatch(given):
                raise RankError(f"{RUN_ID_ENV}={given!r}: a run id is 1 to 64 letters, digits, "
                                "'-' or '_'")
            return given
        global _SHARED_RUN_ID
        if _SHARED_RUN_ID is not None:  # a process running several programs (pipeline
            return _SHARED_RUN_ID  # stages) shares its run id once
        client = _kv_client()
        if client is None:
            _SHARED_RUN_ID = secrets.token_hex(8)
            return _SHARED_RUN_ID
        key = "pcompile/run_id"
        if jax.process_index() == 0:
            run = secrets.token_hex(8)
            client.key_value_set(key, run)
        else:
            run = str(client.blocking_key_value_get(key, int(self.args.startup_timeout * 1000)))
            if not RUN_ID.fullmatch(run):
                raise RankError(f"process 0 shared the run id {run!r}, not a run id")
        _SHARED_RUN_ID = run
        return run

    def _start_run(self, resumed: dict[str, Any] | None, logs: dict[int, list[str]],
                   resume_step: int | None) -> None:
        """Name this run for the writer, and say what happens to an earlier run's
        checkpoints in the folder."""
        import jax

        from pcompile.backends.async_checkpoint import StepAgreement
        from pcompile.backends.checkpoint_files import run_steps

        run = self._run_id(resumed)
        self.run_id = run
        client = _kv_client()
        agreement = StepAgreement(run, client, jax.process_count() if client else 1,
                                  jax.process_index())
        self.saver.start_run(agreement, logs, resume_step)
        if resume_step is not None:
            return
        earlier = sorted({step for r in self.local
                          for step, owner in run_steps(self.ckpt_dir, r).items() if owner != run})
        if not earlier:
            return
        held = (f"{self.ckpt_dir} holds checkpoints of an earlier run (step(s) "
                f"{', '.join(map(str, earlier))})")
        if self.args.no_checkpoint and not self.args.checkpoint_every:
            self._say(f"{held}; this run writes none (--no-checkpoint) and leaves them",
                      force=True, first_only=True)
        else:
            self._say(f"{held}; this run ({run}) keeps them until it has written a checkpoint "
                      "on every rank, then removes them", force=True, first_only=True)

    def _resume_step(self) -> int | None:
        """--resume: the launcher's choice (--resume-step), else the newest step that every
        rank holds intact; newer damaged ones are reported and passed over."""
        from pcompile.backends.checkpoint_files import resume_point

        if self.args.resume_step is not None:
            return int(self.args.resume_step)
        point = resume_point(self.ckpt_dir, int(self.m.NUM_RANKS), self.m.PLAN_ID)
        if point.step is None:
            why = "; ".join(point.skipped) or "there is none"
            raise RankError(f"--resume: no step has an intact checkpoint of every rank in "
                            f"{self.ckpt_dir} ({why}); start without --resume")
        for line in point.skipped:
            self._say(f"passed over checkpoint {line}", force=True)
        return point.step

    def _checkpoint(self, step: int, epoch: int, in_epoch: int, state: dict[str, Any],
                    logs: dict[int, TrainLog], final: bool = False) -> None:
        """Hand this process's ranks' state to the background writer
        (backends/async_checkpoint.py), after the write in flight is done: host copies (the
        next step reuses the device buffers), or for the `final` one the buffers themselves."""
        from pcompile.backends.async_checkpoint import CheckpointWriteError

        try:
            self.saver.wait()
        except CheckpointWriteError as exc:
            raise RankError(str(exc)) from None
        start = time.perf_counter()
        pieces = self.host.take(state, final)
        layouts = {name: {"shape": list(self.m.LAYOUTS[name][0]), "dtype": dt,
                          "dev_matrix": list(self.m.LAYOUTS[name][1]),
                          "tensor_map": [list(e) if isinstance(e, tuple) else e
                                         for e in self.m.LAYOUTS[name][2]]}
                   for name, _, _, dt in self.stored}
        per_rank = {}
        for r in self.local:
            mine = [name for name in pieces if self._owns(name, r)]
            # the lines themselves go to the run's log once (async_checkpoint.py), not here
            meta = {"step": step, "epoch": epoch, "step_in_epoch": in_epoch, "rank": r,
                    "num_ranks": int(self.m.NUM_RANKS), "plan_id": self.m.PLAN_ID,
                    "log_lines": len(logs[r].lines),
                    "layouts": {name: layouts[name] for name in mine}}
            per_rank[r] = ({name: pieces[name][r] for name in mine}, meta)
        self.saver.submit(step, per_rank, time.perf_counter() - start,
                          logs={r: logs[r].lines for r in self.local}, final=final)

    def _callbacks(self) -> Any:
        """The model file's `callbacks()` (compiler/frontend/callbacks.py) as a CallbackRunner (None
        without any); what the built-in ones set (LossMonitor's per_print_times,
        ModelCheckpoint's save_checkpoint_steps and keep_checkpoint_max) becomes the value of
        each option this run left at its default."""
        from pcompile.compiler.driver.runtime import spec_callbacks

        try:
            callbacks, path = spec_callbacks(self._dataset_spec())
        except PcompileError as exc:
            raise RankError(str(exc)) from None
        if not callbacks:
            return None
        from pcompile.compiler.frontend.callbacks import CallbackRunner, run_settings

        self.args = args = SimpleNamespace(**vars(self.args))
        defaulted: set[str] = getattr(args, "defaulted", set())
        for name, value in run_settings(callbacks).items():
            if name == "print_every" and value == 0:  # LossMonitor(0): no loss lines
                if "quiet" in defaulted:
                    args.quiet = True
            elif name in defaulted:
                setattr(args, name, value)
        return CallbackRunner(callbacks, path,
                              lambda line: self._say(line, force=True, first_only=True),
                              parallel_mode=self.m.PARALLEL_MODE,
                              device_number=int(self.m.NUM_RANKS))

    def _hook(self, call: Any, *args: Any) -> None:
        """Call a CallbackRunner hook; a callback that fails is one RankError."""
        try:
            call(*args)
        except PcompileError as exc:
            raise RankError(str(exc)) from None

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        from pcompile.backends.async_checkpoint import AsyncCheckpointWriter, CheckpointWriteError

        if not self.m.TRAINING:
            return self._infer()
        self.hooks = self._callbacks()
        fault, mode = fault_injection(self.local)
        self.saver = AsyncCheckpointWriter(self.ckpt_dir, lambda line: self._say(line, force=True),
                                           keep=int(getattr(self.args, "keep_checkpoint_max",
                                                            None) or 2),
                                           fault=(fault, mode))
        try:
            return self._train()
        finally:
            self._profile(None, stop=True)  # a run that ends inside the profiled steps
            # the exit waits for a write in flight (its failure is reported unless another
            # error already ends the run)
            failing = sys.exc_info()[0] is not None
            try:
                self.saver.wait()
            except CheckpointWriteError as exc:
                if not failing:
                    raise RankError(str(exc)) from None
                print(f"{self.m.LABEL}: error: {exc}", file=sys.stderr, flush=True)

    def _train(self) -> int:
        import jax

        from pcompile.backends.async_checkpoint import CheckpointWriteError, HostState
        from pcompile.backends.atomic_files import clean_temp_files
        from pcompile.backends.jax.spmd import local_pieces
        from pcompile.program.progress import LossMonitor, ReadBack, format_loss_line

        m, args = self.m, self.args
        for r in self.local:  # temporary files of a killed checkpoint write
            clean_temp_files(os.path.join(self.ckpt_dir, f"rank_{r}"))
        resume_step = self._resume_step() if args.resume else None
        making = time.perf_counter()
        self.heartbeat.set(phase="init" if resume_step is None else "restore")
        meta: dict[str, Any]
        restored: dict[int, list[str]] = {r: [] for r in self.local}
        if resume_step is None:
            state, meta = self._initial_state(), {}
            self.timings["init"] = time.perf_counter() - making
        else:
            self._say(f"resuming from step {resume_step} (checkpoints in {self.ckpt_dir})",
                      force=True, first_only=True)
            values, meta, restored = self._load_values(resume_step)
            state = {name: self._put(name, {r: values[r][name] for r in self.local}, shape)
                     for name, _, shape, _ in self.stored}
            self.timings["restore"] = time.perf_counter() - making
        self.saver.intact = resume_step
        self.host = HostState(self.mesh, {name: shape for name, _, shape, _ in self.stored})
        if args.checkpoint_every and args.checkpoint_every < args.steps:
            self.host.prefault(state)
        done = resume_step or 0
        if done > args.steps:
            raise RankError(f"--steps {args.steps} is below the step {done} of the checkpoint "
                            "resumed from; ask for more steps")
        logs = {r: TrainLog(os.path.join(self._rank_dir(r), "train.log"), restored[r][:done])
                for r in self.local}
        self._start_run(meta if resume_step is not None else None,
                        {r: logs[r].lines for r in self.local}, resume_step)
        report = RankReport(m, self.mesh, self.out_dir, done, args.log_every,
                            writes=self.local[0] == 0, tensorboard=args.tensorboard,
                            run=self.run_id)
        fn = self._function(donate=True)
        out_names = list(m.OUTPUTS)
        extra_outputs = [i for i, name in enumerate(out_names) if i and name not in state]
        fault, fault_mode = fault_injection(self.local)
        first = True
        epoch, in_epoch = int(meta.get("epoch", 1)), int(meta.get("step_in_epoch", 0))
        trained = (epoch, in_epoch)  # the last step trained (a callback may stop before a batch)
        start = time.perf_counter()
        monitor = LossMonitor(args.steps, args.print_every,
                              lambda line: self._say(line, loss=True), done=done)
        self.heartbeat.set(phase="data", done=done)
        # Losses still on the device: read back (one wait) every --log-every steps, once the
        # step after them is on its way, before a checkpoint and at the end; the first at once.
        marks = {"since": 0.0, "called": 0.0}  # the last read-back; the first step's call

        def read(ready: list[tuple[int, int, int, Any, list[Any]]], last: bool) -> None:
            self.watchdog.arm(args.timeout * len(ready), f"steps {ready[0][0] + 1}.."
                                                         f"{ready[-1][0] + 1}")
            for k_done, ep, step_in, loss_out, _ in ready:
                losses = local_pieces(loss_out, self.mesh, ())
                for r in self.local:
                    logs[r].add(format_loss_line(ep, step_in, float(losses[r])))
                monitor(logs[self.local[0]].lines[-1])
                bad = [r for r in self.local if not np.isfinite(float(losses[r]))]
                if bad and args.fail_on_nan:
                    raise NonFiniteLossError(
                        f"the loss is {float(losses[bad[0]])} at step {k_done + 1} (epoch "
                        f"{ep}, step {step_in}); stopped (--no-fail-on-nan trains on)")
                if hooks is not None:
                    from pcompile.compiler.frontend.tensor import Tensor

                    self._hook(hooks.step_end, k_done + 1, ep, step_in,
                               Tensor(np.asarray(losses[self.local[0]])))
            now = time.perf_counter()
            if marks["since"]:  # steps after the first: their share of the time since
                per = (now - marks["since"]) / len(ready)
            else:  # the first step of this run: its call and read-back, less the compile
                per = now - marks["called"] - getattr(fn, "compile_seconds", 0.0)
            report.steps(ready, per, last or ready[-1][0] + 1 >= args.steps,
                         first=not marks["since"])
            marks["since"] = now
            self.watchdog.disarm()
            self.heartbeat.set(done=ready[-1][0] + 1)

        def finished(item: tuple[int, int, int, Any, list[Any]]) -> None:
            """Wait for a step to run (not read back): the device never holds more than
            program.progress.IN_FLIGHT unfinished steps, however long the --log-every
            groups, and the launcher sees each step done."""
            jax.block_until_ready(item[3])
            self.heartbeat.set(done=item[0] + 1)

        pending = ReadBack(args.log_every, read, first_at_once=True, wait=finished)
        hooks = self.hooks
        if hooks is not None:
            self._hook(hooks.train_begin)

        for k, (epoch, in_epoch, arrays, first_row) in enumerate(self._batches(args.steps,
                                                                               skip=done)):
            if k < done:
                continue
            self.watchdog.arm(args.startup_timeout if first else args.timeout,
                              f"step {k + 1}")
            failed = self.saver.failure()
            if failed is not None:  # a background checkpoint write failed: stop now
                raise RankError(str(failed))
            if fault == k + 1 and not fault_mode.startswith("checkpoint"):
                while fault_mode == "hang":
                    time.sleep(1)
                raise RuntimeError(f"PCOMPILE_FAULT_INJECT: failing at step {k + 1}")
            feeds = [self._put(name, {r: self._slice(name, a, r, first_row) for r in self.local},
                               shape)
                     for (name, _, shape, _), a in zip(self.inputs, arrays)]
            feeds += [state[name] for name, *_ in self.stored]
            if hooks is not None:
                if epoch != hooks.epoch:  # the previous epoch's steps done, then its end
                    pending.flush()
                    self._hook(hooks.epoch_end)
                    if hooks.stop_requested:  # asked at the epoch's end: no next epoch
                        self._say(f"a callback asked to stop after step {k} "
                                  "(run_context.request_stop())", force=True, first_only=True)
                        break
                    self._hook(hooks.epoch_begin, epoch)
                self._hook(hooks.step_begin, k + 1, epoch, in_epoch)
            self.heartbeat.set(phase="compile" if first else "compute")
            if first:
                marks["called"] = time.perf_counter()
            self._profile(k + 1)
            outs = fn(*feeds)
            for name, value in zip(out_names[1:], outs[1:]):
                if name in state:
                    state[name] = value
            loss_out = outs[-1] if len(outs) > len(out_names) else outs[0]
            step_no = k + 1
            pending.dispatched((k, epoch, in_epoch, loss_out,
                                [(out_names[i], outs[i]) for i in extra_outputs]), step_no)
            trained = (epoch, in_epoch)
            if hooks is not None and (hooks.per_step or hooks.stop_requested):
                pending.flush()  # step hooks in MindSpore's order: this step's end first
            if first:
                self.timings["compile"] = getattr(fn, "compile_seconds", 0.0)
                self.timings["first_step"] = (time.perf_counter() - marks["called"]
                                              - self.timings["compile"])
                self.timings["total"] = time.time() - self.timings["start"]
                self._say(report.startup(self.timings), force=True, first_only=True)
            first = False
            self._profile(k + 1, outs, stop=True)
            every = args.checkpoint_every
            if every and step_no % every == 0 and step_no < args.steps:
                pending.flush()
                self.heartbeat.set(phase="checkpoint")
                self._checkpoint(step_no, epoch, in_epoch, state, logs)
                self.heartbeat.set(phase="data", done=step_no)
            if hooks is not None and hooks.stop_requested:  # run_context.request_stop()
                self._say(f"a callback asked to stop after step {step_no} "
                          "(run_context.request_stop())", force=True, first_only=True)
                break
        pending.flush(last=True)
        if hooks is not None:
            self._hook(hooks.epoch_end)
            self._hook(hooks.train_end)
        loop_end = time.perf_counter()
        total = len(logs[self.local[0]].lines)
        if total > done and not args.no_checkpoint:
            self.heartbeat.set(phase="checkpoint", done=total)
            self._checkpoint(total, *trained, state, logs, final=True)
        waited = time.perf_counter()
        try:
            self.saver.wait()  # the exit waits for the last write
        except CheckpointWriteError as exc:
            raise RankError(str(exc)) from None
        waited = time.perf_counter() - waited
        self.heartbeat.set(phase="finish", done=total)
        if total > done and not args.no_checkpoint:
            self._say(f"the end of the run waited {waited:.2f} s for its last checkpoint",
                      force=True)
        elapsed = time.perf_counter() - start
        rate = ""
        steady = report.steady_ms()
        if steady is not None:  # the steady rate: without compiling
            rate = f" ({steady:.3f} ms/step after the first, median)"
        shared = " (the executable compiled by process 0)" if getattr(fn, "shared", False) else ""
        report.close()
        self._say(report.summary(total - done, done + 1, total, loop_end - start),
                  force=True, first_only=True)
        self._say(f"rank(s) {self.local[0]}..{self.local[-1]}: steps {done + 1}..{total} in "
                  f"{elapsed:.2f} s{rate}{shared}", force=True)
        return 0

    def _profile(self, step: int | None, outs: Any = None, stop: bool = False) -> None:
        """--profile-steps N..M: a jax.profiler trace from the call of step N to the end of
        step M (a resumed run from its first step when N is behind it), into --profile-dir
        (default <out>/profile), rank_<r> for this process (r its first rank)."""
        import jax

        window = getattr(self.args, "profile_steps", None)
        if window is None:
            return
        tracing: tuple[int, str] | None = getattr(self, "_tracing", None)
        if not stop and tracing is None and step is not None and window[0] <= step <= window[1]:
            base = self.args.profile_dir or os.path.join(self.out_dir, "profile")
            folder = os.path.join(os.path.abspath(base), f"rank_{self.local[0]}")
            try:
                os.makedirs(folder, exist_ok=True)
                jax.profiler.start_trace(folder)
            except Exception as exc:  # noqa: BLE001  (an unwritable folder, a trace running)
                raise RankError(f"--profile-steps: cannot trace into {folder}: {exc}") from None
            self._tracing: tuple[int, str] | None = (step, folder)
        elif stop and tracing is not None and (step is None or step >= window[1]):
            if outs is not None:
                jax.block_until_ready(outs)
            jax.profiler.stop_trace()
            self._tracing = None
            last = f"..{step}" if step is not None and step != tracing[0] else ""
            self._say(f"profile of step{'s' if last else ''} {tracing[0]}{last}: {tracing[1]} "
                      "(TensorBoard's profile plugin or Perfetto open it)", force=True,
                      first_only=True)

    def _infer(self) -> int:
        from pcompile.backends.jax.spmd import local_pieces
        from pcompile.backends.npz_files import save_npz

        state = self._initial_state()
        self.watchdog.arm(self.args.startup_timeout, "inference")
        self.heartbeat.set(phase="compute", done=0)
        _, _, arrays, first_row = next(iter(self._batches(1)))
        feeds = [self._put(name, {r: self._slice(name, a, r, first_row) for r in self.local},
                           shape)
                 for (name, _, shape, _), a in zip(self.inputs, arrays)]
        feeds += [state[name] for name, *_ in self.stored]
        outs = self._function()(*feeds)
        self.watchdog.disarm()
        # the step was traced in this process: _out_shapes holds its results' local shapes
        pieces = [local_pieces(o, self.mesh, shape) for o, shape in zip(outs, self._out_shapes)]
        for r in self.local:
            save_npz(os.path.join(self._rank_dir(r), "outputs.npz"),
                     {name: p[r] for name, p in zip(self.m.OUTPUTS, pieces)})
        self.heartbeat.set(phase="finish", done=1)
        self._say("inference outputs: " + ", ".join(
            f"{name} {tuple(p[self.local[0]].shape)}" for name, p in zip(self.m.OUTPUTS, pieces)),
            force=True)
        return 0

    def _say(self, text: str, force: bool = False, loss: bool = False,
             first_only: bool = False) -> None:
        """Print a line: loss lines (and `first_only` ones) only from process 0 (unless
        --all-ranks); other processes' lines carry `[rank r]` (r: their first rank)."""
        if self.args.quiet and not force:
            return
        first = self.local[0] == 0
        if first_only and not first and not self.args.all_ranks:
            return
        if loss and not first and not self.args.all_ranks:
            return
        try:
            print(("" if first else f"[rank {self.local[0]}] ") + text, flush=True)
        except OSError as exc:  # run.log (or wherever the output goes) on a full disk
            if exc.errno not in DISK_ERRNOS:
                raise
            raise write_error(output_path(), exc) from None
