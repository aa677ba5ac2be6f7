"""Data mistakes found as a run reads its batches (compiler/driver/data_checks.py, through
compiler.runtime's batch iterators): each one `DataError` naming the batch, what is wrong and
what would be valid, raised before the step that would use the batch, or before the first step
when the run certainly reads it and it is known then (issue 38 items 7 and 21). The rank
programs' side (one line through the launcher, never a traceback; a blocked dataset()) is in
tests/backends/test_rank_data.py."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from pcompile.compiler.driver.data_checks import DataError, IndexRange, index_ranges
from pcompile.compiler.driver.runtime import DatasetSpec, batches, dataset_spec
from pcompile.tools.compile import compile as compile_model
from tests.backends.test_rank_data import vocab_model
from tests.multiprocess import mlp_source

# x [8, 16] @ w [16, 8]; `dataset()` below
BATCH = "(rng.standard_normal((ROWS, 16)).astype(np.float32), " \
        "rng.standard_normal((ROWS, 8)).astype(np.float32))"


def mlp(tmp_path, data: str) -> object:
    path = tmp_path / "net.py"
    path.write_text(mlp_source("((1, 1), (1, 1))", data=textwrap.dedent(data)))
    return compile_model(str(path), devices=1, dump=False)


def generator(third: str) -> str:
    """A dataset() of four batches whose third is `third` (Python source of one yield)."""
    return f'''
def dataset():
    rng = np.random.default_rng(7)
    for k in range(4):
        if k == 2:
            {third}
        yield {BATCH.replace("ROWS", "8")}
'''


@pytest.mark.parametrize(("third", "message"), [
    (f"yield {BATCH.replace('ROWS', '5')}",
     r"batch 3 of epoch 1 \(step 3 of the run\): x has shape \(5, 16\); the program was "
     r"compiled for \(8, 16\): yield only whole batches of 8 rows"),
    ("yield rng.standard_normal((8, 16)).astype(np.float32), np.zeros((8, 3), np.float32)",
     r"batch 3 of epoch 1 \(step 3 of the run\): label has shape \(8, 3\); the program was "
     r"compiled for \(8, 8\): give arrays of that shape"),
    ("raise OSError('shard 3 is unreadable')",
     r"reading batch 3 of epoch 1 \(step 3 of the run\): dataset\(\) in .*net.py failed: "
     r"OSError: shard 3 is unreadable"),
    ("import sys; sys.exit(3)",
     r"reading batch 3 of epoch 1 \(step 3 of the run\): dataset\(\) in .*net.py called "
     r"sys.exit\(3\)"),
    ("yield (np.zeros((8, 16), np.float32),)",
     r"batch 3 of epoch 1 \(step 3 of the run\): 1 arrays; the program takes 1 input\(s\) and "
     r"1 label\(s\)"),
])
def test_a_bad_third_batch_is_one_message_before_step_3(tmp_path, third: str,
                                                        message: str) -> None:
    program = mlp(tmp_path, generator(third))
    read = batches(program, 4)
    assert len([next(read), next(read)]) == 2  # the first two are fine
    with pytest.raises(DataError, match=message) as caught:
        next(read)
    assert "\n" not in str(caught.value)


def test_an_iterator_used_up_by_the_first_epoch_is_named(tmp_path) -> None:
    program = mlp(tmp_path, f'''
rng = np.random.default_rng(7)
DATA = iter([{BATCH.replace("ROWS", "8")} for _ in range(3)])


def dataset():
    return DATA
''')
    # (the compile read its first batch: two are left in this process)
    with pytest.raises(DataError, match=r"no batch in epoch 2, where the run needs step 3 .*"
                                        r"an iterator that epoch 1 used up.*at most 2 steps"):
        list(batches(program, 5))


def test_a_list_is_checked_whole_before_the_first_batch(tmp_path) -> None:
    """A list's batches are all known when dataset() returns: a bad third batch is said before
    the first step; a run that stops before it does not read it."""
    program = mlp(tmp_path, f'''
def dataset():
    rng = np.random.default_rng(7)
    return [{BATCH.replace("ROWS", "8")}, {BATCH.replace("ROWS", "8")},
            {BATCH.replace("ROWS", "4")}]
''')
    with pytest.raises(DataError, match=r"batch 3 of epoch 1 \(step 3 of the run\): x has "
                                        r"shape \(4, 16\)"):
        next(batches(program, 3))
    assert len(list(batches(program, 2))) == 2


def test_float_ids_are_refused(tmp_path) -> None:
    path = vocab_model(tmp_path, "(ids if k != 2 else ids.astype(np.float32))", bad=3)
    read = batches(compile_model(str(path), devices=1, dump=False), 4)
    next(read), next(read)
    with pytest.raises(DataError, match=r"batch 3 of epoch 1 \(step 3 of the run\): ids is "
                                        r"float32; the program takes int32"):
        next(read)


@pytest.mark.parametrize("bad", [40, -1])
def test_an_id_outside_the_table_is_one_message(tmp_path, bad: int) -> None:
    """Token ids reach the embedding's Gather through a slice: the program's data set spec
    says ids 0..31; batch 3 holding 40 (or -1) is named with the place of the id."""
    program = compile_model(str(vocab_model(tmp_path, bad=bad)), devices=1, dump=False)
    ranges = index_ranges(program.traced.graph)
    assert [(r.name, r.size) for r in ranges] == [("ids", 32)]
    assert ranges[0].used_by.startswith("Gather 'embedding' at ")
    assert "vocab.py:18, a lookup in a table of 32 rows" in ranges[0].used_by
    read = batches(program, 4)
    next(read), next(read)
    with pytest.raises(DataError, match=rf"batch 3 of epoch 1 \(step 3 of the run\): ids holds "
                                        rf"id {bad} at \[5, 1\]; the program uses it in Gather "
                                        r"'embedding' .*ids 0..31 are valid"):
        next(read)


def test_the_ranges_travel_in_the_programs_dataset_spec(tmp_path) -> None:
    program = compile_model(str(vocab_model(tmp_path)), devices=1, dump=False)
    spec = dataset_spec(program.state)
    assert spec.ranges and spec.ranges[0] == IndexRange("ids", 32, spec.ranges[0].used_by)
    assert DatasetSpec.from_literal(spec.literal()) == spec
    older = {k: v for k, v in spec.literal().items() if k != "ranges"}  # a program before them
    assert DatasetSpec.from_literal(older).ranges == ()


def test_float_inputs_of_an_mlp_have_no_range(tmp_path) -> None:
    program = mlp(tmp_path, generator(f"yield {BATCH.replace('ROWS', '8')}"))
    assert index_ranges(program.traced.graph) == ()
    assert len(list(batches(program, 4))) == 4
    assert not np.isnan(next(batches(program, 1))[2][0]).any()
