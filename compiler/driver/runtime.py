"""What running a compiled program needs from it, whatever runs it: the batches it is fed
(global, or a rank's rows), each rank's initial values, MindSpore's loss line (`epoch: E step:
S, loss is L`), and stored values reassembled from the ranks' slices. The runners themselves
live above the backends (`pcompile.tools.runners`; the rank programs in `backends.jax`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcompile.compiler.driver.compiled import CompiledProgram, CompileState
from pcompile.compiler.driver.data_checks import (
    BatchPlace,
    DataError,
    check_batch,
    index_ranges,
    no_batch,
)
from pcompile.compiler.frontend.model_file import (
    ModelFile,
    as_input_list,
    call_user,
    iterate_user,
    load_model_file,
)
from pcompile.compiler.frontend.tensor import TensorSpec
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout
from pcompile.program.dataset import (  # noqa: F401  (re-exported)
    DatasetSpec,
    IndexRange,
    batch_rows,
    slice_rows,
)


def synthetic(item: TensorSpec | np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if isinstance(item, np.ndarray):
        return item
    if item.dtype.is_float:
        return rng.standard_normal(item.shape).astype(item.dtype.np)
    if item.dtype.value == "Bool":
        return rng.integers(0, 2, item.shape).astype(bool)
    return rng.integers(0, 2, item.shape).astype(item.dtype.np)


def batches(program: CompiledProgram, steps: int) -> Iterator[tuple[int, int, list[np.ndarray]]]:
    """Yield (epoch, step-in-epoch, arrays) with arrays = inputs then labels, global shapes.
    Epochs restart `dataset()`; without a data set, one synthetic batch repeats."""
    traced, mf = program.traced, program.state.model_file
    expected = [(p.name, shape, p.dtype.np)
                for p, shape in zip(program.graph.inputs, input_shapes(program))]
    shrink = program.state.shrink
    if shrink is not None:  # the shrunk check (tools/shrink.py): the model's batches, shrunk
        # (a single-device reference running nn.PipelineCell's micro-batches in turn traced,
        # and shrank, one micro-batch: its graph takes `micro` of them)
        micro = {p.name: p.shape[0] // traced.graph.param(p.name).shape[0]
                 for p in program.graph.inputs if p.shape}
        expected = [(name, _rows_times(shrink.shrink.original[name], micro.get(name, 1)), dtype)
                    for name, _, dtype in expected]
    # the shrunk model's tables are not the model's: its batches are checked against neither
    ranges = index_ranges(traced.graph) if shrink is None else ()
    batches = iter_batches(mf, len(traced.input_names), len(traced.label_names),
                           traced.example_inputs + traced.example_labels, expected, steps,
                           ranges)
    if shrink is None:
        yield from batches
        return
    names = [name for name, _, _ in expected]
    for epoch, step, arrays in batches:
        yield epoch, step, [_shrink_parts(shrink.shrink, n, a, micro.get(n, 1))
                            for n, a in zip(names, arrays)]


def _rows_times(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    return (shape[0] * parts, *shape[1:]) if shape and parts > 1 else tuple(shape)


def _shrink_parts(shrink: Any, name: str, array: np.ndarray, parts: int) -> np.ndarray:
    """`shrink.shrink_input` of each of `parts` micro-batches of an input, joined again."""
    if parts <= 1:
        return shrink.shrink_input(name, array)
    return np.concatenate([shrink.shrink_input(name, a) for a in np.split(array, parts)])


def rank_batches(program: CompiledProgram, ranks: list[int], steps: int, skip: int = 0
                 ) -> Iterator[tuple[int, int, list[np.ndarray] | None, int]]:
    """`batches` as the rank programs read them for `ranks` (`iter_rank_batches`): with a
    pcompile.dataset object only those ranks' rows of each global batch; cut each input with
    `slice_rows(array, layout, rank, first_row)`."""
    traced, mf = program.traced, program.state.model_file
    assert program.state.assignment is not None, "not a parallel program"
    layouts = program.state.assignment.param_layouts
    expected = [(p.name, shape, p.dtype.np)
                for p, shape in zip(program.graph.inputs, input_shapes(program))]
    rows = batch_rows([layouts[p.name] for p in program.graph.inputs], ranks)
    return iter_rank_batches(mf, len(traced.input_names), len(traced.label_names),
                             traced.example_inputs + traced.example_labels, expected, steps,
                             rows=rows, skip=skip, ranges=index_ranges(traced.graph))


def spec_of_model_file(path: str, taken: int) -> DatasetSpec:
    """The `DatasetSpec` of a program written before `DATASET`, which takes `taken` arrays:
    the model file's `inputs()` count, the rest labels."""
    mf = _data_model_file(path)
    inputs = len(as_input_list(call_user(mf.inputs, "inputs()", mf.path), "inputs", mf.path))
    return DatasetSpec(path, inputs, max(0, taken - inputs))


