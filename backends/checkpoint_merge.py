"""`pcompile-merge`: the full tensors of a run reassembled from every rank's checkpoint
(backends/checkpoint_files.py) of one step, one tensor at a time, checked (manifests, replicas
that agree bit for bit, every element held by some rank, layouts against plan.json), and
written as safetensors (backends/merge_output.py) or an .npz. See docs/running.md.

    pcompile-merge OUT_DIR [--step S] [--output FILE.npz]
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from pcompile.backends.checkpoint_files import (
    META_KEY,
    CheckpointError,
    CheckpointReader,
    checkpoint_path,
    entry_layout,
    rank_steps,
    resume_point,
)
from pcompile.backends.merge_output import MergeError
from pcompile.backends.npz_files import LazyNpz, save_npz


def merge_checkpoints(out_dir: str, step: int | None = None,
                      folder: str | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`merged_tensors` gathered into a dict (for models that fit in memory)."""
    info, tensors = merged_tensors(out_dir, step, folder)
    return dict(tensors), info


def merged_tensors(out_dir: str, step: int | None = None, folder: str | None = None,
                   only: set[str] | None = None
                   ) -> tuple[dict[str, Any], Iterator[tuple[str, np.ndarray]]]:
    """The full tensors of every rank's checkpoint of `step` (default: the newest step every
    rank holds intact; `info["skipped"]` says which newer steps were passed over and why), as
    an iterator of (name, tensor) in name order that reads the ranks' slices of one tensor at
    a time: memory holds one full tensor, never the model. Checks every array against its
    manifest, that replicas of one slice agree bit for bit, that every element is held by
    some rank and that layouts match plan.json; a fault raises `MergeError` (while iterating
    for faults inside a tensor)."""
    folder = folder or os.path.join(out_dir, "checkpoints")
    plan_path = os.path.join(out_dir, "plan.json")
    plan = None
    if os.path.exists(plan_path):
        from pcompile.compiler.driver.plan import PlanError, read_plan

        try:  # validated against its schema (compiler/driver/plan.py)
            plan = read_plan(out_dir).model_dump(mode="json")
        except PlanError as exc:
            raise MergeError(str(exc)) from None
        num_ranks = int(plan["devices"])
    else:
        num_ranks = _count_ranks(folder)
    skipped: list[str] = []
    plan_id = folder_plan_id(out_dir)
    if plan_id is not None and step is None:
        _check_plan_id(folder, plan_id, out_dir)
    if step is None:
        point = resume_point(folder, num_ranks, plan_id)
        skipped = point.skipped
        if point.step is None:
            why = "".join(f"\n  {line}" for line in skipped)
            raise MergeError(f"no step has an intact checkpoint of all {num_ranks} ranks in "
                             f"{folder}{why}")
        step = point.step
    readers: list[CheckpointReader] = []
    try:
        for r in range(num_ranks):
            path = checkpoint_path(folder, r, step)
            if not os.path.exists(path):
                raise MergeError(f"rank {r} has no checkpoint of step {step} ({path})")
            readers.append(CheckpointReader(path, r))
            if readers[-1].meta.get("plan_id") != readers[0].meta.get("plan_id"):
                raise MergeError(f"rank {r}'s checkpoint belongs to another plan than rank 0's")
            if readers[-1].meta.get("run") != readers[0].meta.get("run"):
                raise MergeError(f"the checkpoints of step {step} are of different runs (rank "
                                 f"0: {readers[0].meta.get('run')}, rank {r}: "
                                 f"{readers[-1].meta.get('run')}): a new run replaced some "
                                 "ranks' only; merge another step")
            if plan_id is not None and readers[-1].meta.get("plan_id") != plan_id:
                raise MergeError(_plan_mismatch(folder, readers[-1].meta.get("plan_id"),
                                                plan_id, out_dir))
    except CheckpointError as exc:
        for reader in readers:
            reader.close()
        raise MergeError(str(exc)) from None
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    meta0 = readers[0].meta
    info: dict[str, Any] = {k: meta0.get(k) for k in ("step", "epoch", "step_in_epoch",
                                                      "plan_id", "num_ranks")}
    info["skipped"] = skipped
    names = sorted({name for reader in readers for name in reader.names
                    if only is None or name in only})
    info["tensors"] = {}
    for name in names:  # dtype and global shape of each, known before any is merged
        entry = next(reader.meta["layouts"].get(name) for reader in readers
                     if name in reader.meta["arrays"])
        if not isinstance(entry, dict):
            raise MergeError(f"{readers[0].path}: the layout of {name} is missing")
        info["tensors"][name] = (_np_dtype(entry.get("dtype")),
                                 tuple(int(d) for d in entry.get("shape", ())))

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        try:
            for name in names:
                yield name, _merge_one(name, readers, plan)
        except CheckpointError as exc:
            raise MergeError(str(exc)) from None
        finally:
            for reader in readers:
                reader.close()

    return info, tensors()


