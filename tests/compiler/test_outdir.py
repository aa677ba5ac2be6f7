"""The --out folder (compiler/driver/outdir.py): what a recompile replaces, keeps and refuses, the
lock, leftovers of a killed compile, unusable folders, the user's umask."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from pcompile.cli import main
from pcompile.compiler.driver.outdir import MANIFEST, lock_path, out_lock
from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from tests import ROOT

QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")
RUN_OUTPUTS = {
    "rank_0/train.log": b"epoch: 1 step: 1, loss is 1.0\n",
    "rank_0/run.log": b"a rank's output\n",
    "rank_0/outputs.npz": b"inference outputs",
    "launch.json": b"{}\n",
    "merged_step_00000005.npz": b"merged by pcompile-merge",
    "merged_step_00000006.safetensors": b"merged by pcompile-merge",
    "merged_step_00000008/model-00001-of-00002.safetensors": b"a shard",
    "merged_step_00000008/model.safetensors.index.json": b"its index",
    "checkpoints/rank_0/step_00000005.npz": b"a checkpoint of an older pcompile",
    "checkpoints/rank_0/step_00000007.safetensors": b"a checkpoint's tensors",
    "checkpoints/rank_0/step_00000007.json": b"its index",
}


def run_cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    return result.exit_code, result.output


def compile_into(out, devices: int = 1) -> None:
    compile_model(QUICKSTART, devices=devices, out_dir=str(out))


def tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_recompile_keeps_run_outputs_and_replaces_only_its_own_files(tmp_path) -> None:
    out = tmp_path / "out"
    compile_into(out)
    first = tree(out)
    manifest = json.loads((out / MANIFEST).read_text())
    assert "plan.json" in manifest["files"] and "rank_0/03_execute.ir" in manifest["files"]
    for rel, data in RUN_OUTPUTS.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    (out / "rank_0" / "00_trace.ir").write_text("edited by hand\n")  # pcompile's: replaced
    compile_into(out)
    after = tree(out)
    for rel, data in RUN_OUTPUTS.items():
        assert after[rel] == data, rel
    assert {k: v for k, v in after.items() if k not in RUN_OUTPUTS} == first
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out.pcompile-")]


def test_foreign_files_are_refused_by_name_and_nothing_changes(tmp_path) -> None:
    out = tmp_path / "out"
    compile_into(out)
    (out / "notes.txt").write_text("mine")
    (out / "rank_0" / "my_analysis.py").write_text("print(1)")
    (out / "empty_folder").mkdir()
    before = tree(out)
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(out), "--no-check"])
    assert code == 1
    assert "pcompile did not write" in output and "Traceback" not in output
    for name in ("notes.txt", "rank_0/my_analysis.py", "empty_folder/"):
        assert name in output
    assert tree(out) == before and (out / "empty_folder").is_dir()


def test_a_folder_without_a_manifest_is_foreign(tmp_path) -> None:
    out = tmp_path / "out"
    (out / "rank_0").mkdir(parents=True)
    (out / "plan.json").write_text("{}")  # e.g. written by an older pcompile
    (out / "rank_0" / "00_trace.ir").write_text("x")
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(out), "--no-check"])
    assert code == 1
    assert "no pcompile manifest" in output and "plan.json" in output
    assert (out / "plan.json").read_text() == "{}"


def test_a_smaller_recompile_removes_the_old_ranks_dumps_but_not_their_logs(tmp_path) -> None:
    out = tmp_path / "out"
    compile_into(out, devices=8)
    (out / "rank_5" / "train.log").write_text("loss\n")
    compile_into(out, devices=1)
    assert sorted(os.listdir(out)) == [".gitignore", MANIFEST, "params.json", "plan.json",
                                       "program.py", "rank_0", "rank_5"]
    assert os.listdir(out / "rank_5") == ["train.log"]


def test_a_compile_that_fails_before_writing_leaves_out_as_it_was(tmp_path) -> None:
    out = tmp_path / "out"
    compile_into(out)
    before = tree(out)

    def refuse(state, out_dir) -> None:
        raise PcompileError("refused before writing")

    with pytest.raises(PcompileError, match="refused before writing"):
        compile_model(QUICKSTART, devices=1, out_dir=str(out), before_write=refuse)
    assert tree(out) == before
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_leftovers_of_a_killed_compile_are_cleaned_by_the_next(tmp_path) -> None:
    out = tmp_path / "out"
    compile_into(out)
    # Killed while writing: an incomplete staging folder (its mark still there).
    staging = tmp_path / ".out.pcompile-new-4242-deadbeef"
    (staging / "rank_0").mkdir(parents=True)
    (staging / ".pcompile-staging").write_bytes(b"")
    (staging / "rank_0" / "00_trace.ir").write_bytes(b"x" * 10_000_000)
    (tmp_path / ".out.pcompile-lock").write_text("pid 4242: pcompile")  # its lock file
    compile_into(out)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    # Killed between the two renames of the swap: --out is missing, both halves are beside it.
    (out / "rank_0" / "train.log").write_text("kept\n")
    shutil.copytree(out, tmp_path / ".out.pcompile-new-4243-feedface")
    os.rename(out, tmp_path / ".out.pcompile-old-4243-cafebabe")
    compile_into(out)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert (out / "rank_0" / "train.log").read_text() == "kept\n"


class _Killed(BaseException):
    """Stands for SIGKILL at one point of a compile (no handler runs after it)."""


@pytest.mark.parametrize("where", ["retire", "discard"])
def test_a_cleanup_killed_at_any_file_is_finished_by_the_next_compile(tmp_path, monkeypatch,
                                                                      where: str) -> None:
    """A compile killed while it deletes the replaced folder's files (retire), or a complete
    staging folder's (discard), leaves a folder the next compile still recognises, whatever
    file it stopped at: the next compile finishes the job and nothing of it is left beside
    --out. The manifest goes last; a folder left with no file at all is removed."""
    out = tmp_path / "out"
    compile_into(out)
    (out / "rank_0" / "train.log").write_text("kept\n")
    whole = tree(out)
    count = len(whole) - 1  # the files of the folder being cleaned (not train.log)
    real_unlink, real_rmdir = os.unlink, os.rmdir

    def cleaned(path) -> bool:  # inside the folder being cleaned (not the lock file)
        return f".out.pcompile-{'old' if where == 'retire' else 'new'}-" in os.fspath(path)

    at = {"cut": 0, "done": 0}  # killed before deletion number `cut` (count: before an rmdir)

    def unlink(path, *args, **kwargs):
        if cleaned(path) and at["done"] == at["cut"]:
            raise _Killed
        at["done"] += cleaned(path)
        return real_unlink(path, *args, **kwargs)

    def rmdir(path, *args, **kwargs):
        if cleaned(path) and at["done"] >= count:
            raise _Killed
        return real_rmdir(path, *args, **kwargs)

    for cut in range(count + 1):
        at.update(cut=cut, done=0)
        if where == "discard":  # a complete staging folder whose swap never began
            staged = tmp_path / f".out.pcompile-new-1-{cut:08x}"
            shutil.copytree(out, staged)
            (staged / "rank_0" / "train.log").unlink()
            target = staged
        monkeypatch.setattr(os, "unlink", unlink)
        monkeypatch.setattr(os, "rmdir", rmdir)
        with pytest.raises(_Killed):
            compile_into(out)
        monkeypatch.undo()
        if where == "discard":
            assert target.exists()
        compile_into(out)
        assert tree(out) == whole, cut
        assert sorted(os.listdir(tmp_path)) == ["out"], cut


def test_a_users_folder_named_like_a_leftover_is_left_alone(tmp_path) -> None:
    """Only folders pcompile marked (its staging mark, or its manifest) are cleaned up; the
    user's own `.out.pcompile-new-*` / `-old-*` folders stay, whole."""
    out = tmp_path / "out"
    compile_into(out)
    mine = {".out.pcompile-new-mine": "my notes\n", ".out.pcompile-new-1-ab": "more\n",
            ".out.pcompile-old-mine": "old notes\n"}
    for name, text in mine.items():
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "notes.txt").write_text(text)
    compile_into(out)
    for name, text in mine.items():
        assert (tmp_path / name / "sub" / "notes.txt").read_text() == text
    assert sorted(os.listdir(tmp_path)) == sorted(["out", *mine])