def dataset_spec(state: CompileState) -> DatasetSpec:
    """The `DatasetSpec` of a compile (after its trace)."""
    traced = state.traced
    assert traced is not None
    return DatasetSpec(os.path.abspath(state.model_file.path), len(traced.input_names),
                       len(traced.label_names), index_ranges(traced.graph))


_LOADED: dict[str, tuple[tuple[int, int], ModelFile]] = {}


def _data_model_file(path: str) -> ModelFile:
    """The model file a rank program reads its data (and callbacks) from, imported once per
    process while it is unchanged."""
    try:
        info = os.stat(path)
    except OSError:
        raise PcompileError(f"model file {path} (for the data) does not exist on this host"
                            ) from None
    key, version = os.path.abspath(path), (info.st_mtime_ns, info.st_size)
    loaded = _LOADED.get(key)
    if loaded is None or loaded[0] != version:
        loaded = _LOADED[key] = (version, load_model_file(path))
    return loaded[1]


def spec_callbacks(spec: DatasetSpec) -> tuple[list[Any], str]:
    """The callbacks the model file `spec` names gives (`callbacks()`,
    compiler/frontend/callbacks.py; none without it) and its path."""
    from pcompile.compiler.frontend.callbacks import checked_callbacks

    mf = _data_model_file(spec.model_file)
    if mf.callbacks is None:
        return [], mf.path
    return checked_callbacks(call_user(mf.callbacks, "callbacks()", mf.path), mf.path), mf.path


def spec_batches(spec: DatasetSpec, expected: list[tuple[str, tuple[int, ...], Any]],
                 steps: int, rows: tuple[int, int] | None = None, skip: int = 0
                 ) -> Iterator[tuple[int, int, list[np.ndarray] | None, int]]:
    """`iter_rank_batches` of the model file `spec` names: what a rank program reads.
    `expected`: the (name, global shape, numpy dtype) of every input then label."""
    if len(expected) != spec.inputs + spec.labels:
        raise PcompileError(
            f"the program takes {len(expected)} inputs and labels, its data set gives "
            f"{spec.inputs} input(s) and {spec.labels} label(s)")
    mf = _data_model_file(spec.model_file)
    examples: list[TensorSpec | np.ndarray] = []
    if mf.dataset is None:  # the synthetic batch: inputs() and labels()
        examples = as_input_list(call_user(mf.inputs, "inputs()", mf.path), "inputs", mf.path)
        if spec.labels and mf.labels is not None:
            examples += as_input_list(call_user(mf.labels, "labels()", mf.path), "labels",
                                      mf.path)
        if len(examples) != len(expected):
            raise PcompileError(
                f"{mf.path}: inputs() and labels() give {len(examples)} arrays, the program "
                f"takes {len(expected)}")
    return iter_rank_batches(mf, spec.inputs, spec.labels, examples, expected, steps,
                             rows=rows, skip=skip, ranges=spec.ranges)


def input_shapes(program: CompiledProgram) -> list[tuple[int, ...]]:
    """The global shape of every graph input (the whole batch: with nn.PipelineCell the
    traced graph takes one micro-batch, passes/micro_batch.py the whole)."""
    state = program.state
    if state.micro_batched:
        assert state.assignment is not None  # micro-batched: parallel, laid out
        layouts = state.assignment.param_layouts
        return [tuple(layouts[p.name].shape) for p in program.graph.inputs]
    return [tuple(p.shape) for p in program.graph.inputs]


