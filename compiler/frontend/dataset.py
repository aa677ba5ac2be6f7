"""`pcompile.dataset`: the shapes of MindSpore's `mindspore.dataset` API for `dataset()`.

    import pcompile.dataset as ds

    def dataset():
        data = ds.NumpySlicesDataset({"x": xs, "y": ys}, shuffle=True)
        return data.batch(32, drop_remainder=True)

Sources: `GeneratorDataset` (a random-access object, a generator function or an iterable),
`NumpySlicesDataset` (arrays sliced along their first dimension) and `TokenFileDataset` (a
memory-mapped file of token ids cut into windows). Operations:
`.map`, `.batch`, `.shuffle`, `.repeat`; `get_dataset_size()`, `create_tuple_iterator()`,
`create_dict_iterator()`; iterating a data set yields tuples of numpy arrays.

How it works: a pipeline carries *references* to rows, not the rows: a random-access source's
row index (a stream source's row, already read), batches as lists of references. Rows are read
only when a batch is handed out, so a shuffle buffer holds integers, and the runtime
(compiler/driver/runtime.py, `iter_rank_batches`) reads for a rank only the rows of its
data-parallel share of each global batch: rows `lo..hi` of the batch, the rank's slice along the
batch dimension, which equals the slice of the global batch that the rank would otherwise cut.

Determinism: every random choice comes from a generator seeded by (seed, the operation's depth
in the pipeline, the epoch). The seed is `config.set_seed(...)`'s if given, else pcompile's
`set_seed` seed at the time the data set is built; a rank process may call `dataset()` without
calling `model()`, so set the seed at module level or inside `dataset()`, not only in `model()`.

Where MindSpore differs (docs/user-guide.md, "Data"):
* iterating a data set directly (`for row in data`) yields numpy arrays (MindSpore: Tensors);
  `create_tuple_iterator(output_numpy=False)` yields Tensors as MindSpore's does;
* every fresh iteration starts at epoch 0 and gives the same order (MindSpore reseeds per
  iterator); `create_tuple_iterator(num_epochs=E)` and `.repeat()` reshuffle every epoch;
* `num_shards`/`shard_id` deal the samples out in turn (shard k: samples k, k+n, ...) without
  padding, so shards may differ by one sample (MindSpore pads them to equal length);
* `num_parallel_workers` and `python_multiprocessing` are accepted and ignored (one thread);
  `sampler` and schemas are not supported;
* `.map(operations, input_columns, output_columns)` runs Python callables (numpy in, numpy
  out), applied when a row is read (only the rows of a rank's share); its output columns
  replace its input columns one for one (MindSpore can also add or drop columns:
  `column_order`, not supported), and MindSpore's C++ transforms (`mindspore.dataset.vision`,
  `.transforms`) are not there: write them as numpy functions.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pcompile.ir.errors import PcompileError

Row = tuple[np.ndarray, ...]


class _Row(tuple):  # type: ignore[type-arg]
    """A row that a stream source produced (its values already read)."""


class _Batch(list):  # type: ignore[type-arg]
    """A batch: the references of its rows (or of its sub-batches)."""


class _Config:
    """`pcompile.dataset.config`, as `mindspore.dataset.config`: the data sets' seed."""

    def __init__(self) -> None:
        self._seed: int | None = None

    def set_seed(self, seed: int) -> None:
        """The seed of data sets built from now on (else pcompile's `set_seed` seed)."""
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise PcompileError(f"dataset.config.set_seed: the seed must be an int >= 0, got "
                                f"{seed!r}")
        self._seed = int(seed)

    def get_seed(self) -> int:
        """The seed a data set built now takes."""
        if self._seed is not None:
            return self._seed
        from pcompile.compiler.frontend.initializer import get_seed

        return get_seed()


config = _Config()


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise PcompileError(f"{what} must be a positive int, got {value!r}")
    return int(value)


def _rng(seed: int, depth: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, depth, epoch])


