"""Per-rank checkpoints (sliced parameters and optimizer state), deterministic npz files and
`pcompile-merge`, which reassembles full tensors from the ranks' slices.

Layout on disk (see docs/running.md):

    <out>/rank_<r>/params.npz                          initial values of rank r (compile)
    <out>/checkpoints/rank_<r>/step_<SSSSSSSS>.npz     rank r after step S (training)

A checkpoint holds rank r's slice of every stored tensor (weights and optimizer state, keyed by
graph-parameter name) and `__meta__`, a JSON string: step, epoch, step in epoch, rank, number
of ranks, plan id, the train.log lines so far, and every tensor's layout (global shape, dtype,
device matrix, tensor map), so that merging needs nothing else (plan.json's parameter layouts
are cross-checked when present), and a manifest of every array (shape, dtype, sha256).
Files are written to a temporary name (`.step_<S>.npz.tmp-<token>`, removed by the next write
if a kill left it) and moved into place with `os.replace`, so a crash never leaves half a
checkpoint under the final name.

Reading verifies a checkpoint against its manifest and layouts: a truncated, empty, corrupt
(bad CRC), unlabelled or misshapen file raises `CheckpointError` naming the file and the fault.
`resume_point` picks the newest step that every rank holds intact, and says which newer steps
it passed over and why; `pcompile-merge` and `--resume` use it.

    pcompile-merge OUT_DIR [--step S] [--output FILE.npz]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import secrets
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

META_KEY = "__meta__"
_STEP_FILE = re.compile(r"^step_(\d+)\.npz$")
_TEMP_FILE = re.compile(r"\.[^/]+\.tmp-[0-9a-f]+")
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


# -- files -------------------------------------------------------------------------------------


def temp_name(path: str) -> str:
    """The temporary file an atomic write of `path` goes through: `.<name>.tmp-<token>` in the
    same folder (compiler/outdir.py and `clean_temp_files` recognise leftovers by this name)."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.tmp-{secrets.token_hex(4)}")


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and os.replace (the
    user's umask applies to the file, as to any other)."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def clean_temp_files(folder: str) -> list[str]:
    """Remove the temporary files of atomic writes in `folder` that were killed before their
    rename (call it before this process writes there; nobody else writes a rank's folder)."""
    removed: list[str] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return removed
    for name in names:
        if _TEMP_FILE.fullmatch(name):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


#: The .npz member naming the arrays stored as the bits of an extension dtype (bfloat16).
DTYPES_KEY = "__dtypes__"


def portable(array: np.ndarray) -> tuple[np.ndarray, str | None]:
    """An array numpy's .npy format stores faithfully: extension dtypes (bfloat16, which .npy
    would write as raw `V2` bytes) as the unsigned integers of their bits, with the dtype's
    name to view them back."""
    if array.dtype.kind in "biufSU":
        return array, None
    from pcompile.ir.types import DType

    try:
        name = DType.from_any(array.dtype).name
    except TypeError:  # not an IR dtype (a metadata blob): stored as it is
        return array, None
    width = array.dtype.itemsize * 8
    return array.view(np.dtype(f"uint{width}")), name


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """An .npz (readable by np.load) with fixed timestamps and sorted keys: the same arrays
    always give the same bytes. bfloat16 arrays keep their dtype (`portable`; `load_npz`
    restores it)."""
    buf = io.BytesIO()
    views: dict[str, str] = {}
    stored: dict[str, np.ndarray] = {}
    for key, value in arrays.items():
        stored[key], view = portable(np.asarray(value))
        if view is not None:
            views[key] = view
    if views:
        stored[DTYPES_KEY] = np.frombuffer(json.dumps(views, sort_keys=True).encode(), np.uint8)
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(stored):
            member = io.BytesIO()
            np.lib.format.write_array(member, stored[key], allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=_FIXED_TIME)
            info.external_attr = 0o644 << 16
            zf.writestr(info, member.getvalue())
    return buf.getvalue()


def restore_dtypes(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Undo `portable` for the arrays an .npz's `__dtypes__` member names."""
    names = arrays.pop(DTYPES_KEY, None)
    if names is None:
        return arrays
    from pcompile.ir.types import DType

    for key, name in json.loads(bytes(names.astype(np.uint8)).decode()).items():
        if key in arrays:
            arrays[key] = arrays[key].view(DType[name].np)
    return arrays


def save_npz(path: str, arrays: Mapping[str, np.ndarray]) -> None:
    atomic_write_bytes(path, npz_bytes(arrays))


def load_npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return restore_dtypes({k: np.array(data[k]) for k in data.files})


# -- checkpoints -------------------------------------------------------------------------------


def checkpoint_path(folder: str, rank: int, step: int) -> str:
    return os.path.join(folder, f"rank_{rank}", f"step_{step:08d}.npz")


def rank_steps(folder: str, rank: int) -> list[int]:
    """Steps with a checkpoint file of `rank` (intact or not), ascending."""
    d = os.path.join(folder, f"rank_{rank}")
    if not os.path.isdir(d):
        return []
    steps = [int(m.group(1)) for name in os.listdir(d) if (m := _STEP_FILE.match(name))]
    return sorted(steps)


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def write_checkpoint(folder: str, rank: int, step: int, values: Mapping[str, np.ndarray],
                     meta: dict[str, Any], keep: int = 2) -> str:
    """Rank `rank`'s checkpoint after `step` (atomic); keeps the newest `keep` per rank.
    `__meta__` gets a manifest of every array (shape, dtype, sha256) that `read_checkpoint`
    verifies."""
    arrays = {k: np.asarray(v) for k, v in values.items()}
    meta = dict(meta)
    meta["arrays"] = {k: {"shape": list(a.shape), "dtype": a.dtype.str, "sha256": _digest(a)}
                      for k, a in sorted(arrays.items())}
    arrays[META_KEY] = np.array(json.dumps(meta, sort_keys=True))
    path = checkpoint_path(folder, rank, step)
    clean_temp_files(os.path.dirname(path))
    save_npz(path, arrays)
    for old in rank_steps(folder, rank)[:-keep] if keep > 0 else []:
        try:
            os.unlink(checkpoint_path(folder, rank, old))
        except OSError:
            pass
    return path


def read_checkpoint(path: str, rank: int | None = None
                    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and metadata of a checkpoint, verified against its manifest (every array
    present with its shape, dtype and checksum) and, given `rank`, against the slice shapes
    of the layouts it records. Anything wrong: `CheckpointError` saying what."""
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror})") from None
    if size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): its write was cut short")
    try:
        arrays = load_npz(path)
    except zipfile.BadZipFile as exc:
        what = "corrupt" if "CRC" in str(exc) else "truncated or not an .npz file"
        raise CheckpointError(f"{path} is {what} ({exc})") from None
    except Exception as exc:  # noqa: BLE001  (a damaged file can fail in numpy or zipfile)
        raise CheckpointError(f"{path} is damaged: {type(exc).__name__}: {exc}") from None
    if META_KEY not in arrays:
        raise CheckpointError(f"{path} has no metadata ({META_KEY}): not a pcompile checkpoint")
    try:
        meta = json.loads(str(arrays.pop(META_KEY)))
    except ValueError as exc:
        raise CheckpointError(f"{path}: its metadata is not valid JSON ({exc})") from None
    manifest = meta.get("arrays") if isinstance(meta, dict) else None
    if not isinstance(manifest, dict) or not isinstance(meta.get("layouts"), dict):
        raise CheckpointError(f"{path}: its metadata has no manifest of the arrays "
                              "(written by another tool or an older pcompile)")
    extra = sorted(set(arrays) - set(manifest))
    if extra:
        raise CheckpointError(f"{path} holds arrays its manifest does not list: "
                              f"{', '.join(extra)}")
    for name, entry in manifest.items():
        problem = _array_problem(name, arrays.get(name), entry, meta["layouts"].get(name), rank)
        if problem:
            raise CheckpointError(f"{path}: {problem}")
    return arrays, meta


def _array_problem(name: str, array: np.ndarray | None, entry: Any, layout: Any,
                   rank: int | None) -> str:
    if array is None:
        return f"{name} is missing"
    if not isinstance(entry, dict):
        return f"the manifest entry of {name} is malformed"
    if list(array.shape) != entry.get("shape") or array.dtype.str != entry.get("dtype"):
        return (f"{name} has shape {tuple(array.shape)} and dtype {array.dtype}, the manifest "
                f"says {entry.get('shape')} {entry.get('dtype')}")
    if _digest(array) != entry.get("sha256"):
        return f"{name}: its contents do not match the checksum in the manifest"
    if rank is not None and layout is not None and array.shape:
        try:
            want = tuple(e - b for b, e in _layout(layout).slice_bounds(rank))
        except Exception as exc:  # noqa: BLE001  (malformed layout metadata)
            return f"the layout of {name} is malformed ({exc})"
        if tuple(array.shape) != want:
            return f"{name} has shape {tuple(array.shape)}, rank {rank}'s slice is {want}"
    return ""


def checkpoint_problem(path: str, rank: int, plan_id: str | None = None) -> str:
    """Why rank `rank`'s checkpoint at `path` cannot be resumed from ('' if it can)."""
    if not os.path.exists(path):
        return "no checkpoint"
    try:
        _, meta = read_checkpoint(path, rank)
    except CheckpointError as exc:
        return str(exc)
    if plan_id is not None and meta.get("plan_id") != plan_id:
        return (f"{path} was written by plan {meta.get('plan_id')}, this program is plan "
                f"{plan_id}")
    return ""


@dataclass
class ResumePoint:
    """The newest step that every rank holds intact (None: none), and why newer ones were
    passed over."""

    step: int | None
    skipped: list[str] = field(default_factory=list)


def resume_point(folder: str, num_ranks: int, plan_id: str | None = None) -> ResumePoint:
    """The newest step for which every rank's checkpoint reads back intact (verified), with a
    line per newer step that was passed over (which rank, what is wrong)."""
    steps: set[int] = set()
    for r in range(num_ranks):
        steps.update(rank_steps(folder, r))
    point = ResumePoint(None)
    for step in sorted(steps, reverse=True):
        problems = [f"rank {r}: {why}" for r in range(num_ranks)
                    if (why := checkpoint_problem(checkpoint_path(folder, r, step), r, plan_id))]
        if not problems:
            point.step = step
            return point
        point.skipped.append(f"step {step}: " + "; ".join(problems))
    return point


def clear_checkpoints(folder: str) -> None:
    """Delete the checkpoints (and their leftover temporary files) of a previous run from
    `folder`, and nothing else: other files and the folders holding them stay."""
    if not os.path.isdir(folder):
        return
    for name in sorted(os.listdir(folder)):
        sub = os.path.join(folder, name)
        if not (re.fullmatch(r"rank_\d+", name) and os.path.isdir(sub)):
            continue
        for f in os.listdir(sub):
            if _STEP_FILE.match(f) or _TEMP_FILE.fullmatch(f):
                os.unlink(os.path.join(sub, f))
        try:
            os.rmdir(sub)
        except OSError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass


def layout_entry(layout: Any, shape: tuple[int, ...], dtype: str) -> dict[str, Any]:
    """The JSON form of a TensorLayout (None: not split)."""
    if layout is None:
        return {"shape": list(shape), "dtype": dtype, "dev_matrix": [1],
                "tensor_map": [-1] * len(shape)}
    return {
        "shape": list(layout.shape),
        "dtype": dtype,
        "dev_matrix": list(layout.dev_matrix),
        "tensor_map": [list(e) if isinstance(e, tuple) else e for e in layout.tensor_map],
    }


def _layout(entry: Mapping[str, Any]) -> Any:
    from pcompile.ir.layout import TensorLayout

    tmap = tuple(tuple(e) if isinstance(e, list) else e for e in entry["tensor_map"])
    return TensorLayout(tuple(entry["dev_matrix"]), tmap, tuple(entry["shape"]))


# -- merge -------------------------------------------------------------------------------------


class MergeError(Exception):
    pass


def merge_checkpoints(out_dir: str, step: int | None = None,
                      folder: str | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Full tensors from every rank's checkpoint of `step` (default: the newest step every
    rank holds intact; `info["skipped"]` says which newer steps were passed over and why).
    Checks every file against its manifest, that replicas of one slice agree bit for bit and
    that layouts match plan.json."""
    folder = folder or os.path.join(out_dir, "checkpoints")
    plan_path = os.path.join(out_dir, "plan.json")
    plan = None
    if os.path.exists(plan_path):
        from pcompile.compiler.plan import PlanError, read_plan

        try:  # validated against its schema (compiler/plan.py)
            plan = read_plan(out_dir).model_dump(mode="json")
        except PlanError as exc:
            raise MergeError(str(exc)) from None
        num_ranks = int(plan["devices"])
    else:
        num_ranks = _count_ranks(folder)
    skipped: list[str] = []
    if step is None:
        point = resume_point(folder, num_ranks)
        skipped = point.skipped
        if point.step is None:
            why = "".join(f"\n  {line}" for line in skipped)
            raise MergeError(f"no step has an intact checkpoint of all {num_ranks} ranks in "
                             f"{folder}{why}")
        step = point.step
    full: dict[str, np.ndarray] = {}
    filled: dict[str, np.ndarray] = {}
    meta0: dict[str, Any] = {}
    for r in range(num_ranks):
        path = checkpoint_path(folder, r, step)
        if not os.path.exists(path):
            raise MergeError(f"rank {r} has no checkpoint of step {step} ({path})")
        try:
            arrays, meta = read_checkpoint(path, r)
        except CheckpointError as exc:
            raise MergeError(str(exc)) from None
        if r == 0:
            meta0 = meta
        elif meta.get("plan_id") != meta0.get("plan_id"):
            raise MergeError(f"rank {r}'s checkpoint belongs to another plan than rank 0's")
        for name, value in arrays.items():
            entry = meta["layouts"][name]
            _check_plan_layout(plan, name, entry)
            layout = _layout(entry)
            if name not in full:
                full[name] = np.zeros(layout.shape, value.dtype)
                filled[name] = np.zeros(layout.shape, bool)
            if not value.shape:  # a scalar (step counters): every rank holds it
                if filled[name].all() and not np.array_equal(full[name], value):
                    raise MergeError(f"{name}: rank {r}'s value differs from another rank's")
                full[name][...] = value
                filled[name][...] = True
                continue
            index = tuple(slice(b, e) for b, e in layout.slice_bounds(r))
            if value.shape != full[name][index].shape:
                raise MergeError(
                    f"{name}: rank {r} holds shape {value.shape}, its layout gives "
                    f"{full[name][index].shape}")
            seen = filled[name][index]
            if seen.any() and not np.array_equal(full[name][index][seen], value[seen]):
                raise MergeError(f"{name}: rank {r}'s replica differs from another rank's")
            full[name][index] = value
            filled[name][index] = True
    for name, mask in filled.items():
        if not mask.all():
            raise MergeError(f"{name}: some elements are held by no rank")
    info = {k: meta0.get(k) for k in ("step", "epoch", "step_in_epoch", "plan_id", "num_ranks")}
    info["skipped"] = skipped
    return full, info


def _count_ranks(folder: str) -> int:
    ranks = [int(m.group(1)) for name in os.listdir(folder)
             if (m := re.match(r"^rank_(\d+)$", name))] if os.path.isdir(folder) else []
    if not ranks:
        raise MergeError(f"no rank checkpoints in {folder}")
    return max(ranks) + 1


def _check_plan_layout(plan: Mapping[str, Any] | None, name: str,
                       entry: Mapping[str, Any]) -> None:
    if not plan:
        return
    stored = dict(plan.get("parameters", {}).get(name) or {})
    shard = (plan.get("parallel_optimizer") or {}).get(name)
    if shard:  # the parallel optimizer stores the parameter split further
        stored["dev_matrix"] = shard["stored_dev_matrix"]
        stored["tensor_map"] = shard["stored_tensor_map"]
    if not stored or stored.get("kind") == "input":
        return
    if list(stored["shape"]) != list(entry["shape"]) or (
            _layout(entry) != _layout({"shape": stored["shape"],
                                       "dev_matrix": stored["dev_matrix"],
                                       "tensor_map": stored["tensor_map"]})):
        raise MergeError(f"{name}: the checkpoint's layout differs from plan.json's")


def main(argv: list[str] | None = None) -> int:
    """`pcompile-merge OUT_DIR [--step S] [--output FILE]`."""
    parser = argparse.ArgumentParser(
        prog="pcompile-merge",
        description="Merge the per-rank checkpoints of a pcompile run into full tensors.")
    parser.add_argument("out_dir", help="the --out folder of the compile (holds plan.json)")
    parser.add_argument("--step", type=int, default=None,
                        help="which step (default: the newest one every rank holds intact)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where the rank checkpoints are (default OUT_DIR/checkpoints)")
    parser.add_argument("--output", default=None,
                        help="merged .npz (default OUT_DIR/merged_step_<S>.npz)")
    args = parser.parse_args(argv)
    try:
        full, info = merge_checkpoints(args.out_dir, args.step, args.checkpoint_dir)
    except (MergeError, CheckpointError, OSError, ValueError, KeyError) as exc:
        print(f"pcompile-merge: error: {exc}", file=sys.stderr)
        return 1
    for line in info.pop("skipped"):
        print(f"pcompile-merge: passed over {line}", file=sys.stderr)
    output = args.output or os.path.join(args.out_dir, f"merged_step_{info['step']:08d}.npz")
    arrays = dict(full)
    arrays[META_KEY] = np.array(json.dumps(info, sort_keys=True))
    try:
        save_npz(output, arrays)
    except OSError as exc:
        print(f"pcompile-merge: error: cannot write {output}: {exc.strerror}", file=sys.stderr)
        return 1
    total = sum(a.nbytes for a in full.values())
    print(f"merged step {info['step']} of {info['num_ranks']} ranks: {len(full)} tensors, "
          f"{total} bytes -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