def _merge_one(name: str, readers: list[CheckpointReader],
               plan: Mapping[str, Any] | None) -> np.ndarray:
    """Tensor `name` assembled from the slices the ranks hold."""
    full: np.ndarray | None = None
    filled: np.ndarray | None = None
    for r, reader in enumerate(readers):
        if name not in reader.meta["arrays"]:
            continue
        value = reader.array(name)
        entry = reader.meta["layouts"][name]
        _check_plan_layout(plan, name, entry)
        layout = entry_layout(entry)
        if full is None or filled is None:
            full = np.zeros(layout.shape, value.dtype)
            filled = np.zeros(layout.shape, bool)
        if not value.shape:  # a scalar (step counters): every rank holds it
            if filled.all() and not np.array_equal(full, value):
                raise MergeError(f"{name}: rank {r}'s value differs from another rank's")
            full[...] = value
            filled[...] = True
            continue
        index = tuple(slice(b, e) for b, e in layout.slice_bounds(r))
        if value.shape != full[index].shape:
            raise MergeError(f"{name}: rank {r} holds shape {value.shape}, its layout gives "
                             f"{full[index].shape}")
        seen = filled[index]
        if seen.any() and not np.array_equal(full[index][seen], value[seen]):
            raise MergeError(f"{name}: rank {r}'s replica differs from another rank's")
        full[index] = value
        filled[index] = True
    assert full is not None and filled is not None
    if not filled.all():
        raise MergeError(f"{name}: some elements are held by no rank")
    return full


def _np_dtype(name: Any) -> np.dtype:
    from pcompile.ir.types import DType

    try:
        return DType[name].np if name in DType.__members__ else np.dtype(name)
    except TypeError:
        raise MergeError(f"a layout names the dtype {name!r}") from None


_PLAN_LINE = re.compile(r"^PLAN_ID = '([0-9A-Za-z_-]*)'$", re.MULTILINE)


def folder_plan_id(out_dir: str) -> str | None:
    """The plan id of the compile in `out_dir` (the `PLAN_ID` line of its program.py, read as
    text), or None when it holds no rank program."""
    candidates = [os.path.join(out_dir, "program.py")]
    try:
        candidates += [os.path.join(out_dir, d, "program.py") for d in sorted(
            os.listdir(out_dir), key=lambda d: (len(d), d)) if re.fullmatch(r"rank_\d+", d)]
    except OSError:
        return None
    for path in candidates:
        try:
            with open(path, encoding="utf-8") as f:
                m = _PLAN_LINE.search(f.read(200_000))
        except (OSError, UnicodeDecodeError):
            continue
        if m:
            return m.group(1)
    return None


def _plan_mismatch(folder: str, found: Any, plan_id: str, out_dir: str) -> str:
    return (f"the checkpoints in {folder} were written by plan {found}, but {out_dir} now "
            f"holds plan {plan_id} (another model, or the model compiled again with other "
            "options); merge them against the compile that trained them (recompile that "
            "model and options into its own --out), or name the right checkpoints with "
            "--checkpoint-dir")