class Dataset:
    """A data set: a source and the operations applied to it (MindSpore's `Dataset`)."""

    def __init__(self, parent: Dataset | None) -> None:
        self._parent = parent
        self._root: GeneratorDataset = parent._root if parent is not None else self  # type: ignore[assignment]
        self._depth: int = parent._depth + 1 if parent is not None else 0
        self._seed = config.get_seed()

    # -- MindSpore's operations ---------------------------------------------------------------
    def map(self, operations: Any = None, input_columns: str | Sequence[str] | None = None,
            output_columns: str | Sequence[str] | None = None,
            **unsupported: Any) -> Dataset:
        """MindSpore's `map`: `operations` (a callable or a list of them, applied in turn, each
        taking the previous one's outputs as arguments) on `input_columns` of every element
        (default: the first column); their results (numpy arrays, or values numpy makes arrays
        of) become `output_columns` (default: the input columns' names), in the input columns'
        places. A map after `batch` sees whole batches."""
        _unsupported("map", unsupported, ("num_parallel_workers", "python_multiprocessing",
                                          "max_rowsize", "offload", "callbacks", "cache"))
        ops = list(operations) if isinstance(operations, (list, tuple)) else [operations]
        if not ops or not all(callable(op) for op in ops):
            raise PcompileError(
                "map(): operations must be a callable or a list of callables (numpy in, numpy "
                f"out), got {operations!r}; MindSpore's C++ transforms are not available in "
                "pcompile.dataset: write them as Python functions on numpy arrays")
        names = self.get_col_names()
        inputs = _column_list(input_columns, "input_columns") or names[:1]
        missing = [c for c in inputs if c not in names]
        if missing:
            raise PcompileError(f"map(): input_columns {missing} are not columns of the data "
                                f"set (its columns: {names})")
        outputs = _column_list(output_columns, "output_columns") or list(inputs)
        if len(outputs) != len(inputs):
            raise PcompileError(
                f"map(): {len(inputs)} input column(s) {inputs} and {len(outputs)} output "
                f"column(s) {outputs}: pcompile.dataset's map replaces columns one for one "
                "(adding or dropping columns is not supported)")
        return MapDataset(self, ops, inputs, outputs)

    def batch(self, batch_size: int, drop_remainder: bool = False, **unsupported: Any) -> Dataset:
        """Rows grouped `batch_size` at a time, each column stacked along a new first dim; the
        last, smaller batch is kept unless `drop_remainder`."""
        _unsupported("batch", unsupported, ("num_parallel_workers", "python_multiprocessing"))
        return BatchDataset(self, _positive(batch_size, "batch(batch_size)"),
                            bool(drop_remainder))

    def shuffle(self, buffer_size: int) -> Dataset:
        """MindSpore's buffered shuffle: a buffer of `buffer_size` elements; each element
        handed out is drawn at random from the buffer, its place taken by the next one
        (a buffer as large as the data set shuffles it uniformly)."""
        return ShuffleDataset(self, _positive(buffer_size, "shuffle(buffer_size)"))

    def repeat(self, count: int | None = None) -> Dataset:
        """The data set `count` times over (None or -1: without end), reshuffled each time."""
        if count is not None and count != -1:
            count = _positive(count, "repeat(count)")
        return RepeatDataset(self, None if count in (None, -1) else count)

    # -- reading ------------------------------------------------------------------------------
    def get_dataset_size(self) -> int:
        """Elements (batches, after `batch`) in one epoch; -1 after an endless `repeat()`."""
        size = self._size()
        return -1 if size is None else size

    def get_batch_size(self) -> int:
        """The last `batch`'s size (1 without one), as MindSpore's."""
        node: Dataset | None = self
        while node is not None:
            if isinstance(node, BatchDataset):
                return node.batch_size
            node = node._parent
        return 1

    def get_col_names(self) -> list[str]:
        return list(self._root.column_names if self._parent is None
                    else self._parent.get_col_names())

    def create_tuple_iterator(self, columns: Sequence[str] | None = None, num_epochs: int = -1,
                              output_numpy: bool = False, do_copy: bool = True) -> TupleIterator:
        """An iterator over `num_epochs` epochs (-1: any number): each epoch ends with
        StopIteration and the next `for` over it starts the next epoch, reshuffled. Rows are
        tuples of Tensors, or numpy arrays with `output_numpy=True`."""
        return TupleIterator(self, columns, num_epochs, output_numpy, as_dict=False)

    def create_dict_iterator(self, num_epochs: int = -1, output_numpy: bool = False,
                             do_copy: bool = True) -> TupleIterator:
        """As `create_tuple_iterator`, each row a dict keyed by column name."""
        return TupleIterator(self, None, num_epochs, output_numpy, as_dict=True)

    def __iter__(self) -> Iterator[Row]:
        """Epoch 0 (the same order every time), rows as tuples of numpy arrays."""
        for element in self._elements(0):
            yield self._read(element)

    # -- what the operations implement --------------------------------------------------------
    def _elements(self, epoch: int) -> Iterator[Any]:
        """The references of epoch `epoch`'s elements."""
        raise NotImplementedError

    def _size(self) -> int | None:
        """Elements per epoch (None: without end)."""
        raise NotImplementedError

    def _read(self, element: Any, rows: tuple[int, int] | None = None) -> Row:
        """An element's arrays; `rows` = (lo, hi): only rows lo..hi of a batch (only those
        are read when the element is a batch)."""
        if isinstance(element, _Batch):
            members = element if rows is None else element[rows[0]:rows[1]]
            return _stack([self._read(m) for m in members], self._root.column_names)
        if isinstance(element, _Mapped):  # its operations see the whole element
            arrays = element.node._apply(self._read(element.element))
        else:
            arrays = (tuple(element) if isinstance(element, _Row)
                      else self._root._fetch(element))
        if rows is None:
            return arrays
        return tuple(a[rows[0]:rows[1]] for a in arrays)

    @staticmethod
    def _rows(element: Any) -> int | None:
        """How many rows an element has, when known without reading it (a batch's)."""
        while isinstance(element, _Mapped):
            element = element.element
        return len(element) if isinstance(element, _Batch) else None


