"""IR autodiff on whole examples against `jax.grad`: the forward+loss graph of each example is
lowered to JAX and differentiated by JAX; the gradients must equal those of our backward graph
run on the numpy interpreter. Both run in float64 (JAX with x64 enabled, the interpreter's
float64 mode), so they agree within `FLOAT64_RTOL` of each tensor's scale (tools/oracle.py
derives it); a wrong gradient is off by whole terms."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from pcompile.backends.jax import lower_graph
from pcompile.backends.jax.lowering import x64
from pcompile.backends.numpy import run_graph
from pcompile.compiler.config.context import reset_auto_parallel_context, reset_context
from pcompile.compiler.driver.runtime import synthetic
from pcompile.compiler.driver.trace_model import trace_model
from pcompile.compiler.frontend.model_file import load_model_file
from pcompile.compiler.frontend.tensor import TensorSpec
from pcompile.passes.autodiff import append_gradients
from pcompile.tools.oracle import FLOAT64_RTOL
from tests import ROOT

EXAMPLES = ["quickstart.py", "layout_mlp.py", "manual_parallel.py", "dense_gelu_blocks.py",
            "gpt_block.py"]


@pytest.mark.parametrize("example", EXAMPLES)
def test_gradients_equal_jax_grad(example) -> None:
    # A fresh context, as a compile starts (compiler/driver/driver.py): an earlier test's device_num
    # would make manual_parallel.py's AllReduce span ranks this single-device trace lacks.
    reset_auto_parallel_context()
    reset_context()
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
    wide = [a.astype(np.float64) if a.dtype.kind == "f" else a for a in data]
    values = {p.name: traced.parameters[p.name].asnumpy().astype(np.float64)
              for p in graph.weights}
    forward = lower_graph(graph)
    n_in = len(graph.inputs)

    def loss_fn(ws):
        feeds = list(wide) + [ws[p.name] if p.requires_grad else values[p.name]
                              for p in graph.params[n_in:]]
        return forward(*feeds)[0]

    with x64():
        # jitted: one compilation instead of one per primitive of the forward and backward
        want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(
            {p.name: jax.device_put(values[p.name]) for p in weights})
        want_loss, want = float(want_loss), {k: np.asarray(v) for k, v in want.items()}
    grads = append_gradients(graph, graph.outputs[0], weights)
    graph.outputs = [graph.outputs[0], *grads]
    got = run_graph(graph, list(wide) + [values[p.name] for p in graph.params[n_in:]],
                    float64=True)
    assert np.asarray(got[0]).dtype == np.float64 and want[weights[0].name].dtype == np.float64
    np.testing.assert_allclose(got[0], want_loss, rtol=FLOAT64_RTOL)
    for p, g in zip(weights, got[1:]):
        w = want[p.name]
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(g, w, rtol=0, atol=FLOAT64_RTOL * scale, err_msg=p.name)
