"""Record MindSpore's redistribution op lists for random layout pairs (the ground truth of
tests/passes/test_redistribution.py::test_mindspore_recorded_op_lists).

Run with a Python that has MindSpore (2.10, CPU wheel; not a dependency of pcompile):

    python tests/data/record_mindspore_redistribution.py 400 2026 \\
        tests/data/mindspore_redistribution.json

Each case: a source and a target layout (device matrix, tensor map, shape) on 8, 16 or 64
devices, single-axis tensor maps, and the op list MindSpore's solver
(`mindspore.parallel._tensor._transform_tensor_by_layout`) gives for rank 0 and one other rank.
"""

import json
import math
import random
import sys


def factorization(n: int, rnd: random.Random) -> tuple[int, ...]:
    out = []
    while n > 1:
        d = rnd.choice([2, 4, 8] if n >= 8 else ([2, 4] if n >= 4 else [2]))
        while n % d:
            d //= 2
        out.append(d)
        n //= d
    return tuple(out)


def tensor_map(dev: tuple[int, ...], rank: int, rnd: random.Random) -> list[int]:
    axes = list(range(len(dev)))
    rnd.shuffle(axes)
    out = [-1] * rank
    for a in axes:
        where = rnd.randint(-1, rank - 1)
        if where >= 0 and out[where] == -1:
            out[where] = len(dev) - 1 - a
    return out


def split(dev: tuple[int, ...], value: int) -> int:
    return 1 if value == -1 else dev[len(dev) - 1 - value]


def main(count: int, seed: int, path: str) -> None:
    from mindspore.parallel._tensor import _transform_tensor_by_layout as transform

    rnd = random.Random(seed)
    cases = []
    while len(cases) < count:
        n = rnd.choice([8, 16, 64])
        rank = rnd.randint(1, 3)
        dev_a, dev_b = factorization(n, rnd), factorization(n, rnd)
        map_a, map_b = tensor_map(dev_a, rank, rnd), tensor_map(dev_b, rank, rnd)
        if (dev_a, map_a) == (dev_b, map_b):
            continue
        shape = [math.lcm(split(dev_a, x), split(dev_b, y)) * rnd.choice([1, 2, 3])
                 for x, y in zip(map_a, map_b)]
        ops = {}
        for r in sorted({0, rnd.randrange(n)}):
            got = transform((dev_a, tuple(map_a), tuple(shape)),
                            (dev_b, tuple(map_b), tuple(shape)), tuple(range(n)), r)
            ops[str(r)] = [[name, list(args)] for name, args in got]
        cases.append({"from": [list(dev_a), map_a, shape], "to": [list(dev_b), map_b, shape],
                      "ops": ops})
    with open(path, "w") as f:
        json.dump({"source": "MindSpore 2.10, mindspore.parallel._tensor."
                             "_transform_tensor_by_layout", "seed": seed, "cases": cases},
                  f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
