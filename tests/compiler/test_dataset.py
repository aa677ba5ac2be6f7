"""pcompile.dataset (compiler/frontend/dataset.py): MindSpore's dataset API (batching,
drop_remainder, deterministic shuffles, shards that cover the data exactly once), the token-file
windows, and the runtime's sharded reading (compiler/driver/runtime.py): each rank reads only its
rows of every global batch, equal to the slice it would cut from the whole batch, and a resumed
run's skipped steps give the same batches."""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest

import pcompile.dataset as ds
from pcompile import set_seed
from pcompile.compiler.driver.runtime import batches, rank_batches, slice_rows
from pcompile.ir.errors import PcompileError
from pcompile.passes.step_parallel import slice_array
from pcompile.tools.compile import compile as compile_model
from tests import ROOT
from tests.multiprocess import mlp_source


@pytest.fixture(autouse=True)
def _seed():
    set_seed(1)
    yield
    ds.config._seed = None


def column(data) -> list:
    return [row[0].tolist() for row in data]


def test_batch_and_drop_remainder() -> None:
    data = ds.NumpySlicesDataset((np.arange(10), np.arange(10) * 2), ["x", "y"], shuffle=False)
    kept = data.batch(4)
    assert kept.get_dataset_size() == 3 and kept.get_batch_size() == 4
    rows = list(kept)
    assert [r[0].tolist() for r in rows] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert rows[1][1].tolist() == [8, 10, 12, 14]
    dropped = data.batch(4, drop_remainder=True)
    assert dropped.get_dataset_size() == 2 and len(list(dropped)) == 2
    assert data.get_col_names() == ["x", "y"]
    named = ds.NumpySlicesDataset({"a": np.ones((3, 2)), "b": np.zeros(3)}, shuffle=False)
    assert named.get_col_names() == ["a", "b"]
    assert list(named.batch(3))[0][0].shape == (3, 2)


def test_generator_sources_and_iterators() -> None:
    def gen():
        for i in range(5):
            yield np.full(2, i, np.float32), np.int32(i)

    class Random:
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return np.full(2, i, np.float32), np.int32(i)

    for source in (gen, list(gen()), Random()):
        data = ds.GeneratorDataset(source, ["x", "y"], shuffle=False).batch(2)
        assert data.get_dataset_size() == 3
        assert [b[1].tolist() for b in data] == [[0, 1], [2, 3], [4]]
    data = ds.GeneratorDataset(Random(), ["x", "y"], shuffle=False).batch(2, True)
    tensors = next(data.create_tuple_iterator())
    assert type(tensors[0]).__name__ == "Tensor" and tensors[0].shape == (2, 2)
    rows = next(data.create_dict_iterator(output_numpy=True))
    assert rows["y"].tolist() == [0, 1]
    only_y = data.create_tuple_iterator(columns=["y"], num_epochs=2, output_numpy=True)
    epochs = [[b[0].tolist() for b in only_y] for _ in range(3)]
    assert epochs == [[[0, 1], [2, 3]], [[0, 1], [2, 3]], []]  # two epochs, then none


def test_shuffles_are_deterministic_by_seed_and_differ_by_epoch() -> None:
    def pipeline():
        return ds.NumpySlicesDataset(np.arange(40), shuffle=True).shuffle(8).batch(5).repeat(2)

    first = column(pipeline())
    assert column(pipeline()) == first
    assert sorted(sum(first[:8], [])) == list(range(40))  # one repetition: every row once
    assert first[:8] != first[8:]  # the repetition is reshuffled
    set_seed(2)
    assert column(pipeline()) != first
    ds.config.set_seed(1)  # the data sets' own seed wins over pcompile's
    with_config = column(pipeline())
    set_seed(5)
    assert column(pipeline()) == with_config
    it = pipeline().create_tuple_iterator(output_numpy=True)
    one, two = column(it), column(it)
    assert one == with_config and two != one and sorted(sum(two, [])) == sorted(sum(one, []))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("count,shards", [(10, 3), (12, 4), (7, 8)])
def test_shards_cover_the_data_exactly_once(shuffle: bool, count: int, shards: int) -> None:
    seen = []
    for k in range(shards):
        part = ds.NumpySlicesDataset(np.arange(count), shuffle=shuffle, num_shards=shards,
                                     shard_id=k)
        rows = [int(r[0]) for r in part]
        assert part.get_dataset_size() == len(rows)
        seen += rows
    assert sorted(seen) == list(range(count))

    def gen():
        yield from (np.int64(i) for i in range(count))

    streamed = [int(r[0]) for k in range(shards)
                for r in ds.GeneratorDataset(gen, "x", num_shards=shards, shard_id=k)]
    assert sorted(streamed) == list(range(count))


