"""Pipeline parallelism, as MindSpore spells it: `nn.PipelineCell`, `nn.MicroBatchInterleaved`.

A model file for pipeline training returns

    nn.PipelineCell(nn.WithLossCell(net, loss_fn), micro_size=m)

from `model()` (and defines no `loss()`), with `set_auto_parallel_context(pipeline_stages=S)`
and `cell.pipeline_stage = s` on the network's cells. Stage s owns ranks [s*n, (s+1)*n),
n = devices / S.

`PipelineCell` cuts every step's batch into `micro_size` micro-batches: a stage runs the
forward and backward of one micro-batch at a time (in the order of `pipeline_config`'s
`pipeline_scheduler`, "1f1b" or "gpipe"), accumulates the gradients over the micro-batches and
communicates and applies them once per step (`passes/micro_batch.py`,
`passes/pipeline_split.py`). Micro-batch k is the k-th of `micro_size` equal blocks of each
rank's share of the batch (MindSpore's `_MicroBatch` applied to what a rank reads). The loss of
a step is the mean of its micro-batches' losses, so for a loss that averages over the batch it
equals the full batch's loss, and training equals single-device training (MindSpore sums the
micro-batch losses instead; divide your learning rate accordingly when porting). On one
device the cell is its network.

`MicroBatchInterleaved(network, interleave_num)` runs `network` on `interleave_num` slices of
dim 0 of its inputs and adds the outputs (MindSpore's semantics: the output is the sum).
"""

from __future__ import annotations

from typing import Any

from pcompile.compiler.frontend.nn.cell import Cell
from pcompile.compiler.frontend.nn.loss import WithLossCell


def _positive_int(value: Any, cls: str, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"For '{cls}', the argument '{what}' must be integer, but got the type "
                        f": {type(value).__name__}.")
    if value <= 0:
        raise ValueError(f"For '{cls}', the argument '{what}' must be large than 0, but got "
                         f"{value}.")
    return value


def _backbone(network: Cell) -> Cell:
    while isinstance(network, (MicroBatchInterleaved, PipelineCell)):
        network = network.network
    return network.backbone_network if isinstance(network, WithLossCell) else network


def _apply_config(network: Cell, config: dict[str, int] | None, what: str) -> None:
    """`stage_config` / `segment_config`: {cell name: value}; a name is a path of
    `network.cells_and_names()` (`_backbone.layer1`), or of the network inside the
    wrappers (`layer1`)."""
    if not config:
        return
    attr = {"stage_config": "pipeline_stage", "segment_config": "pipeline_segment"}[what]
    if not isinstance(config, dict):
        raise TypeError(f"For 'PipelineCell', {what} must be a dict of cell names to ints, got "
                        f"{type(config).__name__}")
    cells = {**dict(network.cells_and_names()), **dict(_backbone(network).cells_and_names())}
    cells.pop("", None)
    left = dict(config)
    for name, value in config.items():
        key = name[len("network."):] if name.startswith("network.") else name
        if key in cells:
            setattr(cells[key], attr, value)
            left.pop(name)
    if left:
        raise KeyError(f"For 'PipelineCell', {what} names cells the network does not have: "
                       f"{', '.join(sorted(left))} (its cells: {', '.join(cells) or 'none'})")


class PipelineCell(Cell):
    """Wraps a network that returns its loss (`nn.WithLossCell(net, loss_fn)`) for pipeline
    training with `micro_size` micro-batches per step (see the module docstring).

    `stage_config` / `segment_config` ({cell name: stage or segment}) set `pipeline_stage` /
    `pipeline_segment` on the named cells of `network`, as MindSpore's newer API does."""

    def __init__(self, network: Cell, micro_size: int,
                 stage_config: dict[str, int] | None = None,
                 segment_config: dict[str, int] | None = None) -> None:
        super().__init__(auto_prefix=False)
        if not isinstance(network, Cell):
            raise TypeError(f"For 'PipelineCell', the argument 'network' must be a Cell, but "
                            f"got {type(network).__name__}.")
        self.network = network
        self.micro_size = _positive_int(micro_size, "PipelineCell", "micro_size")
        _apply_config(network, stage_config, "stage_config")
        _apply_config(network, segment_config, "segment_config")

    def construct(self, *inputs: Any) -> Any:
        # The compiler cuts the batch into micro-batches (passes/micro_batch.py): traced, the
        # cell is its network on one micro-batch.
        return self.network(*inputs)

    def finalize_parameter_names(self) -> None:
        """`auto_prefix=False`, as MindSpore's: parameters keep the network's names."""
        self.network.finalize_parameter_names()
        super().finalize_parameter_names()


#: MindSpore 2.6+'s name for the same wrapper (`mindspore.parallel.nn.Pipeline`).
Pipeline = PipelineCell


class MicroBatchInterleaved(Cell):
    """Runs `network` on `interleave_num` equal slices of dim 0 of its inputs and returns the
    sum of the outputs (MindSpore's `nn.MicroBatchInterleaved`). The network's output must be
    one tensor."""

    def __init__(self, network: Cell, interleave_num: int = 2) -> None:
        super().__init__(auto_prefix=False)
        if not isinstance(network, Cell):
            raise TypeError(f"For 'MicroBatchInterleaved', the argument 'network' must be a "
                            f"Cell, but got {type(network).__name__}.")
        from pcompile.compiler.frontend import ops

        self.network = network
        self.interleave_num = _positive_int(interleave_num, "MicroBatchInterleaved",
                                            "interleave_num")
        self.strided_slice = ops.StridedSlice()
        self.add = ops.Add()

    def construct(self, *inputs: Any) -> Any:
        k = self.interleave_num
        output = None
        for i in range(k):
            pieces = []
            for x in inputs:
                rows = x.shape[0]
                if rows % k:
                    raise ValueError(
                        f"MicroBatchInterleaved: dim 0 of an input of shape {tuple(x.shape)} is "
                        f"not divisible by interleave_num {k}")
                begin = (i * rows // k,) + (0,) * (len(x.shape) - 1)
                end = ((i + 1) * rows // k,) + tuple(x.shape[1:])
                pieces.append(self.strided_slice(x, begin, end, (1,) * len(x.shape)))
            out = self.network(*pieces)
            output = out if output is None else self.add(output, out)
        return output

    def finalize_parameter_names(self) -> None:
        self.network.finalize_parameter_names()
        super().finalize_parameter_names()


__all__ = ["MicroBatchInterleaved", "Pipeline", "PipelineCell", "WithLossCell"]
