"""Morph: MindSpore's region of user code that runs on each rank's slices (`P.Morph(fn,
infer_shape, infer_dtype)` with the `self_define_shard` attribute, mindformers' MoEV3
`hook_ffn_forward`).

In a parallel program the node stands for `fn` applied on every rank to its local slices of
the operands, laid out as its `in_strategy` Layouts say; its one result has the `out_strategy`
Layout. `fn` communicates itself (AlltoAll, AlltoAllV over its group), which is why its shapes
are local: the planner moves the operands to the given layouts and nothing else, and
step_parallel writes `fn`'s ops into the rank's program in the node's place (`MORPH_BODY`, the
expansion below). On one device `fn` runs on the whole tensors and no node is made.

The node records the body's name (`body`, for the dumps and for the table of bodies the front
end fills while it traces: `register_body`) and the global result type (`out_shape`,
`out_dtype`, from the user's infer functions). The body is traced from the model's Python when
the rank's program is written, so its ops are differentiated with the rest of the program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, Node, Value
from pcompile.ir.errors import PcompileError, ShapeError
from pcompile.ir.layout import TensorLayout
from pcompile.ir.ops._define import define
from pcompile.ir.parallel_info import ParallelInfo
from pcompile.ir.registry import ALL
from pcompile.ir.sharding import (
    Expansion,
    LabelRule,
    Labels,
    LocalLowering,
    OpContext,
    OpSharding,
    Strategy,
    StrategyError,
)
from pcompile.ir.types import DType, TensorType, ValueType

#: body name -> f(the rank graph, the local operands, the builder's `rank_value`) -> the local
#: result, filled by the front end while it traces (compiler/frontend/morph.py); `rank_value` gives
#: a rank-dependent value (the group of a collective over a created group) for every rank of the
#: program, or at its one rank
BodyFn = Callable[[Graph, list[Value], Callable[[Any], Any]], Value]
_BODIES: dict[str, BodyFn] = {}


def register_body(name: str, body: BodyFn) -> None:
    _BODIES[name] = body


def _morph_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    shape, dtype = attrs["out_shape"], attrs["out_dtype"]
    if not isinstance(shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ShapeError(f"out_shape must be a tuple of sizes, got {shape!r}")
    if not isinstance(dtype, DType):
        raise ShapeError(f"out_dtype must be a dtype, got {dtype!r}")
    if not isinstance(attrs["body"], str) or not attrs["body"]:
        raise ShapeError(f"body must name the region's function, got {attrs['body']!r}")
    return TensorType(dtype, shape)


class _MorphBody(Expansion):
    def emit(self, lower: LocalLowering, node: Node, b: Builder, operands: list[Value],
             attrs: dict[str, Any], info: ParallelInfo, sharding: OpSharding) -> Value | None:
        body = _BODIES.get(node.attrs["body"])
        if body is None:
            raise PcompileError(f"{node.where()}: the body {node.attrs['body']!r} of this Morph "
                                "was not traced in this compile")
        before = set(map(id, b.graph.nodes))
        out = body(b.graph, operands, lower.rank_value)
        if node.attrs.get("recompute") is True:  # a recomputed cell's region: its ops too
            for made in b.graph.nodes:
                if id(made) not in before and "recompute" not in made.attrs:
                    made.attrs["recompute"] = True
        want = sharding.out_layouts[0].slice_shape
        if out.type != TensorType(node.result.tensor_type.dtype, want):
            raise PcompileError(
                f"{node.where()}: Morph's function returned {out.type} on a rank, but its "
                f"out_strategy layout gives each rank {want} of the "
                f"{node.result.tensor_type.shape} result ({node.result.tensor_type.dtype.value})")
        return out


MORPH_BODY = _MorphBody()


class MorphRule(LabelRule):
    """The Layouts the user gives are the layouts (MindSpore's self_define_shard): no strategy
    of counts, no search, no forward communication."""

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        raise StrategyError("Morph (self_define_shard) takes Layouts: give in_strategy and "
                            "out_strategy as Layout(...) calls, one per tensor operand and one "
                            "for the result")

    def apply_layouts(self, ctx: OpContext, layouts: list[TensorLayout],
                      out_layout: TensorLayout | None) -> OpSharding | None:
        if out_layout is None:
            raise StrategyError("Morph (self_define_shard) needs out_strategy: the Layout of "
                                "its result on the ranks")
        dev = layouts[0].dev_matrix
        if any(lay.dev_matrix != dev for lay in layouts) or out_layout.dev_matrix != dev:
            raise StrategyError("the Layouts of one Morph must share a device matrix")
        strategy = tuple(lay.splits for lay in layouts)
        return OpSharding(strategy, dev, list(layouts), [out_layout], expand=MORPH_BODY)

    def searchable(self, ctx: OpContext, strategy: Strategy) -> bool:
        return False

    def default_strategy(self, ctx: OpContext) -> Strategy:
        raise StrategyError("Morph (self_define_shard) has no default: give its Layouts with "
                            "shard(in_strategy=..., out_strategy=...)")


def _labels(ctx: OpContext) -> Labels:  # only for the rule's interface (never searched)
    names = iter("abcdefghijklmnopqrstuvwxyz")
    ins = ["".join(next(names) for _ in t.shape) for t in ctx.in_types]
    return Labels(ins, ["".join(next(names) for _ in ctx.out_types[0].shape)])


define("Morph", _morph_infer, None, None, num_inputs=None,
       attrs={"body": "", "out_shape": (), "out_dtype": DType.float32},
       sharding=MorphRule(_labels), differentiable=False,
       doc="A region of user code run on each rank's slices (self_define_shard): the operands "
           "in their in_strategy Layouts, the result in its out_strategy Layout.",
       section="compiler", operands="tensors; `body`, `out_shape`, `out_dtype`", dtypes=ALL,
       rule="the user's Layouts (self_define_shard); never searched",
       spelling="ops.Morph(fn, infer_shape, infer_dtype)",
       tests=("test_morph.py::test_morph_region_trains_like_one_device",
              "test_morph.py::test_morph_without_layouts_is_refused"),
       note="`Morph` (`P.Morph(fn, infer_shape, infer_dtype)` with `self_define_shard`, "
            "mindformers' MoEV3 expert region): on each rank `fn` runs on its slices and "
            "communicates itself; step_parallel writes `fn`'s ops into the rank's program in "
            "the node's place, autodiff differentiates them there; on one device `fn` runs on "
            "the whole tensors.")
