"""Per-rank checkpoints (sliced parameters and optimizer state), deterministic npz files and
`pcompile-merge`, which reassembles full tensors from the ranks' slices.

Layout on disk (see docs/running.md):

    <out>/rank_<r>/params.npz                          initial values of rank r (compile)
    <out>/checkpoints/rank_<r>/step_<SSSSSSSS>.npz     rank r after step S (training)

A checkpoint holds rank r's slice of every stored tensor (weights and optimizer state, keyed by
graph-parameter name) and `__meta__`, a JSON string: step, epoch, step in epoch, rank, number
of ranks, plan id, the train.log lines so far, and every tensor's layout (global shape, dtype,
device matrix, tensor map), so that merging needs nothing else (plan.json's parameter layouts
are cross-checked when present). Files are written to a temporary name and moved into place
with `os.replace`, so a crash never leaves half a checkpoint under the final name.

    pcompile-merge OUT_DIR [--step S] [--output FILE.npz]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

META_KEY = "__meta__"
_STEP_FILE = re.compile(r"^step_(\d+)\.npz$")
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


# -- files -------------------------------------------------------------------------------------


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and os.replace."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=folder)
    try:
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


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """An .npz (readable by np.load) with fixed timestamps and sorted keys: the same arrays
    always give the same bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(arrays):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.asarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=_FIXED_TIME)
            info.external_attr = 0o644 << 16
            zf.writestr(info, member.getvalue())
    return buf.getvalue()


def save_npz(path: str, arrays: Mapping[str, np.ndarray]) -> None:
    atomic_write_bytes(path, npz_bytes(arrays))


def load_npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: np.array(data[k]) for k in data.files}


# -- checkpoints -------------------------------------------------------------------------------


def checkpoint_path(folder: str, rank: int, step: int) -> str:
    return os.path.join(folder, f"rank_{rank}", f"step_{step:08d}.npz")


def rank_steps(folder: str, rank: int) -> list[int]:
    """Steps with a complete checkpoint of `rank`, ascending."""
    d = os.path.join(folder, f"rank_{rank}")
    if not os.path.isdir(d):
        return []
    steps = [int(m.group(1)) for name in os.listdir(d) if (m := _STEP_FILE.match(name))]
    return sorted(steps)


def latest_common_step(folder: str, num_ranks: int) -> int | None:
    """The last step for which every rank has a checkpoint (None: no such step)."""
    common: set[int] | None = None
    for r in range(num_ranks):
        steps = set(rank_steps(folder, r))
        common = steps if common is None else common & steps
    return max(common) if common else None


def write_checkpoint(folder: str, rank: int, step: int, values: Mapping[str, np.ndarray],
                     meta: dict[str, Any], keep: int = 2) -> str:
    """Rank `rank`'s checkpoint after `step` (atomic); keeps the newest `keep` per rank."""
    arrays = {k: np.asarray(v) for k, v in values.items()}
    arrays[META_KEY] = np.array(json.dumps(meta, sort_keys=True))
    path = checkpoint_path(folder, rank, step)
    save_npz(path, arrays)
    for old in rank_steps(folder, rank)[:-keep] if keep > 0 else []:
        try:
            os.unlink(checkpoint_path(folder, rank, old))
        except OSError:
            pass
    return path


def read_checkpoint(path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    arrays = load_npz(path)
    if META_KEY not in arrays:
        raise ValueError(f"{path} is not a pcompile checkpoint (no {META_KEY})")
    meta = json.loads(str(arrays.pop(META_KEY)))
    return arrays, meta


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
    """Full tensors from every rank's checkpoint of `step` (default: the last complete step).
    Checks that replicas of one slice agree bit for bit and that layouts match plan.json."""
    folder = folder or os.path.join(out_dir, "checkpoints")
    plan_path = os.path.join(out_dir, "plan.json")
    plan = None
    if os.path.exists(plan_path):
        with open(plan_path, encoding="utf-8") as f:
            plan = json.load(f)
    num_ranks = int(plan["devices"]) if plan else _count_ranks(folder)
    if step is None:
        step = latest_common_step(folder, num_ranks)
        if step is None:
            raise MergeError(f"no step has a checkpoint of all {num_ranks} ranks in {folder}")
    full: dict[str, np.ndarray] = {}
    filled: dict[str, np.ndarray] = {}
    meta0: dict[str, Any] = {}
    for r in range(num_ranks):
        path = checkpoint_path(folder, r, step)
        if not os.path.exists(path):
            raise MergeError(f"rank {r} has no checkpoint of step {step} ({path})")
        arrays, meta = read_checkpoint(path)
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
                        help="which step (default: the last one every rank has)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where the rank checkpoints are (default OUT_DIR/checkpoints)")
    parser.add_argument("--output", default=None,
                        help="merged .npz (default OUT_DIR/merged_step_<S>.npz)")
    args = parser.parse_args(argv)
    try:
        full, info = merge_checkpoints(args.out_dir, args.step, args.checkpoint_dir)
    except (MergeError, OSError, ValueError, KeyError) as exc:
        print(f"pcompile-merge: error: {exc}", file=sys.stderr)
        return 1
    output = args.output or os.path.join(args.out_dir, f"merged_step_{info['step']:08d}.npz")
    arrays = dict(full)
    arrays[META_KEY] = np.array(json.dumps(info, sort_keys=True))
    save_npz(output, arrays)
    total = sum(a.nbytes for a in full.values())
    print(f"merged step {info['step']} of {info['num_ranks']} ranks: {len(full)} tensors, "
          f"{total} bytes -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
