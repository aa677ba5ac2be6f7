"""The staged driver: model file -> ordered passes -> per-rank graphs and dumps.

Each pass has a name and one `apply(state)`. The driver runs them in order, verifies the graph
after each, times it, and dumps it as `<out>/rank_<r>/<NN>_<pass>.ir`. A failure names the
failing pass and the passes before it. Dumps and `plan.json` are written to a temporary folder
and moved into place only when every pass succeeded, so a failed compile leaves `--out` as it
was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from compiler.context import (
    context_override,
    current_context,
    get_context,
    reset_auto_parallel_context,
)
from compiler.model_file import ModelFile, call_user, load_model_file
from compiler.nn.optim_base import Optimizer
from compiler.trace_model import TracedModel, trace_model
from ir.core import Graph, Value
from ir.errors import PcompileError
from ir.printer import print_graph
from ir.verifier import verify
from passes.autodiff import append_gradients
from passes.optimizer import append_optimizer


@dataclass
class CompileState:
    """What the passes read and write."""

    model_file: ModelFile
    devices: int
    parallel_mode: str
    search_mode: str
    traced: TracedModel | None = None
    graph: Graph | None = None
    rank_graphs: list[Graph] = field(default_factory=list)
    initial_values: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer: Optimizer | None = None
    plan: dict[str, Any] = field(default_factory=dict)

    @property
    def training(self) -> bool:
        return self.model_file.training


class Pass(Protocol):
    name: str

    def apply(self, state: CompileState) -> None: ...


class TracePass:
    """Trace `model()` on `inputs()` (and the loss on the labels) into the forward graph."""

    name = "trace"

    def apply(self, state: CompileState) -> None:
        traced = trace_model(state.model_file)
        state.traced = traced
        state.graph = traced.graph
        for name, param in traced.parameters.items():
            state.initial_values[name] = np.array(param.asnumpy(), copy=True)


class AutodiffPass:
    """Reverse-mode autodiff on the IR: append d loss / d w for every trainable weight."""

    name = "autodiff"

    def apply(self, state: CompileState) -> None:
        graph = state.graph
        assert graph is not None
        loss = graph.outputs[0]
        wrt = [p for p in graph.weights if p.requires_grad]
        if not wrt:
            raise PcompileError("the network has no trainable parameters to train")
        grads = append_gradients(graph, loss, wrt)
        graph.outputs = [loss, *grads]
        graph.attrs["outputs"] = ("loss", *(f"grad.{p.name}" for p in wrt))


class OptimizerPass:
    """Trace `optimizer(params)` after the gradients: the graph becomes one training step."""

    name = "optimizer"

    def apply(self, state: CompileState) -> None:
        graph, traced, mf = state.graph, state.traced, state.model_file
        assert graph is not None and traced is not None
        names = graph.attrs["outputs"]
        loss: Value = graph.outputs[0]
        grads = {n[len("grad."):]: v for n, v in zip(names[1:], graph.outputs[1:])}
        if mf.optimizer is None:
            raise PcompileError(
                f"model file {mf.path} defines loss() but no optimizer(params); training needs "
                "both"
            )
        opt = call_user(mf.optimizer, "optimizer(params)", mf.path, traced.network.trainable_params())
        if not isinstance(opt, Optimizer):
            raise PcompileError(
                f"optimizer(params) in {mf.path} must return an nn optimizer (nn.SGD, "
                f"nn.Momentum, nn.Adam, ...), got {type(opt).__name__}"
            )
        state.optimizer = opt
        state.initial_values.update(append_optimizer(graph, opt, traced.parameters, grads, loss))


class ExecutePass:
    """The graph every rank executes (stand-alone: the one global graph)."""

    name = "execute"

    def apply(self, state: CompileState) -> None:
        assert state.graph is not None
        state.rank_graphs = [state.graph]


@dataclass
class CompiledProgram:
    """The result of `compile()`: per-rank graphs, initial values and how to feed them."""

    state: CompileState
    timings: list[tuple[str, float]]
    out_dir: str | None

    @property
    def graph(self) -> Graph:
        assert self.state.graph is not None
        return self.state.graph

    @property
    def rank_graphs(self) -> list[Graph]:
        return self.state.rank_graphs

    @property
    def traced(self) -> TracedModel:
        assert self.state.traced is not None
        return self.state.traced

    @property
    def training(self) -> bool:
        return self.state.training

    @property
    def initial_values(self) -> dict[str, np.ndarray]:
        return self.state.initial_values

    @property
    def output_names(self) -> list[str]:
        names = self.graph.attrs.get("outputs")
        if names:
            return list(names)
        return [f"output{i}" for i in range(len(self.graph.outputs))]


def pipeline(state: CompileState) -> list[Pass]:
    passes: list[Pass] = [TracePass()]
    if state.training:
        passes += [AutodiffPass(), OptimizerPass()]
    passes.append(ExecutePass())
    return passes


def _check_mode(devices: int, parallel_mode: str) -> None:
    if parallel_mode == "stand_alone" and devices > 1:
        raise PcompileError(
            f"parallel_mode 'stand_alone' runs on one device, but {devices} devices were asked "
            "for; choose a parallel mode (--parallel-mode or --search) or --devices 1"
        )
    if parallel_mode != "stand_alone" and devices > 1:
        raise PcompileError(
            f"parallel_mode {parallel_mode!r} on {devices} devices is not implemented yet in "
            "this version of pcompile: only stand-alone (one device) compilation is available. "
            "Use --devices 1 (or --parallel-mode stand_alone)"
        )


def compile(  # noqa: A001  (the public name DESIGN.md gives it)
    model_path: str,
    *,
    devices: int | None = None,
    parallel_mode: str | None = None,
    search_mode: str | None = None,
    out_dir: str | None = None,
    dump: bool = True,
    overrides: dict[str, Any] | None = None,
) -> CompiledProgram:
    """Compile a model file. Flags given here override what the model file sets."""
    reset_auto_parallel_context()
    mf = load_model_file(model_path)
    flags: dict[str, Any] = dict(overrides or {})
    if devices is not None:
        flags["device_num"] = devices
    if search_mode is not None:
        flags["search_mode"] = search_mode
        if parallel_mode is None:
            parallel_mode = "auto_parallel"
    if parallel_mode is not None:
        flags["parallel_mode"] = parallel_mode
    with context_override(**flags):
        ctx = current_context()
        devices = int(ctx.device_num)
        mode = str(ctx.parallel_mode)
        if devices == 1 and mode != "stand_alone":
            mode = "stand_alone"  # one device: every mode is stand-alone
        _check_mode(devices, mode)
        state = CompileState(mf, devices, mode, str(ctx.search_mode))
        if out_dir is None:
            out_dir = str(get_context("save_graphs_path") or "") or "./saved_graph"
        return _run_pipeline(state, out_dir if dump else None)


def _run_pipeline(state: CompileState, out_dir: str | None) -> CompiledProgram:
    passes = pipeline(state)
    timings: list[tuple[str, float]] = []
    dumps: list[tuple[str, list[str]]] = []
    for index, p in enumerate(passes):
        start = time.perf_counter()
        try:
            p.apply(state)
            graphs = state.rank_graphs if p.name == "execute" else [state.graph]
            for g in graphs:
                assert g is not None
                verify(g)
        except PcompileError as exc:
            if index == 0:
                raise
            done = ", ".join(q.name for q in passes[:index])
            raise type(exc)(f"{exc}\n(in pass '{p.name}', after: {done})") from exc
        timings.append((p.name, time.perf_counter() - start))
        if out_dir is not None:
            texts = [print_graph(g) for g in (state.rank_graphs if p.name == "execute" else
                                              [state.graph])]  # type: ignore[list-item]
            dumps.append((f"{index:02d}_{p.name}.ir", texts))
    if out_dir is not None:
        _write_outputs(out_dir, state, dumps)
    return CompiledProgram(state, timings, out_dir)


def _plan(state: CompileState) -> dict[str, Any]:
    graph = state.graph
    assert graph is not None
    ops = {}
    for node in graph.nodes:
        entry: dict[str, Any] = {"op": node.op, "instance_name": node.instance_name}
        if node.parallel is not None:
            entry["in_strategy"] = node.parallel.in_strategy
        ops[node.fullname] = entry
    params = {
        p.name: {
            "kind": p.kind,
            "shape": list(p.shape),
            "dtype": p.dtype.value,
            "dev_matrix": [1],
            "tensor_map": [-1] * len(p.shape),
            "slice_shape": list(p.shape),
        }
        for p in graph.params
        if p.kind != "input"
    }
    plan = {
        "devices": state.devices,
        "parallel_mode": state.parallel_mode,
        "search_mode": state.search_mode if state.parallel_mode == "auto_parallel" else None,
        "training": state.training,
        "inputs": [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype.value}
                   for p in graph.inputs],
        "outputs": list(graph.attrs.get("outputs", ())),
        "ops": ops,
        "parameters": params,
        "collectives": {str(r): [] for r in range(len(state.rank_graphs))},
    }
    plan.update(state.plan)
    return plan


def _write_outputs(out_dir: str, state: CompileState, dumps: Sequence[tuple[str, list[str]]]):
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.exists(
        os.path.join(out_dir, "plan.json")
    ):
        raise PcompileError(
            f"output folder {out_dir!r} exists and holds files that pcompile did not write; "
            "choose another --out"
        )
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".pcompile-", dir=parent)
    try:
        ranks = max(1, len(state.rank_graphs))
        for r in range(ranks):
            os.makedirs(os.path.join(tmp, f"rank_{r}"))
        for filename, texts in dumps:
            for r in range(ranks):
                text = texts[r] if len(texts) > 1 else texts[0]
                with open(os.path.join(tmp, f"rank_{r}", filename), "w", encoding="utf-8") as f:
                    f.write(text)
        with open(os.path.join(tmp, "plan.json"), "w", encoding="utf-8") as f:
            json.dump(_plan(state), f, indent=1, sort_keys=False)
            f.write("\n")
        if os.path.exists(out_dir):
            old = out_dir.rstrip("/") + ".old-" + str(os.getpid())
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
