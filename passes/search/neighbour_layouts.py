"""Candidates under a neighbour's device matrix (MindSpore >= 2.x, `graph_costmodel.cc`:
`AddSwcUnderPrevOpDevMatrix{Single,Multi}` in `BFSNextNode`, `AddSwcUnderNextOpDevMatrix`
in `BFSPrevNode`).

An op's candidates are enumerated as split counts (`candidates.py`); with
`fully_use_devices` only those using every device survive, and a count tuple cannot say
which device axis a dim takes. So a neighbour's layout often has no candidate that takes it
as it is: a configured `MatMul ((2, 1), (1, 4))` wants its left operand split in two and
repeated over the other four ranks, which no full-use candidate of the ReLU before it gives;
a functional shard's `Layout((2, 2, 2), ("dp", "sp", "mp"))("None", "sp")` splits a dim by
the middle axis of its device matrix, which no count tuple says. MindSpore's propagation adds,
to the unconfigured neighbour it is about to decide, the strategy that takes the decided
op's layout as it is, built under the decided op's device matrix. Here that candidate is
built from the op's dimension labels (`with_inputs`, `with_output`): each label takes the
device axes of the dim it labels in the given layout, every other dim stays whole, and the
op's layouts follow with `layout_sharding`, as a `Layout`-configured op's do.

When propagation adds one (`Propagation`, `sharding_propagation.py`):

* backwards, from a decided consumer to a producer with one tensor input: the producer's
  strategy whose output is the layout the consumer wants (`AddSwcUnderNextOpDevMatrix`);
* forwards, to an op with several tensor inputs once all its inputs are decided: the
  strategy taking every producer's layout (when they agree), then the one taking each
  producer's layout alone, in input order (`AddSwcUnderPrevOpDevMatrixMulti`);
* forwards, to an op with one tensor input, only when the producer's own strategy was given
  or built as a layout (MindSpore adds it only for an op whose `outputs_tensor_map_before`
  is set, i.e. an op with a layout; the seeds, MindSpore r2.0, show a strategy tuple's
  consumer deciding among its own candidates: the quickstart's ReLU after
  `MatMul ((2, 4), (4, 1))` takes `((2, 4))`).

A candidate is added only when none of the op's candidates already takes that layout as it
is (same normalised layout), so where the enumeration has one nothing changes; only
ops with plain dimension-label rules get one (irregular rules, `Conv2D` and `cross_batch`
reductions have strategy-dependent behaviour that a layout does not carry). Such a
candidate's strategy reaches `step_parallel_begin` as its layouts (`Candidate.spec`), so
the plan is exactly the one the search costed.
"""

from __future__ import annotations

from typing import Any

from pcompile.ir.core import Constant, GraphParam, Node, NodeResult
from pcompile.ir.layout import TensorLayout, map_axes
from pcompile.ir.registry import Trait, has_trait
from pcompile.ir.sharding import LabelRule, Labels, OpContext, StrategyError, rule_for
from pcompile.ir.types import TensorType
from pcompile.passes.layouts import layout_sharding
from pcompile.passes.search.candidates import Candidate, layout_key, make_candidate, op_context


def tensor_input_count(node: Node) -> int:
    """Operands that are tensors (constants and attributes aside): MindSpore's
    `IsMultiInput` is this count above one."""
    return sum(1 for v in node.operands
               if not isinstance(v, Constant) and isinstance(v.type, TensorType))


def _rule(node: Node, devices: int) -> tuple[OpContext, Labels] | None:
    rule = rule_for(node.op)
    # Only a plain label rule: a subclass (Conv2D, Gather, ...) shards by more than the
    # layouts of its dims.
    if type(rule) is not LabelRule or node.attrs.get("cross_batch"):  # noqa: E721 - exact type
        return None
    if not all(isinstance(v.type, TensorType) for v in node.operands):
        return None
    ctx = op_context(node, devices)
    try:
        return ctx, rule.labels(ctx)
    except (StrategyError, ValueError, KeyError, IndexError):
        return None