def test_a_complete_staging_folder_keeps_what_pcompile_did_not_write(tmp_path) -> None:
    """A finished staging folder whose swap never began is discarded, except for a file the
    compile did not write."""
    out = tmp_path / "out"
    compile_into(out)
    staged = tmp_path / ".out.pcompile-new-4244-0badf00d"
    shutil.copytree(out, staged)
    (staged / "keep.txt").write_text("not pcompile's\n")
    with pytest.warns(RuntimeWarning, match="did not write"):
        compile_into(out)
    assert sorted(p.name for p in staged.iterdir()) == ["keep.txt"]


def _hold_lock_in_another_process(out) -> subprocess.Popen[str]:
    code = ("import sys, time\nfrom pcompile.compiler.driver.outdir import out_lock\n"
            f"with out_lock({str(out)!r}):\n    print('held', flush=True)\n    time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_the_lock_refuses_a_second_pcompile_and_names_the_first(tmp_path) -> None:
    out = tmp_path / "out"
    compile_into(out)
    before = tree(out)
    holder = _hold_lock_in_another_process(out)
    try:
        code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(out), "--no-check",
                                "--run", "--steps", "2"])
        assert code == 1, output
        assert "is in use by another pcompile" in output and f"pid {holder.pid}" in output
        assert tree(out) == before
        with pytest.raises(PcompileError, match="in use"):
            compile_into(out)
    finally:
        holder.kill()
        holder.wait()
    # The holder was killed: its lock went with it, and its lock file is reused, then removed.
    assert os.path.exists(lock_path(str(out)))
    compile_into(out)
    assert not os.path.exists(lock_path(str(out)))