@pytest.mark.parametrize("make,match", [
    (lambda: ds.GeneratorDataset(iter([1, 2]), "x", shuffle=True), "random-access source"),
    (lambda: ds.GeneratorDataset([1, 2], "x", num_shards=2), "together"),
    (lambda: ds.GeneratorDataset([1, 2], "x", num_shards=2, shard_id=2), r"0\.\.1"),
    (lambda: ds.NumpySlicesDataset((np.ones(3), np.ones(4))), "different numbers of rows"),
    (lambda: ds.NumpySlicesDataset(np.ones(3)).batch(0), "positive int"),
    (lambda: list(ds.GeneratorDataset([(1, 2)], ["x"])), "one column per value"),
    (lambda: list(ds.GeneratorDataset([np.ones(2), np.ones(3)], "x", shuffle=False).batch(2)),
     "different shapes"),
    (lambda: ds.NumpySlicesDataset(np.ones(3)).batch(2, num_parallel_workers=2, per_batch_map=1),
     "not supported"),
])
def test_mistakes_are_one_message(make, match: str) -> None:
    with pytest.raises(PcompileError, match=match):
        make()


def test_token_file_windows(tmp_path) -> None:
    tokens = np.arange(1000, 1000 + 23, dtype=np.uint16)
    path = tmp_path / "corpus.bin"
    tokens.tofile(path)
    data = ds.TokenFileDataset(path, seq_length=5, shuffle=False)
    assert data.get_dataset_size() == 4  # (23 - 1) // 5
    windows = [r[0] for r in data]
    assert all(w.dtype == np.int32 and w.shape == (6,) for w in windows)
    assert [w.tolist() for w in windows] == [tokens[5 * i:5 * i + 6].tolist() for i in range(4)]
    batch = next(iter(ds.TokenFileDataset(path, 5).batch(2, drop_remainder=True)))[0]
    assert batch.shape == (2, 6) and all(int(row[0] - 1000) % 5 == 0 for row in batch)
    wide = tmp_path / "wide.bin"
    np.arange(11, dtype=np.int32).tofile(wide)
    assert [r[0].tolist() for r in ds.TokenFileDataset(wide, 5, np.int32, shuffle=False)] == [
        list(range(6)), list(range(5, 11))]
    with pytest.raises(PcompileError, match="whole number of 4-byte"):
        ds.TokenFileDataset(path, 5, np.int32)  # 46 bytes
    with pytest.raises(PcompileError, match="fewer than one window"):
        ds.TokenFileDataset(path, 30)
    with pytest.raises(PcompileError, match="not a token type"):
        ds.TokenFileDataset(path, 5, np.float32)
    with pytest.raises(PcompileError, match="does not exist"):
        ds.TokenFileDataset(tmp_path / "missing.bin", 5)


def test_map_applies_python_functions_to_columns() -> None:
    """Issue 38 item 15: `.map` (an AttributeError before) applies callables in turn to its
    input columns of each row, or of each batch after `batch`; the outputs replace the inputs
    one for one and may be renamed; mistakes are one message."""
    xs, ys = np.arange(12.0).reshape(6, 2), np.arange(6)
    data = ds.NumpySlicesDataset({"x": xs, "y": ys}, shuffle=False)
    seen = []

    def scale(x):
        seen.append(x.shape)
        return x * 10

    mapped = data.map(scale).batch(3)  # the first column by default, per row
    assert [np.array_equal(b[0], xs[i:i + 3] * 10) and np.array_equal(b[1], ys[i:i + 3])
            for b, i in zip(mapped, (0, 3))] == [True, True]
    assert seen == [(2,)] * 6
    both = data.batch(2).map([lambda x, y: (x + 1, y * 2), lambda a, b: [a, b - 1]],
                             input_columns=["x", "y"], output_columns=["a", "b"])
    assert both.get_col_names() == ["a", "b"]
    first = next(iter(both.create_dict_iterator(output_numpy=True)))
    assert np.array_equal(first["a"], xs[:2] + 1) and np.array_equal(first["b"], ys[:2] * 2 - 1)
    with pytest.raises(PcompileError, match="operations must be a callable"):
        data.map("Resize")
    with pytest.raises(PcompileError, match=r"input_columns \['z'\] are not columns"):
        data.map(scale, input_columns="z")
    with pytest.raises(PcompileError, match="replaces columns one for one"):
        data.map(scale, input_columns="x", output_columns=["p", "q"])
    with pytest.raises(PcompileError, match="returned 2 value"):
        list(data.map(lambda x: (x, x)))