def iter_batches(
    mf: Any,
    n_inputs: int,
    n_labels: int,
    examples: list[TensorSpec | np.ndarray],
    expected: list[tuple[str, tuple[int, ...], Any]],
    steps: int,
    ranges: tuple[IndexRange, ...] = (),
) -> Iterator[tuple[int, int, list[np.ndarray]]]:
    """`batches` from a loaded model file without a compiled program: `examples` are inputs() +
    labels (for the synthetic batch when there is no dataset()), `expected` the (name, global
    shape, numpy dtype) of every graph input."""
    for epoch, step, arrays, _ in iter_rank_batches(mf, n_inputs, n_labels, examples, expected,
                                                     steps, ranges=ranges):
        assert arrays is not None
        yield epoch, step, arrays


def iter_rank_batches(
    mf: Any,
    n_inputs: int,
    n_labels: int,
    examples: list[TensorSpec | np.ndarray],
    expected: list[tuple[str, tuple[int, ...], Any]],
    steps: int,
    rows: tuple[int, int] | None = None,
    skip: int = 0,
    ranges: tuple[IndexRange, ...] = (),
) -> Iterator[tuple[int, int, list[np.ndarray] | None, int]]:
    """Yield (epoch, step-in-epoch, arrays, first_row) for `steps` steps: arrays = inputs then
    labels. Epochs restart `dataset()`; without one, one synthetic batch repeats.

    When `dataset()` returns a `pcompile.dataset` object it is called once and iterated epoch
    by epoch (epoch e reshuffles as e says, so a resumed run sees the same batches); with
    `rows` = (lo, hi) only rows lo..hi of each global batch are read (a rank's share,
    `batch_rows`): the arrays have hi - lo rows and first_row is lo. The first `skip` steps of
    such a data set are passed over without reading them (arrays None). Any other iterable
    gives whole global batches (first_row 0).

    Every batch is checked as it is read (compiler/driver/data_checks.py: count, shapes, dtypes, the
    ids of `ranges`); what the run will certainly read and is known at the start (a list's
    batches, a pcompile.dataset's short last batch) is checked before the first. A mistake, a
    failing `dataset()` and an epoch without a batch are one `DataError` naming the batch."""
    if mf.dataset is None:
        rng = np.random.default_rng(0)
        batch = [synthetic(s, rng) for s in examples]
        for k in range(steps):
            yield 1, k + 1, batch, 0
        return
    from pcompile.compiler.frontend.dataset import Dataset

    data = call_user(mf.dataset, "dataset()", mf.path)
    sizes = (n_inputs, n_labels)
    if isinstance(data, Dataset):
        yield from _dataset_batches(mf, data, sizes, expected, steps, rows, skip, ranges)
        return
    if isinstance(data, (list, tuple)):  # every batch the run reads is known now
        for k, raw in enumerate(data[:steps]):
            _plain_batch(mf, raw, sizes, expected, BatchPlace(1, k + 1, k + 1), ranges)
    done, epoch = 0, 0
    while done < steps:
        epoch += 1
        produced = 0
        if epoch > 1:
            data = call_user(mf.dataset, "dataset()", mf.path)
        used_up = _is_iterator(data)
        reading = iterate_user(data, "dataset()", mf.path)
        while done < steps:
            place = BatchPlace(epoch, produced + 1, done + 1)
            try:
                raw = next(reading)
            except StopIteration:
                break
            except PcompileError as exc:
                raise DataError(f"reading {place}: {exc}") from None
            produced += 1
            done += 1
            yield epoch, produced, _plain_batch(mf, raw, sizes, expected, place, ranges), 0
        if produced == 0:
            raise no_batch(mf.path, epoch, done + 1, used_up)


def _is_iterator(data: Any) -> bool:
    try:
        return iter(data) is data
    except Exception:  # not iterable: iterate_user names the mistake
        return False