def _column_list(value: str | Sequence[str] | None, what: str) -> list[str]:
    if value is None:
        return []
    names = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise PcompileError(f"map(): {what} must name columns (strings, each once), got "
                            f"{value!r}")
    return names


class _Mapped:
    """An element of a `map`: the element below and the map to apply when it is read."""

    __slots__ = ("node", "element")

    def __init__(self, node: MapDataset, element: Any) -> None:
        self.node, self.element = node, element


def _unsupported(what: str, given: dict[str, Any], ignored: tuple[str, ...]) -> None:
    for name in given:
        if name not in ignored:
            raise PcompileError(f"{what}(): the argument {name!r} of MindSpore is not supported "
                                "by pcompile.dataset; leave it out (docs/user-guide.md, 'Data')")


def _stack(rows: list[Row], names: Sequence[str]) -> Row:
    if not rows:
        return tuple(np.zeros((0,)) for _ in names)
    out = []
    for name, column in zip(names, zip(*rows)):
        shapes = {np.shape(c) for c in column}
        if len(shapes) > 1:
            raise PcompileError(
                f"batch(): the rows of column {name!r} have different shapes "
                f"({', '.join(str(s) for s in sorted(shapes))}); a batch stacks rows of one "
                "shape: pad or cut them to one length in the source")
        out.append(np.stack(column))
    return tuple(out)


