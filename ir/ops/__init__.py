"""Primitive definitions. Importing this package registers every op."""

from pcompile.ir.ops import (  # noqa: F401
    arith,
    attention,
    comm,
    control,
    elementwise,
    fused,
    grouped,
    linalg,
    morph,
    nn,
    norm,
    numeric,
    pipeline,
    random,
    reduce,
    routing,
    shape,
    sort,
    state,
)