def _plain_batch(mf: Any, raw: Any, sizes: tuple[int, int],
                 expected: list[tuple[str, tuple[int, ...], Any]], place: BatchPlace,
                 ranges: tuple[IndexRange, ...]) -> list[np.ndarray]:
    """One batch of a plain iterable (a tuple of arrays, or one array), checked."""
    items = list(raw) if isinstance(raw, (tuple, list)) else [raw]
    try:
        arrays = as_input_list(tuple(items[: sum(sizes)]), "dataset", mf.path)
    except PcompileError as exc:
        raise DataError(f"{place}: {exc}") from None
    return check_batch(mf.path, arrays, expected, sizes, place, None, ranges)


def _dataset_batches(mf: Any, data: Any, sizes: tuple[int, int],
                     expected: list[tuple[str, tuple[int, ...], Any]], steps: int,
                     rows: tuple[int, int] | None, skip: int, ranges: tuple[IndexRange, ...],
                     ) -> Iterator[tuple[int, int, list[np.ndarray] | None, int]]:
    """`iter_rank_batches` over a pcompile.dataset object."""
    batch_dims = {shape[0] if shape else None for _, shape, _ in expected}
    if len(batch_dims) != 1 or None in batch_dims:
        rows = None  # no common batch dim to share out: every rank reads whole batches
    global_rows = next(iter(batch_dims)) if len(batch_dims) == 1 else None
    whole = (f"batch({global_rows}, drop_remainder=True) gives only whole global batches"
             if global_rows is not None else "")
    _short_last_batch(mf, data, global_rows, steps, skip, whole)
    done, epoch = 0, 0
    while done < steps:
        epoch += 1
        produced = 0
        elements = iterate_user(data._elements(epoch - 1), "dataset()", mf.path)
        while done < steps:
            place = BatchPlace(epoch, produced + 1, done + 1)
            try:
                element = next(elements)
            except StopIteration:
                break
            except PcompileError as exc:
                raise DataError(f"reading {place}: {exc}") from None
            produced += 1
            done += 1
            if done <= skip:
                yield epoch, produced, None, 0
                continue
            total = data._rows(element)
            share = rows if total is not None else None
            if total is not None and global_rows is not None and total != global_rows:
                raise DataError(
                    f"dataset() in {mf.path}, {place}: {total} rows; the program was compiled "
                    f"for a batch of {global_rows}: {whole}")
            try:
                arrays = call_user(data._read, "dataset()", mf.path, element, share)
            except PcompileError as exc:
                raise DataError(f"reading {place}: {exc}") from None
            checked = check_batch(mf.path, list(arrays[:sum(sizes)]), expected, sizes, place,
                                  share, ranges, whole)
            if share is None and rows is not None:  # a whole batch the source made
                checked, share = [a[rows[0]:rows[1]] for a in checked], rows
            yield epoch, produced, checked, share[0] if share is not None else 0
        if produced == 0:
            raise no_batch(mf.path, epoch, done + 1, False)


def _short_last_batch(mf: Any, data: Any, global_rows: int | None, steps: int, skip: int,
                      whole: str) -> None:
    """Before the first step: a batch(n) without drop_remainder over a known number of rows
    that leaves a short last batch, when the run certainly reads it (it reads a whole epoch
    past the steps it skips)."""
    from pcompile.compiler.frontend.dataset import BatchDataset

    node = data
    while node is not None and not isinstance(node, BatchDataset):
        node = node._parent
    if node is None or node.drop_remainder or global_rows is None or node._parent is None:
        return
    total, epoch = node._parent._size(), data._size()
    if total is None or epoch is None or not total % node.batch_size or steps <= skip:
        return
    if steps >= epoch and node is data:  # the last batch of epoch 1 is step `epoch`
        place = BatchPlace(1, epoch, epoch)
        if place.step > skip:
            raise DataError(
                f"dataset() in {mf.path}, {place}: {total % node.batch_size} rows (batch("
                f"{node.batch_size}) of {total} rows leaves a short last batch in every "
                f"epoch); the program was compiled for a batch of {global_rows}: {whole}")

