import numpy as np
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st
import hypothesis.extra.numpy as hnp

from tests.op_harness import check_op

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5)


@settings(max_examples=20, deadline=None)
@given(shapes, st.integers(0, 2**31 - 1))
def test_relu(shape, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    check_op("ReLU", [x], {}, lambda x: jnp.maximum(x, 0))


@settings(max_examples=20, deadline=None)
@given(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4), st.integers(0, 2**31 - 1))
def test_mul(shapes, seed):
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes.input_shapes)
    check_op("Mul", [a, b], {}, lambda x, y: x * y)