class GeneratorDataset(Dataset):
    """MindSpore's GeneratorDataset. `source` is random-access (`__getitem__` and `__len__`,
    row i = `source[i]`), a callable returning an iterator (a generator function, called once
    per epoch) or an iterable; each row is a tuple of arrays, one per column (a single array
    for one column).

    `shuffle` (default None: on for a random-access source, off otherwise, as MindSpore) draws
    a new order of the rows every epoch; it needs a random-access source (use `.shuffle(n)`
    on a stream). `num_shards`/`shard_id`: this data set holds shard `shard_id` of
    `num_shards`, the rows k, k + n, k + 2n, ... of the (shuffled) order, so the shards
    together hold every row exactly once. `num_samples`: at most that many rows per epoch."""

    def __init__(self, source: Any, column_names: str | Sequence[str] | None = None,
                 column_types: Any = None, schema: Any = None, num_samples: int | None = None,
                 num_parallel_workers: int = 1, shuffle: bool | None = None,
                 sampler: Any = None, num_shards: int | None = None,
                 shard_id: int | None = None, python_multiprocessing: bool = True,
                 max_rowsize: Any = None) -> None:
        super().__init__(None)
        kind = type(self).__name__
        if sampler is not None or schema is not None or column_types is not None:
            raise PcompileError(f"{kind}: sampler, schema and column_types are not supported by "
                                "pcompile.dataset; use shuffle, num_shards and shard_id")
        if isinstance(column_names, str):
            column_names = [column_names]
        self.source = source
        if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
            self._kind = "random"
        elif callable(source):
            self._kind = "callable"
        elif hasattr(source, "__iter__"):
            self._kind = "iterable"
        else:
            raise PcompileError(
                f"{kind}: the source is a {type(source).__name__}; give an object with "
                "__getitem__ and __len__, a generator function or an iterable of rows")
        self.column_names = list(column_names) if column_names is not None else ["column_0"]
        if not self.column_names or len(set(self.column_names)) != len(self.column_names):
            raise PcompileError(f"{kind}: column_names {self.column_names} must name each column "
                                "once")
        if shuffle is None:
            shuffle = self._kind == "random"
        if shuffle and self._kind != "random":
            raise PcompileError(
                f"{kind}: shuffle=True needs a random-access source (__getitem__ and __len__); "
                "for a generator or an iterable, shuffle a buffer of it with .shuffle(n)")
        self.shuffled = bool(shuffle)
        if (num_shards is None) != (shard_id is None):
            raise PcompileError(f"{kind}: give num_shards and shard_id together")
        if num_shards is not None:
            num_shards = _positive(num_shards, f"{kind}(num_shards)")
            if (isinstance(shard_id, bool) or not isinstance(shard_id, (int, np.integer))
                    or not 0 <= shard_id < num_shards):
                raise PcompileError(f"{kind}: shard_id must be an int in 0..{num_shards - 1}, "
                                    f"got {shard_id!r}")
        self.num_shards, self.shard_id = num_shards, shard_id
        self.num_samples = (None if num_samples is None
                            else _positive(num_samples, f"{kind}(num_samples)"))

    def _order(self, epoch: int) -> np.ndarray:
        """The row indices of a random-access source in epoch `epoch` (this shard's)."""
        count = len(self.source)
        order = (_rng(self._seed, 0, epoch).permutation(count) if self.shuffled
                 else np.arange(count))
        if self.num_shards is not None:
            order = order[self.shard_id::self.num_shards]
        if self.num_samples is not None:
            order = order[:self.num_samples]
        return order

    def _elements(self, epoch: int) -> Iterator[Any]:
        if self._kind == "random":
            yield from (int(i) for i in self._order(epoch))
            return
        stream = self.source() if self._kind == "callable" else self.source
        given = 0
        for position, value in enumerate(stream):
            if self.num_shards is not None and position % self.num_shards != self.shard_id:
                continue
            if self.num_samples is not None and given >= self.num_samples:
                return
            given += 1
            yield _Row(self._columns(value))

    def _size(self) -> int | None:
        if self._kind == "random":
            count = len(self.source)
            if self.num_shards is not None:
                count = len(range(self.shard_id or 0, count, self.num_shards))
            return count if self.num_samples is None else min(count, self.num_samples)
        return sum(1 for _ in self._elements(0))

    def _fetch(self, index: int) -> Row:
        return self._columns(self.source[index])

    def _columns(self, value: Any) -> Row:
        names = self.column_names
        if isinstance(value, tuple) or (isinstance(value, list) and len(names) > 1):
            items = tuple(value)
        else:
            items = (value,)
        if len(items) != len(names):
            raise PcompileError(
                f"{type(self).__name__}: the source gives {len(items)} value(s) per row, "
                f"column_names names {len(names)} ({names}); name one column per value")
        return tuple(np.asarray(v) for v in items)