MODEL = """
import numpy as np
import pcompile.dataset as ds
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy=STRATEGY)
READ = []  # the rows this process read


class Rows:
    def __len__(self):
        return 20

    def __getitem__(self, i):
        READ.append(i)
        x = np.arange(16, dtype=np.float32) * 0.01 + i
        return x, np.full(8, float(i), np.float32)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 8]), "w")
        self.matmul = ops.MatMul().shard(((2, 1), (1, 4)))

    def construct(self, x):
        return self.matmul(x, self.w)


def model():
    set_seed(3)
    return Net()


def inputs():
    return (np.zeros((8, 16), np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)


def dataset():
    set_seed(11)
    return ds.GeneratorDataset(Rows(), ["x", "y"], shuffle=True).shuffle(6).batch(8, True)
"""


@pytest.mark.parametrize("strategy,share", [("data_parallel", 1), (((2, 1), (2, 1)), 4),
                                            ("full_batch", 8)])
def test_each_rank_reads_only_its_share_and_it_equals_the_global_slice(tmp_path, strategy,
                                                                       share: int) -> None:
    """8 ranks (the MatMul dp 2 x mp 4; the batch split 8, 2 or 1 ways by dataset_strategy):
    over three epochs of a shuffled data set, rank r's rows (read alone) equal its slice of the
    global batch, and only those rows are read."""
    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent(MODEL).replace("STRATEGY", repr(strategy)))
    program = compile_model(str(path), devices=8, dump=False)
    module = program.state.model_file.module
    layouts = program.state.assignment.param_layouts
    names = [p.name for p in program.graph.inputs]
    steps = 6  # two batches an epoch
    module.READ.clear()
    whole = [(epoch, step, arrays) for epoch, step, arrays in batches(program, steps)]
    global_ids = [sorted(set(module.READ))]
    assert [(e, s) for e, s, _ in whole] == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]
    assert not np.array_equal(whole[0][2][0], whole[2][2][0])  # epochs reshuffle
    shares = set()
    for rank in range(8):
        module.READ.clear()
        mine = list(rank_batches(program, [rank], steps))
        assert [(e, s) for e, s, _, _ in mine] == [(e, s) for e, s, _ in whole]
        for (_, _, arrays, first), (_, _, full) in zip(mine, whole):
            for name, part, array in zip(names, arrays, full):
                assert np.array_equal(slice_rows(part, layouts[name], rank, first),
                                      slice_array(array, layouts[name], rank))
        assert len(module.READ) == share * steps  # its rows only
        shares.add(tuple(part.shape[0] for part in mine[0][2]))
    assert global_ids[0] == list(range(20))
    assert shares == {(share, share)}


def test_a_resumed_run_skips_steps_unread_and_sees_the_same_batches(tmp_path) -> None:
    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent(MODEL).replace("STRATEGY", "'data_parallel'"))
    program = compile_model(str(path), devices=8, dump=False)
    module = program.state.model_file.module
    straight = list(rank_batches(program, [5], 7))
    module.READ.clear()
    resumed = list(rank_batches(program, [5], 7, skip=4))
    assert all(arrays is None for _, _, arrays, _ in resumed[:4])
    assert len(module.READ) == 3 * straight[0][2][0].shape[0]  # only the steps trained
    for (e1, s1, a1, f1), (e2, s2, a2, f2) in zip(straight[4:], resumed[4:]):
        assert (e1, s1, f1) == (e2, s2, f2)
        assert all(np.array_equal(x, y) for x, y in zip(a1, a2))


def test_rank_programs_read_the_dataset_spec_written_at_compile_time(tmp_path) -> None:
    """program.py names its data set (`DATASET`); reading it gives each rank what the
    compiled program's own batches give, resumed runs included; a program written before
    `DATASET` gets the same spec from its model file."""
    import ast

    from pcompile.compiler.driver.runtime import (
        DatasetSpec,
        batch_rows,
        dataset_spec,
        spec_batches,
        spec_of_model_file,
    )

    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent(MODEL).replace("STRATEGY", "'data_parallel'"))
    program = compile_model(str(path), devices=8, out_dir=str(tmp_path / "out"))
    text = (tmp_path / "out" / "rank_5" / "program.py").read_text()
    line = next(x for x in text.splitlines() if x.startswith("DATASET = "))
    spec = DatasetSpec.from_literal(ast.literal_eval(line[len("DATASET = "):]))
    assert spec == dataset_spec(program.state)
    assert (spec.inputs, spec.labels) == (1, 1)
    assert spec_of_model_file(spec.model_file, 2) == spec
    layouts = program.state.assignment.param_layouts
    inputs = program.graph.inputs
    expected = [(p.name, tuple(layouts[p.name].shape), p.dtype.np) for p in inputs]
    rows = batch_rows([layouts[p.name] for p in inputs], [5])
    for skip in (0, 3):
        want = list(rank_batches(program, [5], 7, skip=skip))
        got = list(spec_batches(spec, expected, 7, rows=rows, skip=skip))
        assert [(e, s, f) for e, s, _, f in got] == [(e, s, f) for e, s, _, f in want]
        for (_, _, a, _), (_, _, b, _) in zip(got, want):
            assert (a is None and b is None) or all(np.array_equal(x, y) for x, y in zip(a, b))
    with pytest.raises(PcompileError, match="takes 1 inputs and labels, its data set gives"):
        spec_batches(spec, expected[:1], 1)