def _check_plan_id(folder: str, plan_id: str, out_dir: str) -> None:
    """One message when no checkpoint in `folder` belongs to the folder's plan."""
    found: list[str] = []
    for step in rank_steps(folder, 0):
        path = checkpoint_path(folder, 0, step)
        try:
            if path.endswith(".json"):
                with open(path, encoding="utf-8") as f:
                    meta = json.load(f)
            else:
                with CheckpointReader(path, 0) as reader:
                    meta = reader.meta
        except (OSError, ValueError, CheckpointError):
            continue
        if isinstance(meta, dict):
            if meta.get("plan_id") == plan_id:
                return
            found.append(str(meta.get("plan_id")))
    if found:
        raise MergeError(_plan_mismatch(folder, found[-1], plan_id, out_dir))


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
            entry_layout(entry) != entry_layout({"shape": stored["shape"],
                                       "dev_matrix": stored["dev_matrix"],
                                       "tensor_map": stored["tensor_map"]})):
        raise MergeError(f"{name}: the checkpoint's layout differs from plan.json's")


def _is_merge_output(path: str) -> bool:
    """Whether `path` is an .npz an earlier pcompile-merge wrote (its `__meta__` names a plan)."""
    try:
        with LazyNpz(path) as npz:
            meta = json.loads(str(npz.get(META_KEY))) if META_KEY in npz.files else None
    except Exception:  # noqa: BLE001  (anything unreadable is not ours)
        return False
    return isinstance(meta, dict) and "plan_id" in meta and "num_ranks" in meta


def merge_command() -> Any:
    """`pcompile-merge`'s command line (click, as `pcompile`'s)."""
    import click

    return click.Command(
        "pcompile-merge",
        help="Merge the per-rank checkpoints of a pcompile run into full tensors (safetensors, "
             "with the model's parameter names).",
        params=[
            click.Argument(["out_dir"]),
            click.Option(["--step"], type=int, default=None,
                         help="which step (default: the newest one every rank holds intact)"),
            click.Option(["--checkpoint-dir"], default=None,
                         help="where the rank checkpoints are (default OUT_DIR/checkpoints)"),
            click.Option(["--output"], default=None,
                         help="FILE.safetensors (one file), FILE.npz (pcompile's older format) "
                              "or a folder (model.safetensors, or shards and "
                              "model.safetensors.index.json); default "
                              "OUT_DIR/merged_step_<S>.safetensors, or the folder "
                              "OUT_DIR/merged_step_<S>/ when sharded"),
            click.Option(["--max-shard-size"], default=None,
                         help="largest shard of a folder output (e.g. 5GB, 500MB, 2GiB; default "
                              "5GB, Hugging Face's)"),
            click.Option(["--weights-only"], is_flag=True,
                         help="only the model's weights (plan.json kind 'weight'), not the "
                              "optimizer state"),
            click.Option(["--names"], default=None, metavar="MAP",
                         help="write the tensors under another format's names: llama or "
                              "mixtral (Hugging Face's; compiler/frontend/name_maps.py), or a JSON "
                              "name map FILE; a stacked parameter (Mixtral's experts) becomes "
                              "one tensor per slice"),
        ])


def _parse_merge_args(argv: list[str] | None) -> Any:
    """The options of `argv` (default sys.argv[1:]); --help and a usage error print and exit
    (status 0 and 2)."""
    import types

    import click

    try:
        with merge_command().make_context(
                "pcompile-merge", list(sys.argv[1:] if argv is None else argv)) as ctx:
            return types.SimpleNamespace(**ctx.params)
    except click.exceptions.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None