class _Columns:
    """Random access to rows of equally long arrays."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, index: int) -> tuple[np.ndarray, ...]:
        return tuple(a[index] for a in self.arrays)


class NumpySlicesDataset(GeneratorDataset):
    """MindSpore's NumpySlicesDataset: `data` sliced along its first dimension. An array or a
    list is one column; a tuple of arrays several; a dict maps column names to arrays.
    Column names default to `column_0`, `column_1`, ... (a dict's: its keys)."""

    def __init__(self, data: Any, column_names: str | Sequence[str] | None = None,
                 num_samples: int | None = None, num_parallel_workers: int = 1,
                 shuffle: bool | None = None, sampler: Any = None,
                 num_shards: int | None = None, shard_id: int | None = None) -> None:
        if isinstance(data, dict):
            keys = [str(k) for k in data]
            arrays = [np.asarray(v) for v in data.values()]
            column_names = keys if column_names is None else column_names
        elif isinstance(data, tuple):
            arrays = [np.asarray(v) for v in data]
        else:
            arrays = [np.asarray(data)]
        if isinstance(column_names, str):
            column_names = [column_names]
        if column_names is None:
            column_names = [f"column_{i}" for i in range(len(arrays))]
        if not arrays or any(a.ndim == 0 for a in arrays):
            raise PcompileError("NumpySlicesDataset: data must be arrays with a first "
                                "dimension to slice (a list, an array, a tuple or a dict)")
        if len(column_names) != len(arrays):
            raise PcompileError(f"NumpySlicesDataset: {len(arrays)} column(s) of data, "
                                f"column_names names {len(column_names)}; name each column once")
        lengths = {name: len(a) for name, a in zip(column_names, arrays)}
        if len(set(lengths.values())) > 1:
            raise PcompileError(f"NumpySlicesDataset: the columns have different numbers of rows "
                                f"({lengths}); every column needs the same number")
        super().__init__(_Columns(arrays), column_names, num_samples=num_samples,
                         shuffle=shuffle, sampler=sampler, num_shards=num_shards,
                         shard_id=shard_id)


class BatchDataset(Dataset):
    def __init__(self, parent: Dataset, batch_size: int, drop_remainder: bool) -> None:
        super().__init__(parent)
        self.batch_size, self.drop_remainder = batch_size, drop_remainder

    def _elements(self, epoch: int) -> Iterator[Any]:
        assert self._parent is not None
        batch = _Batch()
        for element in self._parent._elements(epoch):
            batch.append(element)
            if len(batch) == self.batch_size:
                yield batch
                batch = _Batch()
        if batch and not self.drop_remainder:
            yield batch

    def _size(self) -> int | None:
        assert self._parent is not None
        inner = self._parent._size()
        if inner is None:
            return None
        whole, rest = divmod(inner, self.batch_size)
        return whole + (1 if rest and not self.drop_remainder else 0)


class MapDataset(Dataset):
    def __init__(self, parent: Dataset, operations: list[Any], inputs: list[str],
                 outputs: list[str]) -> None:
        super().__init__(parent)
        self.operations, self.inputs, self.outputs = operations, inputs, outputs
        self.names = parent.get_col_names()

    def get_col_names(self) -> list[str]:
        renamed = dict(zip(self.inputs, self.outputs))
        return [renamed.get(name, name) for name in self.names]

    def _elements(self, epoch: int) -> Iterator[Any]:
        assert self._parent is not None
        for element in self._parent._elements(epoch):
            yield _Mapped(self, element)

    def _size(self) -> int | None:
        assert self._parent is not None
        return self._parent._size()

    def _apply(self, arrays: Row) -> Row:
        places = [self.names.index(name) for name in self.inputs]
        values: list[Any] = [arrays[i] for i in places]
        for op in self.operations:
            result = op(*values)
            values = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(values) != len(places):
            name = getattr(self.operations[-1], "__name__", repr(self.operations[-1]))
            raise PcompileError(
                f"map(): {name} returned {len(values)} value(s) for the {len(places)} output "
                f"column(s) {self.outputs}; return one array per column")
        out = list(arrays)
        for i, value in zip(places, values):
            out[i] = np.asarray(value)
        return tuple(out)


class ShuffleDataset(Dataset):
    def __init__(self, parent: Dataset, buffer_size: int) -> None:
        super().__init__(parent)
        self.buffer_size = buffer_size

    def _elements(self, epoch: int) -> Iterator[Any]:
        assert self._parent is not None
        rng = _rng(self._seed, self._depth, epoch)
        buffer: list[Any] = []
        for element in self._parent._elements(epoch):
            if len(buffer) < self.buffer_size:
                buffer.append(element)
                continue
            pick = int(rng.integers(len(buffer)))
            yield buffer[pick]
            buffer[pick] = element
        while buffer:
            yield buffer.pop(int(rng.integers(len(buffer))))

    def _size(self) -> int | None:
        assert self._parent is not None
        return self._parent._size()


class RepeatDataset(Dataset):
    def __init__(self, parent: Dataset, count: int | None) -> None:
        super().__init__(parent)
        self.count = count

    def _elements(self, epoch: int) -> Iterator[Any]:
        assert self._parent is not None
        k = 0
        while self.count is None or k < self.count:
            # each repetition is an epoch of the data below: reshuffled
            inner = epoch * self.count + k if self.count is not None else k
            produced = False
            for element in self._parent._elements(inner):
                produced = True
                yield element
            if not produced:
                return
            k += 1

    def _size(self) -> int | None:
        assert self._parent is not None
        inner = self._parent._size()
        if inner is None or self.count is None:
            return None if inner != 0 else 0
        return inner * self.count


class _TokenWindows:
    """Random access to the (seq_length + 1)-token windows of a flat token file."""

    def __init__(self, path: str, seq_length: int, dtype: np.dtype, offset: int,
                 vocab_size: int | None) -> None:
        self.path, self.seq_length, self.dtype = path, seq_length, dtype
        self.vocab_size = vocab_size
        size = os.path.getsize(path) - offset
        if size < 0 or size % dtype.itemsize:
            raise PcompileError(
                f"TokenFileDataset: {path} holds {size} bytes after offset {offset}, not a whole "
                f"number of {dtype.itemsize}-byte {dtype.name} tokens; is dtype (or offset) "
                "the one the file was written with?")
        tokens = size // dtype.itemsize
        if tokens < seq_length + 1:
            raise PcompileError(
                f"TokenFileDataset: {path} holds {tokens} {dtype.name} tokens, fewer than one "
                f"window of seq_length + 1 = {seq_length + 1}; use a longer file or a shorter "
                "seq_length")
        self.tokens = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(tokens,))
        self.count = (tokens - 1) // seq_length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.count:
            raise IndexError(f"window {index} of {self.count}")
        start = index * self.seq_length
        window = np.asarray(self.tokens[start:start + self.seq_length + 1])
        top = int(window.max())
        if top > np.iinfo(np.int32).max or int(window.min()) < 0:
            raise PcompileError(
                f"TokenFileDataset: {self.path} has token id {top} in window {index}, not an "
                f"int32 id >= 0; is dtype {self.dtype.name} the one the file was written in?")
        if self.vocab_size is not None and top >= self.vocab_size:
            raise PcompileError(
                f"TokenFileDataset: {self.path} has token id {top} in window {index}, beyond "
                f"the vocabulary of {self.vocab_size}; give the tokenizer's vocabulary size "
                "to the model (and vocab_size), or the file of this tokenizer")
        return window.astype(np.int32)