def test_a_partial_global_batch_is_one_message(tmp_path) -> None:
    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent(MODEL).replace("STRATEGY", "'data_parallel'")
                    .replace("batch(8, True)", "batch(8)"))
    program = compile_model(str(path), devices=8, dump=False)
    # the data set's size says it: before the first batch, not when step 3 reads it
    short = r"batch 3 of epoch 1 \(step 3 of the run\): 4 rows .*drop_remainder=True"
    with pytest.raises(PcompileError, match=short):
        next(rank_batches(program, [0], 3))
    with pytest.raises(PcompileError, match=short):
        next(batches(program, 3))
    assert len(list(rank_batches(program, [0], 2))) == 2  # a run that never reads it


RUN_MODEL = mlp_source("((2, 2), (2, 1))", imports="import pcompile.dataset as ds\n", data='''
def data():
    set_seed(11)
    rng = np.random.default_rng(5)
    xs = rng.standard_normal((20, 16)).astype(np.float32)
    ys = rng.standard_normal((20, 8)).astype(np.float32)
    return ds.NumpySlicesDataset((xs, ys), shuffle=True).batch(8, drop_remainder=True)


if PLAIN:  # the same global batches, three epochs in one pass of a plain iterable
    def dataset():
        batches = data().create_tuple_iterator(output_numpy=True)
        for _ in range(3):
            yield from batches
else:
    def dataset():
        return data()
''')


@pytest.mark.slow
def test_rank_programs_train_alike_from_shares_and_resume_bit_for_bit(tmp_path) -> None:
    """4 ranks in 2 processes: training from a pcompile.dataset (each process reading half of
    every batch) gives the losses of the same global batches given as a plain iterable (every
    process reading them whole); stopped at step 3 and resumed, bit for bit the same."""
    from pcompile.backends.launcher import launch

    logs = {}
    for name, plain, runs in (("plain", True, [(6, False)]), ("sharded", False, [(6, False)]),
                              ("resumed", False, [(3, False), (6, True)])):
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(RUN_MODEL).replace("PLAIN", repr(plain)))
        out = tmp_path / name
        compile_model(str(path), devices=4, out_dir=str(out))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PCOMPILE_")}
        env["JAX_PLATFORMS"] = "cpu"
        for steps, resume in runs:
            said: list[str] = []
            result = launch(str(out), steps=steps, processes=2, resume=resume, env=env,
                            echo=said.append)
            assert result.code == 0, said
        logs[name] = (out / "rank_0" / "train.log").read_text().splitlines()
    assert len(logs["sharded"]) == 6 and logs["resumed"] == logs["sharded"]
    assert [line.split()[-1] for line in logs["plain"]] == [
        line.split()[-1] for line in logs["sharded"]]
    assert logs["sharded"][2].startswith("epoch: 2 step: 1,")  # two batches an epoch


def test_llama_trains_from_a_token_file(tmp_path, monkeypatch) -> None:
    """examples/llama.py with LLAMA_TOKEN_FILE: batches of LLAMA_BATCH windows of LLAMA_SEQ + 1
    tokens of the file, int32, shuffled; ids beyond the vocabulary are one message."""
    from pcompile.compiler.frontend.model_file import load_model_file

    root = ROOT
    tokens = np.random.default_rng(0).integers(1, 128, 400).astype(np.uint16)
    path = tmp_path / "corpus.bin"
    tokens.tofile(path)
    monkeypatch.setenv("LLAMA_TOKEN_FILE", str(path))
    mf = load_model_file(os.path.join(root, "examples", "llama.py"))
    seq, batch = mf.module.SEQ, mf.module.BATCH
    (ids,) = mf.inputs()
    assert ids.shape == (batch, seq + 1) and ids.dtype == np.int32
    windows = {tuple(tokens[i * seq:i * seq + seq + 1].tolist()): i for i in range(399 // seq)}
    got = [windows[tuple(row.tolist())] for (b,) in mf.dataset() for row in b]
    assert len(got) == len(set(got)) == (399 // seq) // batch * batch
    assert got != sorted(got)  # shuffled
    np.full(400, 500, np.uint16).tofile(path)
    with pytest.raises(PcompileError, match="beyond the vocabulary of 128"):
        next(iter(mf.dataset()))
