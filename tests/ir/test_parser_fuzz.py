"""The IR parser on hostile input: mutated real dumps with a fixed seed (the quickstart's dumps,
stand-alone and data-parallel, and two golden dumps with strategies, layouts and reasons).

Whatever the text, `parse_graph` returns a graph or raises `ParseError`: never MemoryError,
RecursionError, ValueError or anything else, and never allocates what the text merely declares
(a constant's declared shape, a 4,300-digit number, nesting ten thousand deep). Each parse is
timed; the 2 s bound is checked against the slowest parse, which the bounds keep in
milliseconds.
"""

from __future__ import annotations

import os
import random
import re
import time

import pytest

from pcompile.ir.parser import MAX_CONSTANT_ELEMENTS, MAX_DEPTH, ParseError, parse_graph
from pcompile.ir.printer import print_graph
from tests import ROOT

GOLDEN = os.path.join(ROOT, "tests", "golden")
MUTATIONS = 2000
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?")
_SHAPE = re.compile(r"shape=\[[^\]]*\]")
_TYPE_DIM = re.compile(r"(?<=<Tensor\[Float32\], \()\d+")
_ALPHABET = "()[]{}<>,:;%=\"\\-+.eE0123456789azAZ_ \t\u00e9\u2603\x00"


def dumps() -> dict[str, str]:
    files = sorted(f for f in os.listdir(GOLDEN) if f.endswith(".ir"))
    return {f: open(os.path.join(GOLDEN, f), encoding="utf-8").read() for f in files}


@pytest.fixture(scope="module")
def real_dumps(tmp_path_factory) -> list[tuple[str, str]]:
    from pcompile.tools.compile import compile as compile_model

    root = tmp_path_factory.mktemp("dumps")
    quickstart = os.path.join(ROOT, "examples", "quickstart.py")
    compile_model(quickstart, devices=1, out_dir=str(root / "one"))
    compile_model(quickstart, devices=2, parallel_mode="data_parallel", out_dir=str(root / "dp"))
    texts = [(p.name, p.read_text()) for p in sorted((root / "one" / "rank_0").glob("*.ir"))]
    texts += [(p.name, p.read_text()) for p in sorted((root / "dp" / "rank_1").glob("*.ir"))]
    golden = dumps()
    texts += [(name, golden[name]) for name in ("quickstart_semi.rank5.step_parallel_end.ir",
                                                "layout_mlp.rank3.step_parallel_end.ir")]
    return texts


def _replace_match(text: str, pattern: re.Pattern[str], rng: random.Random,
                   new: str) -> str:
    found = list(pattern.finditer(text))
    if not found:
        return text
    m = rng.choice(found)
    return text[:m.start()] + new + text[m.end():]


def mutate(text: str, rng: random.Random) -> str:
    """One random edit of the kinds that broke the parser, or a generic byte-level edit."""
    kind = rng.randrange(12)
    n = len(text)
    pos = rng.randrange(n)
    if kind == 0:  # a number of thousands of digits
        return _replace_match(text, _NUMBER, rng, "9" * rng.choice((25, 400, 4400, 20000)))
    if kind == 1:  # a number that is merely large
        return _replace_match(text, _NUMBER, rng, str(rng.choice((2**31, 2**63, 10**18, -1))))
    if kind == 2:  # a constant declared huge (what it would allocate)
        dims = ", ".join(str(rng.choice((100000, 65536, 2**31))) for _ in range(rng.randint(1, 3)))
        return _replace_match(text, _SHAPE, rng, f"shape=[{dims}]")
    if kind == 3:  # a constant of very high rank
        return _replace_match(text, _SHAPE, rng, "shape=[" + ", ".join(["1"] * 5000) + "]")
    if kind == 4:  # deep nesting
        depth = rng.choice((100, 3000, 50000))
        opener = rng.choice("([{")
        return text[:pos] + opener * depth + text[pos:]
    if kind == 5:  # a delete
        return text[:pos] + text[pos + rng.randint(1, 40):]
    if kind == 6:  # a replaced character
        return text[:pos] + rng.choice(_ALPHABET) + text[pos + 1:]
    if kind == 7:  # an inserted run of characters
        return text[:pos] + "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 12))) \
            + text[pos:]
    if kind == 8:  # a truncation
        return text[:pos]
    lines = text.split("\n")
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    if kind == 9:  # a duplicated line
        lines.insert(j, lines[i])
    elif kind == 10:  # two lines swapped
        lines[i], lines[j] = lines[j], lines[i]
    else:  # a very long line
        lines[i] = lines[i] + " " + "x" * rng.choice((1000, 200000))
    return "\n".join(lines)


@pytest.mark.slow
def test_mutated_dumps_raise_only_parse_errors(real_dumps) -> None:
    rng = random.Random(20240613)
    texts = real_dumps
    outcomes = {"parsed": 0, "ParseError": 0}
    slowest = 0.0
    for k in range(MUTATIONS):
        name, text = texts[k % len(texts)]
        mutated = text
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            mutated = mutate(mutated, rng)
        start = time.perf_counter()
        try:
            parse_graph(mutated, name)
            outcomes["parsed"] += 1
        except ParseError:
            outcomes["ParseError"] += 1
        except BaseException as exc:  # noqa: BLE001  (the test names what escaped)
            pytest.fail(f"mutation {k} of {name}: {type(exc).__name__}: {str(exc)[:300]}")
        slowest = max(slowest, time.perf_counter() - start)
    assert outcomes["ParseError"] > MUTATIONS // 2, outcomes
    assert slowest < 2.0, slowest


def test_unmutated_dumps_still_round_trip(real_dumps) -> None:
    for name, text in real_dumps:
        assert print_graph(parse_graph(text, name)) == text


def test_bounds_are_parse_errors_naming_the_bound() -> None:
    text = dumps()["quickstart_semi.rank0.execute.ir"]
    huge = _replace_match(text, _SHAPE, random.Random(1), "shape=[100000, 100000]")
    with pytest.raises(ParseError, match=f"at most {MAX_CONSTANT_ELEMENTS}"):
        parse_graph(huge, "huge.ir")
    deep = text.replace("{in_strategy: ", "{in_strategy: " + "(" * (MAX_DEPTH + 5), 1)
    with pytest.raises(ParseError, match="nested deeper than"):
        parse_graph(deep, "deep.ir")
    # a dimension of a tensor type (a number the grammar reads as one, whatever the annotations)
    long_number = _replace_match(text, _TYPE_DIM, random.Random(2), "7" * 5000)
    with pytest.raises(ParseError, match="digits"):
        parse_graph(long_number, "long.ir")
