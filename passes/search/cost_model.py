"""MindSpore-compatible cost model of the strategy search (reference §2.4, §4.1).

All volumes are bytes of the local slice a rank holds. For an op under strategy s:

* computation  `comp(s) = sum_i bytes(input_i slice)`, plus `bytes(output slice)` for
  MatMul/BatchMatMul when the reduced dim k is split (`computation_cost`);
* forward communication `fwd(s) = bytes(local output before the collective)` for every
  AllReduce / ReduceScatter the rule emits over a group of more than one rank
  (`forward_comm_cost`);
* backward communication `bwd(s) = sum bytes(parameter slice)` over the trainable parameter
  inputs that are not split across all devices: their gradient AllReduce
  (`backward_comm_cost`);
* `comm = fwd + bwd`, `comm_partial = fwd + gamma * bwd` (gradients are nearly free, gamma =
  0.001 by default);
* `BreakingTiesForPreferringDataParallel` (`breaking_ties`): when `s[0][0]` equals the device
  count, 1 is subtracted from every term larger than 1;
* `RefineForPracticalCost(is_redistribution=False)` (`refine_op`): the forward part gets the
  latency model `practical(v) = const if 0 < v <= threshold, v + bias if v > threshold`, then
  `comm = fwd' + bwd`, `comm_partial = fwd' + gamma * bwd`;
* memory `mem(s) = sum bytes(parameter slices) + bytes(output slice)` (what a training step keeps
  for the backward pass; used by dynamic programming's capacity bound).

An edge u -> v whose producer layout differs from the consumer's wanted layout costs the
redistribution between the two (`redistribution_cost`): MindSpore's
`TensorRedistribution::ComputeCost` terms from `passes.redistribution` times the element size,
then `RefineForPracticalCost(is_redistribution=True)` (`refine_redistribution`): `fwd' =
practical(fwd)`, `bwd' = practical(bwd)`, `comm = comm_partial = fwd' + bwd'`. A bool tensor
that needs communication costs infinity.

The objective of a plan is `sum over ops and edges of alpha * comp + beta * comm_partial`
(`Cost.objective`; inference uses the forward communication instead), subject to the total
memory being at most `device_memory_capacity`. The constants come from
`set_cost_model_context` (`compiler.pass_options.cost_constants`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import inf, isfinite, prod

from pcompile.ir.layout import TensorLayout
from pcompile.ir.registry import Trait, has_trait
from pcompile.ir.sharding import OpSharding
from pcompile.ir.types import TensorType
from pcompile.passes.redistribution import plan_redistribution

EPS = 1e-6


@dataclass(frozen=True)
class CostConstants:
    """The constants of the cost model (reference §4.1 defaults)."""

    alpha: float = 1.0
    beta: float = 400.0
    gamma: float = 0.001
    communi_threshold: float = 2048.0
    communi_const: float = 3072.0
    communi_bias: float = 1024.0
    memory_capacity: float = float(16 * 1024**3)
    training: bool = True
    enable_alltoall: bool = False
    rp_matmul_mem_coef: float = 0.1  # recursive programming's weight of a MatMul row cut


@dataclass(frozen=True)
class Cost:
    """MindSpore's `Cost` terms (bytes): computation, communication (forward + backward),
    communication without parameters (forward), communication with partial parameters
    (forward + gamma * backward) and memory."""

    computation: float = 0.0
    communication: float = 0.0
    comm_forward: float = 0.0
    comm_partial: float = 0.0
    memory: float = 0.0

    def objective(self, c: CostConstants) -> float:
        comm = self.comm_partial if c.training else self.comm_forward
        return c.alpha * self.computation + c.beta * comm

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.computation + other.computation,
                    self.communication + other.communication,
                    self.comm_forward + other.comm_forward,
                    self.comm_partial + other.comm_partial,
                    self.memory + other.memory)

    def as_dict(self, c: CostConstants) -> dict[str, float | None]:
        """The terms, rounded; None for an infinite term (a forbidden layout)."""
        return {"computation": printable(self.computation),
                "communication": printable(self.communication),
                "comm_forward": printable(self.comm_forward),
                "comm_partial": printable(self.comm_partial),
                "memory": printable(self.memory),
                "objective": printable(self.objective(c))}


def printable(value: float) -> float | None:
    """`value` rounded to 3 decimals, or None when infinite (dumps and JSON have no inf)."""
    return round(value, 3) if isfinite(value) else None


ZERO = Cost()
INFINITE = Cost(inf, inf, inf, inf, 0.0)


# -- op cost --------------------------------------------------------------------------------------


def slice_bytes(layout: TensorLayout, itemsize: int) -> float:
    return float(prod(layout.slice_shape) * itemsize)


def computation_cost(op: str, sharding: OpSharding, in_types: list[TensorType],
                     out_type: TensorType) -> float:
    """Input slice bytes, plus the output slice for MatMul-like ops with a split k."""
    total = sum(slice_bytes(lay, t.dtype.itemsize)
                for lay, t in zip(sharding.in_layouts, in_types))
    if has_trait(op, Trait.MATMUL) and _partial_group(sharding) > 1:
        total += slice_bytes(sharding.out_layouts[0], out_type.dtype.itemsize)
    return total


def _partial_group(sharding: OpSharding) -> int:
    size = 1
    for comm in sharding.forward:
        if comm.kind in ("AllReduce", "ReduceScatter"):
            size = max(size, prod(sharding.dev_matrix[a] for a in comm.axes))
    return size


def forward_comm_cost(sharding: OpSharding, out_type: TensorType) -> float:
    """Bytes of the local output each forward collective reduces."""
    total = 0.0
    for comm in sharding.forward:
        group = prod(sharding.dev_matrix[a] for a in comm.axes)
        if comm.kind == "Div" or group <= 1:
            continue
        local = slice_bytes(sharding.out_layouts[0], out_type.dtype.itemsize)
        total += local * group if comm.kind == "ReduceScatter" else local
    return total


def backward_comm_cost(sharding: OpSharding, in_types: list[TensorType],
                       trainable: tuple[bool, ...], devices: int) -> float:
    """Gradient AllReduce bytes: trainable parameter inputs not split over every device."""
    total = 0.0
    for lay, t, is_param in zip(sharding.in_layouts, in_types, trainable):
        if is_param and prod(lay.splits) < devices:
            total += slice_bytes(lay, t.dtype.itemsize)
    return total


def memory_cost(sharding: OpSharding, in_types: list[TensorType], out_type: TensorType,
                params: tuple[bool, ...]) -> float:
    """Parameter slices plus the output slice."""
    total = slice_bytes(sharding.out_layouts[0], out_type.dtype.itemsize)
    for lay, t, is_param in zip(sharding.in_layouts, in_types, params):
        if is_param:
            total += slice_bytes(lay, t.dtype.itemsize)
    return total


def practical(volume: float, c: CostConstants) -> float:
    """The latency model of `RefineForPracticalCost`."""
    if EPS < volume <= c.communi_threshold:
        return c.communi_const
    if volume > c.communi_threshold:
        return volume + c.communi_bias
    return volume


def breaking_ties(cost: Cost, strategy: tuple[tuple[int, ...], ...], devices: int) -> Cost:
    """`BreakingTiesForPreferringDataParallel`: prefer splitting input 0's dim 0 everywhere."""
    if not strategy or not strategy[0] or strategy[0][0] != devices:
        return cost

    def dec(v: float) -> float:
        return v - 1.0 if v > 1.0 else v

    return Cost(dec(cost.computation), dec(cost.communication), dec(cost.comm_forward),
                dec(cost.comm_partial), cost.memory)