class TokenFileDataset(GeneratorDataset):
    """LLM pretraining data: a flat binary file of token ids (`dtype` uint16, int32, uint32 or
    int64, native byte order, after `offset` header bytes), read through `np.memmap`. Row i is
    one column of int32 token ids, tokens i*S .. i*S + S (S = `seq_length`): S + 1 tokens, the
    model's S inputs and their next-token labels, consecutive windows sharing one token; the
    last tokens that do not fill a window are left out. Only the rows a batch (or a rank's
    share of it) takes are read from the file; with `vocab_size`, an id beyond it is an
    error when read. `shuffle` (default on), `num_shards`, `shard_id` and `num_samples` as
    GeneratorDataset's."""

    DTYPES = ("uint16", "int32", "uint32", "int64")

    def __init__(self, path: str | os.PathLike[str], seq_length: int, dtype: Any = np.uint16,
                 column_names: str | Sequence[str] = "input_ids", offset: int = 0,
                 vocab_size: int | None = None, num_samples: int | None = None,
                 shuffle: bool | None = None,
                 num_shards: int | None = None, shard_id: int | None = None) -> None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise PcompileError(f"TokenFileDataset: token file {path!r} does not exist; give the "
                                "path of a flat binary file of token ids")
        seq_length = _positive(seq_length, "TokenFileDataset(seq_length)")
        try:
            token_type = np.dtype(dtype)
        except TypeError:
            token_type = None
        if token_type is None or token_type.name not in self.DTYPES:
            raise PcompileError(f"TokenFileDataset: dtype {dtype!r} is not a token type; use one "
                                f"of {', '.join(self.DTYPES)} (the type the file was written in)")
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
            raise PcompileError(f"TokenFileDataset: offset must be an int >= 0 (header bytes), "
                                f"got {offset!r}")
        if isinstance(column_names, str):
            column_names = [column_names]
        if len(column_names) != 1:
            raise PcompileError(f"TokenFileDataset: one column (the token ids), got column_names "
                                f"{list(column_names)}")
        if vocab_size is not None:
            vocab_size = _positive(vocab_size, "TokenFileDataset(vocab_size)")
        super().__init__(_TokenWindows(path, seq_length, token_type, int(offset), vocab_size),
                         column_names, num_samples=num_samples, shuffle=shuffle,
                         num_shards=num_shards, shard_id=shard_id)


