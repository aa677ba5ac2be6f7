"""The prose of docs/ops.md that is about no single op: the page's introduction, the section
introductions and the sections on cells and training-step functions. Per-op facts live in the
`OpDoc` record next to each op's declaration (`ir/ops/*.py`); `tools/ops_doc.py` assembles
the page."""

from __future__ import annotations

INTRO = """\
# Primitives

Every primitive pcompile knows, by its MindSpore name, with what its sharding rule allows.
`ops.X()` in a model file emits the IR op of the same name (`ops.Div` emits `RealDiv`);
arguments MindSpore passes at call time but that are compile-time constants here (Reshape's
shape, ReduceSum's axis, Cast's dtype, Tile's multiples, OneHot's depth) become attributes.
Each op is declared once in `ir/ops/*.py` (see [CONTRIBUTING-ops.md](CONTRIBUTING-ops.md)).

This page is generated (`python -m pcompile.tools.ops_doc`): the tables and the notes under
them from the `OpDoc` record next to each op's declaration, the functional tables from the
`ops`, `mint` and `mint.nn.functional` namespaces. `test_ops_page_lists_every_functional_name`
(in `tests/compiler/test_functional_ops.py`) fails when the page differs from what the registry
and the namespaces generate, and `tests/ir/test_ops_dtypes.py::test_every_op_has_a_doc_record`
when an op has no record, names a test that does not exist, or claims a sharding rule its
`OpDef` does not have (or the reverse).

Columns of the primitive tables: **op**, the MindSpore primitive (also the IR op's name);
**model file**, how a model file emits it (every `ops` class that does: MindSpore's aliases
included); **operands -> result**, attributes after a `;`; **dtypes** it accepts (*all*: every
element type; *numeric*: all but Bool; *float*: Float16, BFloat16, Float32): every op is run
under every dtype on both backends and must refuse the others with a message naming the dtype
(`tests/ir/test_ops_dtypes.py::test_op_under_every_dtype`); the **rule** its strategy follows;
**tests**, the tests (under `tests/`) that check its values, gradients and rule.

Notation for rules: "element-wise" means each output dim may be split, an input's broadcast
(size-1) dims never; a label split in the inputs but missing from the output leaves partial
results, all-reduced after the op (see [parallel.md](parallel.md)). Ops marked *no rule* run
only where no strategy is needed: gradient helpers are created after the graph is split, per
rank, on local shapes.

## Element types

`Float32`, `Float16`, `BFloat16`, `Int32`, `Int64`, `UInt8` and `Bool` (the MindIR spellings;
`pcompile.float32`, ..., `pcompile.uint8`, `pcompile.bool_`). Every op runs on the dtypes
MindSpore gives it: data movement (Reshape, Transpose, Concat, Gather, Tile, Select, ...) on all
of them, arithmetic on the numeric ones, transcendental and normalisation ops on the float
ones; an op refuses any other dtype with a message naming it. `tests/ir/test_ops_dtypes.py` runs
every op under every dtype on both backends; constants of every dtype print and re-parse bit
for bit. Float16/BFloat16 normalisations, softmax and attention compute in float32 and round
the result once.

## Shape

`ops.Shape()(x)` (and `ops.shape(x)`) returns `x.shape` as a Python tuple of ints and emits no
IR node. Shapes are static at compile time, as in MindSpore's graph mode, which folds Shape to a
constant: the tuple feeds Python arithmetic, Reshape shapes and slice bounds
(`bs, seq = self.shape(tokens)`; `self.slice(ids, (0, 0), (bs, seq - 1), (1, 1))`). It is the
*global* shape: the per-rank graphs are derived after tracing, so a model never sees a slice
shape.

## Zeros and Ones

`ops.Zeros()(size, type)` and `ops.Ones()(size, type)` (`size` an int or a tuple of ints,
`type` a dtype, Float32 when omitted; mindformers' `dtype=` keyword is the same argument)
return a constant tensor and emit no IR node, as MindSpore's graph mode folds them: the
constant is an operand of the ops that use it (printed in the dumps as a constant) and, like
any constant, is sliced per rank by the layout its user needs."""

# Section key (`OpDoc.section`) -> (title, introduction).
SECTIONS: dict[str, tuple[str, str]] = {
    "elementwise": (
        "Element-wise and comparison",
        """\
A Python number operand becomes a scalar constant of the other operand's dtype; its strategy is
`()`, as in MindSpore: `ops.NotEqual().shard(((dp, 1), ()))` for `not_equal(tokens, pad_id)`.
Gradient helpers take MindSpore's operand orders.""",
    ),
    "linalg": ("Linear algebra, reductions, normalisation", ""),
    "attention": ("Attention: `FlashAttentionScore`", ""),
    "shape": ("Shape and data movement", ""),
    "conv": ("Convolution and pooling", ""),
    "compiler": (
        "Inserted by the compiler",
        """\
The collectives and the virtual ops are inserted per rank by the parallel passes (see
[parallel.md](parallel.md)); `Send` and `Receive` connect pipeline stages (see
[pipeline.md](pipeline.md)).""",
    ),
}