def main(argv: list[str] | None = None) -> int:
    """`pcompile-merge OUT_DIR [--step S] [--output PATH] [--max-shard-size SIZE]
    [--weights-only]`."""
    from pcompile.backends.merge_output import DEFAULT_MAX_SHARD, parse_size

    args = _parse_merge_args(argv)
    try:
        max_shard = (parse_size(args.max_shard_size) if args.max_shard_size is not None
                     else DEFAULT_MAX_SHARD)
    except ValueError as exc:
        print(f"pcompile-merge: error: --max-shard-size {exc}", file=sys.stderr)
        return 1
    try:
        names = _name_map(args.names) if args.names else None
        only = _weights(args.out_dir) if args.weights_only else None
        info, tensors = merged_tensors(args.out_dir, args.step, args.checkpoint_dir, only)
    except (MergeError, CheckpointError, OSError, ValueError, KeyError) as exc:
        print(f"pcompile-merge: error: {exc}", file=sys.stderr)
        return 1
    for line in info.pop("skipped"):
        print(f"pcompile-merge: passed over {line}", file=sys.stderr)
    layouts = info.pop("tensors")
    if names is not None:  # another format's names (and shapes: stacked ones split)
        renamed = [(theirs, (dtype, part)) for name, (dtype, shape) in layouts.items()
                   for theirs, part in names.their_shapes(name, shape)]
        twice = sorted({n for n, _ in renamed if [m for m, _ in renamed].count(n) > 1})
        if twice:
            print(f"pcompile-merge: error: --names {args.names}: several tensors would be "
                  f"named {', '.join(twice[:4])}", file=sys.stderr)
            return 1
        layouts = dict(renamed)
        tensors = (pair for name, tensor in tensors for pair in names.to_theirs(name, tensor))
        info["names"] = names.name
    total = sum(math.prod(shape) * dtype.itemsize for dtype, shape in layouts.values())
    base = os.path.join(args.out_dir, f"merged_step_{info['step']:08d}")
    output = args.output or (base + ".safetensors" if total <= max_shard else base)
    written = {"tensors": 0, "bytes": 0}

    def counted() -> Iterator[tuple[str, np.ndarray]]:
        # one tensor at a time into the output: the merge never holds the whole model
        for name, tensor in tensors:
            written["tensors"] += 1
            written["bytes"] += tensor.nbytes
            yield name, tensor

    try:
        if output.endswith(".npz"):
            if os.path.exists(output) and not _is_merge_output(output):
                raise MergeError(f"{output} exists and is not a file pcompile-merge wrote; "
                                 "name another --output (pcompile never replaces a file it "
                                 "did not write)")

            def with_meta() -> Iterator[tuple[str, np.ndarray]]:
                yield from counted()
                yield META_KEY, np.array(json.dumps(info, sort_keys=True))

            save_npz(output, with_meta())
            files = [output]
        else:
            from pcompile.backends.merge_output import Entry, write_merged

            entries = [Entry(name, dtype, shape) for name, (dtype, shape) in layouts.items()]
            metadata = {k: str(v) for k, v in sorted(info.items())}
            files = write_merged(output, entries, counted(), metadata, max_shard,
                                 folder=not output.endswith(".safetensors"))
    except (MergeError, CheckpointError, ValueError, KeyError) as exc:
        print(f"pcompile-merge: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"pcompile-merge: error: cannot write {output}: {exc.strerror}", file=sys.stderr)
        return 1
    where = output if len(files) == 1 else f"{len(files) - 1} shards and {files[-1]}"
    print(f"merged step {info['step']} of {info['num_ranks']} ranks: {written['tensors']} "
          f"tensors, {written['bytes']} bytes -> {where}")
    return 0


def _name_map(value: str) -> Any:
    """--names: a built-in name map (compiler/frontend/name_maps.py) or a JSON file of one."""
    from pcompile.compiler.frontend.name_maps import NAME_MAPS, NameMap, NameMapError

    if value in NAME_MAPS:
        return NAME_MAPS[value]
    if not value.endswith(".json"):
        raise MergeError(f"--names {value}: the built-in name maps are "
                         f"{', '.join(sorted(NAME_MAPS))}, or give a JSON file (.json)")
    try:
        with open(value, encoding="utf-8") as f:
            return NameMap.from_json(f.read(), value)
    except NameMapError as exc:
        raise MergeError(f"--names {exc}") from None


def _weights(out_dir: str) -> set[str]:
    """plan.json's weights (what --weights-only keeps: no optimizer state)."""
    from pcompile.compiler.driver.plan import PlanError, read_plan

    if not os.path.exists(os.path.join(out_dir, "plan.json")):
        raise MergeError(f"--weights-only needs {out_dir}/plan.json to tell weights apart")
    try:
        params = read_plan(out_dir).model_dump(mode="json").get("parameters", {})
    except PlanError as exc:
        raise MergeError(str(exc)) from None
    return {n for n, p in params.items() if (p or {}).get("kind") == "weight"}


if __name__ == "__main__":
    sys.exit(main())