def refine_op(cost: Cost, c: CostConstants) -> Cost:
    """`RefineForPracticalCost(cost, false)`."""
    backward = cost.communication - cost.comm_forward
    if abs(backward) <= EPS:
        backward = 0.0
    fwd = practical(cost.comm_forward, c)
    comm = fwd + backward if cost.communication > EPS else cost.communication
    partial = fwd + c.gamma * backward if cost.comm_partial > EPS else cost.comm_partial
    return Cost(cost.computation, comm, fwd, partial, cost.memory)


def op_cost(op: str, sharding: OpSharding, in_types: list[TensorType], out_type: TensorType,
            trainable: tuple[bool, ...], params: tuple[bool, ...], devices: int,
            c: CostConstants) -> Cost:
    """The cost of one op under one strategy (`OperatorInfo::SetCostUnderStrategyBase`)."""
    comp = computation_cost(op, sharding, in_types, out_type)
    fwd = forward_comm_cost(sharding, out_type)
    bwd = backward_comm_cost(sharding, in_types, trainable, devices)
    raw = Cost(comp, fwd + bwd, fwd, fwd + c.gamma * bwd,
               memory_cost(sharding, in_types, out_type, params))
    return refine_op(breaking_ties(raw, sharding.strategy, devices), c)


# -- edge (redistribution) cost -------------------------------------------------------------------


def refine_redistribution(forward: float, backward: float, computation: float, memory: float,
                          c: CostConstants) -> Cost:
    """`RefineForPracticalCost(cost, true)`: the latency model on each direction."""
    fwd = practical(forward, c)
    bwd = practical(backward, c)
    comm = fwd + bwd
    return Cost(computation, comm, fwd, comm, memory)


def redistribution_cost(src: TensorLayout, dst: TensorLayout, itemsize: int, is_bool: bool,
                        c: CostConstants) -> Cost:
    """Cost of turning layout `src` into `dst` (`Edge::GetRedistributionCost`)."""
    plan = plan_redistribution(src, dst, c.enable_alltoall)
    if not plan.ops:
        return ZERO
    if is_bool and plan.communicates:
        return INFINITE
    raw = plan.cost(itemsize)
    return refine_redistribution(raw.forward_comm, raw.backward_comm, raw.computation,
                                 raw.memory, c)