OUTRO = """\
## Cells

`nn.Dense`, `nn.Embedding`, `nn.LayerNorm`, `nn.Conv2d`, `nn.Flatten`, `nn.Dropout`,
`nn.BatchNorm1d`, `nn.BatchNorm2d`, the activations `nn.ReLU`, `nn.GELU`, `nn.Tanh`,
`nn.Sigmoid`, `nn.SiLU`, `nn.Softmax`, `nn.LogSoftmax` (also by name: `activation="silu"`), and
the containers:

`nn.BatchNorm1d` / `nn.BatchNorm2d` and the primitive `ops.BatchNorm(is_training, epsilon,
momentum)` (MindSpore's arguments and strategy `((n, c, h, w), (c,), (c,), (c,), (c,))`) are
traced as the arithmetic they compute (ReduceMean, Sub, Square, Rsqrt, Mul, Add): in training a
split N, H or W dim is normalised by the whole batch's statistics (the ReduceMeans all-reduce, as
MindSpore's SyncBatchNorm in BatchNormInfo), and the moving mean and variance (Parameters,
`moving = momentum * moving + (1 - momentum) * batch` in the cell's terms, the unbiased batch
variance) are state the step updates (`ops.assign`). In `data_parallel` mode, where each rank
traces its own rows, the statistics are the world's AllReduce of every rank's sums (as
MindSpore's SyncBatchNorm; MindSpore's data_parallel BatchNorm uses each rank's rows), so each
rank normalises and updates the moving statistics as one device does. Outside training the
moving statistics normalise. MindSpore's `group_size` attribute (a sync over sub-groups) is
refused. Inside `nn.PipelineCell` each micro-batch is normalised by its own statistics and the
moving statistics move once per micro-batch, in micro-batch order, as MindSpore's PipelineCell
does (docs/pipeline.md).

* `nn.SequentialCell(a, b, ...)` (or a list, or an OrderedDict of named cells) calls its cells
  in order;
* `nn.CellList([a, b, ...])` holds cells the network calls itself (`for layer in self.layers`,
  `self.layers[i](x)`); it supports `append`, `extend`, `insert`, indexing, slicing,
  assignment and `del`, and is never called. As in MindSpore, its cells are named by position:
  parameters `layers.0.attention.wq.weight`, scopes
  `.../layers-CellList/0-LLamaDecodeLayer/...`.

## Training-step functions

Not primitives: functions a training step cell calls after the gradients
([user-guide.md](user-guide.md#training)). `ops.GradOperation(get_all, get_by_list,
sens_param)`; `ops.clip_by_global_norm(grads, clip_norm)` and `ops.global_norm(grads)` (every
gradient slice counted once over the ranks); `ops.assign(parameter, value)` / `ops.Assign()`
(the parameter's new value, returned by the step); `ops.fill(dtype, shape, value)`,
`ops.ones_like`, `ops.zeros_like`, `ops.reciprocal`.

## Functional names: `ops.*` functions, `mint`, `mint.nn.functional`

MindSpore's lower-case functional ops (`ops.matmul`, `ops.add`, `ops.relu`, ..., MindSpore
2.x's signatures) and `mindspore.mint` (PyTorch-style names and signatures:
`mint.add(input, other, *, alpha=1)`, `mint.sum(input, dim, keepdim)`,
`mint.nn.functional.linear`, ...) call the primitives above, so they trace, shard (a functional
op has no `.shard()`: its primitives take their strategies from sharding propagation or the
semi-auto default) and differentiate as those do. `import pcompile.mint as mint`,
`from pcompile import mint` and `from pcompile.mint.nn import functional as F` all work. An
argument a primitive cannot express (a rounding mode, pooling padding, a data-dependent size)
raises ValueError naming it. Every name below is checked against numpy by
`tests/compiler/test_functional_ops.py` (`test_functional_matches_numpy[<prefix>.<name>]`, `F.` for
`mint.nn.functional`; `test_every_functional_name_has_a_case` fails for a name without one),
but `ops.assign`, which stores a Parameter's new value in a training step cell only
(`test_assign_outside_a_step_cell_is_refused` checks the refusal elsewhere).

The tables are generated from the namespaces themselves (signature, the primitives the body
calls, the docstring's first line)."""