def held_copy(value: np.ndarray, float64: bool) -> np.ndarray:
    """A copy of a parameter value as a runner holds it (float64 mode: floats in float64)."""
    arr = np.array(value, copy=True)
    if float64 and (arr.dtype.kind == "f" or arr.dtype.name == "bfloat16"):
        return arr.astype(np.float64)
    return arr

def initial_rank_values(program: CompiledProgram, float64: bool = False
                        ) -> list[dict[str, np.ndarray]]:
    """Every rank's initial parameters and optimizer state (its slices; copies of rank 0's
    replicated parameters under `parameter_broadcast`), as a runner holds them (`float64`:
    every float in float64)."""
    state = program.state
    values = [{k: held_copy(v, float64) for k, v in state.rank_values(r).items()}
              for r in range(state.devices)]
    if state.options.parameter_broadcast:
        for name in broadcast_parameters(program):
            for vals in values[1:]:
                vals[name] = np.array(values[0][name], copy=True)
    return values


def holders(program: CompiledProgram, name: str) -> list[int]:
    """The ranks that hold stored value `name` (every rank; with pipeline stages, those of the
    first stage that holds it)."""
    state = program.state
    if not state.pipelined:
        return list(range(state.devices))
    assert state.pipeline is not None
    pipe = state.pipeline.program
    return list(pipe.ranks(pipe.param_stages[name][0]))


def assemble(program: CompiledProgram, name: str, layout: Any,
             values: list[dict[str, np.ndarray]]) -> np.ndarray:
    """A stored value from its holders' slices (`values[rank][name]`)."""
    ranks = holders(program, name)
    first = values[ranks[0]][name]
    if layout is None or not first.shape:
        return first
    full = np.zeros(layout.shape, first.dtype)
    for rank in ranks:
        full[tuple(slice(b, e) for b, e in layout.slice_bounds(rank))] = values[rank][name]
    return full


@dataclass(frozen=True)
class RankLocal:
    """A reduction whose result differs between ranks: `cross_batch` on a reduction whose
    reduced dims are split. Each rank reduces its own part only (MindSpore skips the forward
    AllReduce), so its result is that of the single-device reduction of its slice."""

    fullname: str
    layout: TensorLayout  # the layout of the reduction's input
    axes: tuple[int, ...]  # the split reduced dims

    def bounds(self, rank: int) -> tuple[tuple[int, int], ...]:
        """`rank`'s part of the input: its slice on the split reduced dims, whole elsewhere."""
        mine = self.layout.slice_bounds(rank)
        return tuple(mine[d] if d in self.axes else (0, size)
                     for d, size in enumerate(self.layout.shape))


def rank_local_reductions(program: CompiledProgram) -> list[RankLocal]:
    """The program's rank-local reductions (`cross_batch` with a split reduced dim)."""
    state = program.state
    if state.assignment is None or state.graph is None:
        return []
    out = []
    for node in state.graph.nodes:
        if not (node.attrs.get("cross_batch") and node.op.startswith("Reduce")):
            continue
        sharding = state.assignment.sharding(node)
        if sharding is None:
            continue
        layout = sharding.in_layouts[0]
        rank = len(layout.shape)
        axis = node.attrs.get("axis", ())
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        reduced = {a % rank for a in axes} if axes else set(range(rank))
        split = tuple(sorted(d for d in reduced if layout.splits[d] > 1))
        if split:
            out.append(RankLocal(node.fullname, layout, split))
    return out


def broadcast_parameters(program: CompiledProgram) -> list[str]:
    """Parameters `parameter_broadcast` copies from rank 0 before training: the replicated
    ones (sliced and layerwise_parallel parameters keep their own values)."""
    state = program.state
    assert state.assignment is not None
    traced = program.traced
    names = []
    for p in program.graph.weights:
        layout = state.assignment.param_layouts[p.name]
        owner = traced.parameters.get(p.name)
        if owner is not None and owner.layerwise_parallel:
            continue
        if all(e == -1 for e in layout.tensor_map):
            names.append(p.name)
    return names