def _entry(axes: tuple[int, ...]) -> Any:
    return -1 if not axes else (axes[0] if len(axes) == 1 else axes)


def _weight_of(value: Any) -> GraphParam | None:
    """The stored weight `value` is, looking through single-operand Casts and Identities."""
    while isinstance(value, NodeResult) and has_trait(value.node.op, Trait.VALUE_COPY) \
            and len(value.node.operands) == 1:
        value = value.node.operands[0]
    return value if isinstance(value, GraphParam) and value.kind != "input" else None


def _users(value: Any) -> int:
    """The ops that use `value`, counted through single-operand Casts and Identities."""
    count = 0
    for user, _ in value.uses:
        through = has_trait(user.op, Trait.VALUE_COPY) and len(user.operands) == 1
        count += _users(user.result) if through else 1
    return count


def _shares_a_weight(node: Node) -> bool:
    """Whether an operand of `node` is a weight some other op uses too. A weight is stored
    sliced once, so all its users must split it alike; propagation decides them one at a
    time, and a layout candidate may split it on other device axes than a strategy tuple
    does (a parameter with two users wanting different TensorInfos, refused by
    step_parallel_begin), so such an op keeps its enumerated candidates."""
    for value in node.operands:
        weight = _weight_of(value)
        if weight is not None and _users(weight) > 1:
            return True
    return False


def _build(node: Node, devices: int, dev: tuple[int, ...], axes_of: dict[str, tuple[int, ...]],
           ctx: OpContext, labels: Labels) -> Candidate | None:
    if _shares_a_weight(node):
        return None
    layouts = []
    try:
        for labs, t in zip(labels.inputs, ctx.in_types):
            tmap = tuple(_entry(axes_of.get(name, ())) for name in labs)
            layouts.append(TensorLayout(dev, tmap, t.shape))
        sharding = layout_sharding(ctx, labels, layouts, None)
    except (StrategyError, ValueError):
        return None
    spec = tuple({"device_matrix": lay.dev_matrix, "tensor_map": lay.tensor_map}
                 for lay in sharding.in_layouts)
    return make_candidate(sharding, spec=spec)


def _label_axes(labs: str, layout: TensorLayout, axes_of: dict[str, tuple[int, ...]]) -> bool:
    """Record the axes each label takes in `layout`; False where they contradict."""
    if len(labs) != len(layout.tensor_map):
        return False
    for name, entry in zip(labs, layout.tensor_map):
        axes = map_axes(entry)
        if axes_of.setdefault(name, axes) != axes:
            return False
    return True


def with_inputs(node: Node, devices: int, given: dict[int, TensorLayout]) -> Candidate | None:
    """The strategy of `node` whose input i is `given[i]` as it is (all given layouts on one
    device matrix), its other dims whole."""
    found = _rule(node, devices)
    if found is None or not given:
        return None
    ctx, labels = found
    devs = {lay.dev_matrix for lay in given.values()}
    if len(devs) != 1:
        return None
    axes_of: dict[str, tuple[int, ...]] = {}
    for i, lay in given.items():
        if i >= len(labels.inputs) or not _label_axes(labels.inputs[i], lay, axes_of):
            return None
    cand = _build(node, devices, devs.pop(), axes_of, ctx, labels)
    if cand is None or any(cand.in_keys[i] != layout_key(lay) for i, lay in given.items()):
        return None
    return cand


def with_output(node: Node, devices: int, index: int, layout: TensorLayout
                ) -> Candidate | None:
    """The strategy of `node` whose output `index` is `layout` as it is."""
    found = _rule(node, devices)
    if found is None or index >= len(labels_outputs := found[1].outputs):
        return None
    ctx, labels = found
    axes_of: dict[str, tuple[int, ...]] = {}
    if not _label_axes(labels_outputs[index], layout, axes_of):
        return None
    cand = _build(node, devices, layout.dev_matrix, axes_of, ctx, labels)
    if cand is None or cand.out_keys[index] != layout_key(layout):
        return None
    return cand