class TupleIterator:
    """What `create_tuple_iterator` / `create_dict_iterator` return."""

    def __init__(self, dataset: Dataset, columns: Sequence[str] | None, num_epochs: int,
                 output_numpy: bool, as_dict: bool) -> None:
        if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or (
                num_epochs != -1 and num_epochs <= 0):
            raise PcompileError(f"create_tuple_iterator: num_epochs must be -1 or a positive "
                                f"int, got {num_epochs!r}")
        names = dataset.get_col_names()
        picked = list(columns) if columns is not None else names
        missing = [c for c in picked if c not in names]
        if missing:
            raise PcompileError(f"create_tuple_iterator: no column {missing[0]!r}; the columns "
                                f"are {names}")
        self._dataset = dataset
        self._names = picked
        self._index = [names.index(c) for c in picked]
        self._num_epochs = num_epochs
        self._output_numpy = output_numpy
        self._as_dict = as_dict
        self._epoch = 0
        self._current: Iterator[Any] | None = None

    def __iter__(self) -> TupleIterator:
        return self

    def __next__(self) -> Any:
        if self._current is None:
            if self._num_epochs != -1 and self._epoch >= self._num_epochs:
                raise StopIteration
            self._current = self._dataset._elements(self._epoch)
        try:
            element = next(self._current)
        except StopIteration:
            self._current = None
            self._epoch += 1
            raise
        arrays = self._dataset._read(element)
        values: list[Any] = [arrays[i] for i in self._index]
        if not self._output_numpy:
            from pcompile.compiler.frontend.tensor import Tensor

            values = [Tensor(v) for v in values]
        if self._as_dict:
            return dict(zip(self._names, values))
        return tuple(values)


__all__ = ["Dataset", "GeneratorDataset", "NumpySlicesDataset", "TokenFileDataset", "config"]
