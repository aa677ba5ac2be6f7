"""IR autodiff on whole examples against `jax.grad`: the forward+loss graph of each example is
lowered to JAX and differentiated by JAX; the gradients must equal those of our backward graph
run on the numpy interpreter."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcompile.backends.jax import lower_graph
from pcompile.backends.numpy import run_graph
from pcompile.compiler.model_file import load_model_file
from pcompile.compiler.runtime import synthetic
from pcompile.compiler.tensor import TensorSpec
from pcompile.compiler.trace_model import trace_model
from pcompile.passes.autodiff import append_gradients

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ["quickstart.py", "layout_mlp.py", "manual_parallel.py", "dense_gelu_blocks.py",
            "gpt_block.py"]


@pytest.mark.parametrize("example", EXAMPLES)
def test_gradients_equal_jax_grad(example) -> None:
    traced = trace_model(load_model_file(os.path.join(ROOT, "examples", example)))
    graph = traced.graph
    rng = np.random.default_rng(0)
    # Random data, not the examples' zero placeholders: ReLU at exactly 0 has two valid
    # subgradients (ours: 0 as MindSpore's ReluGrad; jax.grad of maximum: 1/2).
    data = []
    for item in traced.example_inputs + traced.example_labels:
        spec = TensorSpec(item.shape, item.dtype) if isinstance(item, np.ndarray) else item
        data.append(rng.integers(0, 10, spec.shape).astype(spec.dtype.np)
                    if not spec.dtype.is_float else synthetic(spec, rng))
    weights = [p for p in graph.weights if p.requires_grad]
    values = {p.name: traced.parameters[p.name].asnumpy() for p in graph.weights}
    forward = lower_graph(graph)
    n_in = len(graph.inputs)

    def loss_fn(ws):
        feeds = list(data) + [ws[p.name] if p.requires_grad else values[p.name]
                              for p in graph.params[n_in:]]
        return forward(*feeds)[0]

    want_loss, want = jax.value_and_grad(loss_fn)({p.name: jnp.asarray(values[p.name])
                                                   for p in weights})
    grads = append_gradients(graph, graph.outputs[0], weights)
    graph.outputs = [graph.outputs[0], *grads]
    got = run_graph(graph, list(data) + [values[p.name] for p in graph.params[n_in:]])
    np.testing.assert_allclose(got[0], want_loss, rtol=1e-5)
    for p, g in zip(weights, got[1:]):
        w = np.asarray(want[p.name])
        scale = max(float(np.max(np.abs(w))), 1e-6)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=p.name)