def test_the_lock_is_reentrant_in_one_process(tmp_path) -> None:
    out = tmp_path / "out"
    with out_lock(str(out)):
        compile_into(out)  # the driver takes it again
        assert os.path.exists(lock_path(str(out)))
    assert not os.path.exists(lock_path(str(out)))


def test_empty_or_unusable_out_is_one_message(tmp_path) -> None:
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", "", "--no-check"])
    assert code == 1 and "--out is empty" in output
    afile = tmp_path / "file"
    afile.write_text("x")
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(afile), "--no-check"])
    assert code == 2 and "is a file" in output  # click checks it
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(afile / "sub"),
                            "--no-check"])
    assert code == 1 and "is a file, not a folder" in output and "Traceback" not in output


# Permissions mean nothing to root: as root, the child first drops every capability (from its
# bounding set, so the exec'd command has none), then runs the command.
_WITHOUT_CAPABILITIES = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for cap in range(64):
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
os.execv(sys.argv[1], sys.argv[1:])
"""


def _unprivileged(command: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return command
    return [sys.executable, "-c", _WITHOUT_CAPABILITIES, *command]


@pytest.fixture
def shared_tmp(tmp_path):
    yield str(tmp_path)
    for root, dirs, _ in os.walk(tmp_path):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777)


def _cli(args: list[str], unprivileged: bool = False,
         **kwargs) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pcompile", QUICKSTART, "--devices", "1", "--no-check",
               *args]
    return subprocess.run(_unprivileged(command) if unprivileged else command,
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
                          **kwargs)


def test_read_only_places_are_one_message(shared_tmp) -> None:
    readonly = os.path.join(shared_tmp, "readonly")
    os.mkdir(readonly, 0o555)
    os.chmod(readonly, 0o555)
    proc = _cli(["--out", os.path.join(readonly, "out")], unprivileged=True)
    assert proc.returncode == 1, proc.stderr
    assert "pcompile: error: cannot" in proc.stderr and "Permission denied" in proc.stderr
    assert "Traceback" not in proc.stderr
    # An existing --out in a folder that became read-only: refused, left as it was.
    parent = os.path.join(shared_tmp, "parent")
    os.mkdir(parent, 0o777)
    os.chmod(parent, 0o777)
    out = os.path.join(parent, "out")
    assert _cli(["--out", out], unprivileged=True).returncode == 0
    os.chmod(parent, 0o555)
    before = sorted(os.listdir(out))
    proc = _cli(["--out", out], unprivileged=True)
    assert proc.returncode == 1 and "Permission denied" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and sorted(os.listdir(out)) == before


def test_out_is_created_with_the_users_umask(tmp_path) -> None:
    for umask, folder_mode, file_mode in ((0o027, 0o750, 0o640), (0o002, 0o775, 0o664)):
        out = tmp_path / f"out{umask:o}"
        proc = _cli(["--out", str(out)], umask=umask)
        assert proc.returncode == 0, proc.stderr
        assert stat.S_IMODE(os.stat(out).st_mode) == folder_mode
        assert stat.S_IMODE(os.stat(out / "rank_0").st_mode) == folder_mode
        assert stat.S_IMODE(os.stat(out / "plan.json").st_mode) == file_mode


@pytest.mark.slow  # a multi-process run (~11 s of CPU)
def test_a_killed_compile_never_damages_the_previous_output(tmp_path) -> None:
    """SIGKILL a recompile at a few points in its life: --out is always a whole compile."""
    out = tmp_path / "out"
    compile_into(out, devices=8)
    (out / "rank_0" / "train.log").write_text("kept\n")
    whole = tree(out)
    for delay in (0.5, 1.5, 2.5):
        proc = subprocess.Popen([sys.executable, "-m", "pcompile", QUICKSTART, "--devices", "8",
                                 "--out", str(out), "--no-check"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        if out.exists():
            assert tree(out) == whole
        compile_into(out, devices=8)  # cleans what the killed one left
        assert tree(out) == whole
        assert sorted(os.listdir(tmp_path)) == ["out"]


def test_what_merge_and_tensorboard_wrote_inside_out_survives_a_recompile(tmp_path) -> None:
    """`pcompile-merge DIR --output DIR/hf` and `--tensorboard DIR/tb` write into --out at
    places of the user's choosing: the next compile into DIR (a --resume recompiles) keeps
    them; a .safetensors file pcompile-merge did not write is still refused."""
    import numpy as np

    from pcompile.backends.merge_output import Entry, write_merged

    out = tmp_path / "out"
    compile_into(out)
    entries = [Entry("w", np.dtype("float32"), (4, 2)), Entry("b", np.dtype("float32"), (3,))]

    def tensors():
        return iter([(e.name, np.ones(e.shape, e.dtype)) for e in entries])

    write_merged(str(out / "hf"), entries, tensors(), {"step": "5"}, folder=True)
    write_merged(str(out / "hf_shards"), entries, tensors(), {"step": "5"}, max_shard=16,
                 folder=True)  # two shards and model.safetensors.index.json
    write_merged(str(out / "weights.safetensors"), entries, tensors(), {"step": "5"},
                 folder=False)
    (out / "tb").mkdir()
    (out / "tb" / "events.out.tfevents.1765000000.host").write_bytes(b"scalars")
    (out / "events.out.tfevents.1765000001.host.1").write_bytes(b"--tensorboard DIR")
    written = {rel: data for rel, data in tree(out).items()
               if rel.startswith(("hf", "weights", "tb/", "events"))}
    assert len(written) == 7 and "hf_shards/model.safetensors.index.json" in written
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(out), "--no-check"])
    assert code == 0, output
    after = tree(out)
    assert {rel: after.get(rel) for rel in written} == written
    assert MANIFEST in after and not any(
        rel in json.loads(after[MANIFEST])["files"] for rel in written)
    (out / "theirs").mkdir()
    (out / "theirs" / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}      ")
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(out), "--no-check"])
    assert code == 1 and "theirs/model.safetensors" in output


def test_an_output_folder_is_neither_tracked_by_git_nor_linted_by_ruff(tmp_path) -> None:
    """Any --out inside a clone: its `.gitignore` (`*`) hides it from git and from ruff."""
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    if shutil.which("git") is None or not os.path.exists(ruff):
        pytest.skip("needs git and ruff")
    clone = tmp_path / "clone"
    subprocess.run(["git", "init", "-q", str(clone)], check=True)
    (clone / "model.py").write_text("x = 1\n")
    out = clone / "runs" / "my_out"
    compile_into(out)
    assert (out / "program.py").exists()
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                            cwd=clone, capture_output=True, text=True, check=True).stdout
    assert status.splitlines() == ["?? model.py"]
    files = subprocess.run([ruff, "check", "--show-files", "--no-cache", "."], cwd=clone,
                           capture_output=True, text=True).stdout
    assert "model.py" in files and "my_out" not in files, files
    assert ".gitignore" in json.loads((out / MANIFEST).read_text())["files"]


def test_an_unwritable_tensorboard_folder_is_one_message_before_the_compile(shared_tmp) -> None:
    """It was a traceback from rank 0 after start-up (or, without tensorboardX, a message after
    the compile): now one message before anything is compiled or written."""
    out = os.path.join(shared_tmp, "out")
    blocker = os.path.join(shared_tmp, "a_file")
    open(blocker, "w").close()
    code, output = run_cli([QUICKSTART, "--devices", "1", "--no-check", "--out", out, "--run",
                            "--tensorboard", os.path.join(blocker, "tb")])
    assert code == 1 and "--tensorboard" in output and "is a file, not a folder" in output
    assert "compiled " not in output and not os.path.exists(out)
    readonly = os.path.join(shared_tmp, "readonly")
    os.mkdir(readonly, 0o555)
    os.chmod(readonly, 0o555)
    proc = _cli(["--out", out, "--run", "--tensorboard", os.path.join(readonly, "tb")],
                unprivileged=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--tensorboard" in proc.stderr and "Permission denied" in proc.stderr
    assert "compiled " not in proc.stdout and not os.path.exists(out)
    assert os.listdir(readonly) == []
