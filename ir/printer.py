"""The IR text printer: `print_graph(graph) -> str`, MindIR-like.

The printer and `ir.parser` are written side by side from one grammar (documented in full,
with examples, in `docs/ir-reference.md`). `parse_graph(print_graph(g))` is structurally equal
to `g`, and `print_graph(parse_graph(text)) == text` for every text this module writes.

File layout (`NL` is a newline, `INT` a decimal integer, `{...}` repeats)::

    file      = "# IR entry: @" gname NL "# Total subgraphs: 1" NL NL
                "# Attrs:" NL {key ": " value NL} NL
                "# Total params: " INT NL "# Params:" NL {param NL} NL
                "Node counting information:" NL
                "Total number of nodes: " INT NL "Total number of cnodes: " INT NL NL
                "subgraph @" gname "() {" NL {node} return "}" NL
    param     = "%para" INT "_" pname ": " ptype
    ptype     = tensor_type ["  :  requires_grad"]
              | "<Ref[Tensor[" DTYPE "]], " shape ", ref_key=" pname ", "
                ("is_parameter" | "is_state") [", no_grad" | ", requires_grad"] ">  :  has_default"
    node      = "  %" INT "(" hint ") = " OP "(" [operands] ")"
                [" {instance name: " word "}"] " primitive_attrs: " dict [" " dict] NL
                "      : (" [types] ") -> (" type ")" NL
                "      # scope: (" text_or_json ")" NL
                ["      # In file " file ":" INT ("/" raw_text "/" | " " json_string) NL]
    return    = "  Return(" [operands] ")" NL "      : (" [types] ")" NL
                "      # scope: (Default)" NL
    operand   = "%" INT | "%para" INT "_" pname
              | "Tensor(shape=[" [INT {", " INT}] "], dtype=" DTYPE ", value=" cvalue ")"

Attribute values (`value`) are: `true`/`false`, `None`, ints, floats in Python `repr` form
(always containing `.`, `e`, `inf` or `nan`), MindIR dtype names (`Float32`, ...), strings
(bare when they match `BARE_STRING` and are no keyword, else JSON-quoted), tuples `()`,
`(1,)`, `(1, 2)`, lists `[1, 2]` and dicts `{key: value, ...}`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any

import numpy as np

from pcompile.ir.core import (
    Constant,
    Graph,
    GraphParam,
    Node,
    NodeResult,
    OpaqueConstant,
    ParallelInfo,
    RankConstant,
    SourceLoc,
    Value,
    array_digest,
    constant_at,
)
from pcompile.ir.memo import items_key, typed_key
from pcompile.ir.parallel_info import LayoutDetail, RunnerUp, SearchCost, SwcCost
from pcompile.ir.rank import RankValue, has_rank_values, resolve, resolve_attrs
from pcompile.ir.types import DType, ValueType, format_shape

# -- lexical rules shared with ir.parser ------------------------------------------------------

#: Strings that print without quotes (when not a keyword or dtype name).
BARE_STRING = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
#: Words that must be quoted when they are strings, because bare they mean something else.
KEYWORDS = frozenset({"true", "false", "None", "inf", "nan"})
#: Dtype spellings in the text, mapped to `DType`.
DTYPE_NAMES: dict[str, DType] = {d.value: d for d in DType}
#: Graph and parameter names that print without quotes.
BARE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
#: Instance names that print without quotes.
BARE_WORD = re.compile(r"[A-Za-z0-9_./-]+")
#: Characters a node's name hint keeps; the printer replaces every other one with `_`.
HINT = re.compile(r"[A-Za-z0-9_.\[\]-]+")
_HINT_BAD = re.compile(r"[^A-Za-z0-9_.\[\]-]")
#: Characters that never appear raw inside a line (they would split it).
_LINE_BREAKS = ("\n", "\r")

NODE_INDENT = "  "
DETAIL_INDENT = "      "
RETURN_SCOPE = "Default"


def quote(text: str) -> str:
    """JSON string literal (ASCII only, so dumps are plain ASCII for such values)."""
    return json.dumps(text)


def format_string(text: str) -> str:
    """A string attribute value: bare when unambiguous, else JSON-quoted."""
    if BARE_STRING.fullmatch(text) and text not in KEYWORDS and text not in DTYPE_NAMES:
        return text
    return quote(text)


def format_name(name: str) -> str:
    """A graph or parameter name: bare when it matches `BARE_NAME`, else JSON-quoted."""
    return name if BARE_NAME.fullmatch(name) else quote(name)


def format_word(word: str) -> str:
    """An instance name: bare when it matches `BARE_WORD`, else JSON-quoted."""
    return word if BARE_WORD.fullmatch(word) else quote(word)


def format_free_text(text: str) -> str:
    """Text that runs to a fixed terminator (a scope): raw unless it contains a line break
    or starts with a double quote, else JSON-quoted."""
    if text.startswith('"') or any(c in text for c in _LINE_BREAKS):
        return quote(text)
    return text


def sanitize_hint(hint: str) -> str:
    """The name hint as printed: characters outside `HINT` become `_`; empty → `CNode`."""
    text = _HINT_TEXT.get(hint)
    if text is None:
        text = _HINT_BAD.sub("_", hint) or "CNode"
        if len(_HINT_TEXT) < _MEMO_LIMIT:
            _HINT_TEXT[hint] = text
    return text


def format_float(value: float) -> str:
    """Python `repr`: exact for float64 and so for every narrower float type."""
    return repr(float(value))


_PLAIN_INTS = frozenset({int})


def format_value(value: Any) -> str:
    """The text of an attribute value (see the module docstring for the grammar)."""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if value is None:
        return "None"
    if isinstance(value, DType):
        return value.value
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return format_float(float(value))
    if isinstance(value, str):
        return format_string(value)
    if isinstance(value, tuple):
        if len(value) == 1:
            return f"({format_value(value[0])},)"
        if _PLAIN_INTS.issuperset(map(type, value)):  # shapes, rank lists: str(int) each
            return "(" + ", ".join(map(str, value)) + ")"
        return "(" + ", ".join(format_value(v) for v in value) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return format_dict(value)
    raise TypeError(
        f"cannot print attribute value {value!r} of type {type(value).__name__}; allowed: "
        "bool, int, float, str, None, DType, and tuples, lists and dicts of those"
    )


STRATEGY_KEYS = ("in_strategy", "out_strategy")

#: Keys of a node's attributes or parallel-info group printed as MindSpore prints them with
#: `MS_DEV_DUMP_IR_PARALLEL_DETAIL=1` (`format_mindspore`): the tensor maps and device matrix
#: of its OperatorInfo, and the layouts of sharding propagation.
DETAIL_KEYS = ("inputs_tensor_map", "outputs_tensor_map", "device_matrix", "in_layout",
               "out_layout")
#: Detail keys whose value is a tuple of layout dicts with quoted keys,
#: `({'device_matrix': (2, 4, 1), 'tensor_map': (2, 0)})`.
LAYOUT_KEYS = ("in_layout", "out_layout")


def format_dict(mapping: dict[Any, Any], top: bool = False) -> str:
    """`{key: value, ...}` with keys printed as values (normally bare strings); the values of
    `in_strategy` and `out_strategy` in the strategy spelling (`format_strategy`) and, in a
    node's own attributes or parallel-info group (`top`), those of `DETAIL_KEYS` in
    MindSpore's (`format_mindspore`)."""
    try:
        key = (top, *items_key(mapping))
    except TypeError:  # an unhashable value (a list, a dict): no memo
        return _format_dict(mapping, top)
    text = _DICT_TEXT.get(key)
    if text is None:
        text = _format_dict(mapping, top)
        if len(_DICT_TEXT) < _MEMO_LIMIT:
            _DICT_TEXT[key] = text
    return text


def format_mindspore(value: Any) -> str:
    """A value as MindSpore's `ValuePtr::ToString` prints it: tuples without a trailing comma
    in a one-element tuple (`((1, 0), (2))`), dicts with single-quoted keys; scalars and
    strings as attribute values."""
    if isinstance(value, tuple):
        return "(" + ", ".join(format_mindspore(v) for v in value) + ")"
    if isinstance(value, dict):
        _check_keys(value, "a layout dict")
        return "{" + ", ".join(f"'{k}': {format_mindspore(v)}" for k, v in value.items()) + "}"
    return format_value(value)


def format_attrs(attrs: dict[str, Any], rank: int | None = None) -> str:
    """`format_dict` of a node's attributes at `rank` (rank-dependent values evaluated),
    memoised by the attributes as they are (an `ir.rank` value hashes cheaply; its value at a
    rank, e.g. a list of 512 ranks, would not)."""
    if rank is None or not has_rank_values(attrs):
        return format_dict(attrs, top=True)
    try:
        key = (rank, items_key(attrs))
    except TypeError:
        return _format_dict(resolve_attrs(attrs, rank), top=True)
    text = _RANK_DICT_TEXT.get(key)
    if text is None:
        text = _format_dict(resolve_attrs(attrs, rank), top=True)
        if len(_RANK_DICT_TEXT) < _MEMO_LIMIT:
            _RANK_DICT_TEXT[key] = text
    return text


def _format_dict(mapping: dict[Any, Any], top: bool = False) -> str:
    def text(k: Any, v: Any) -> str:
        if k in STRATEGY_KEYS:
            return format_strategy(v)
        if top and k in DETAIL_KEYS:
            return format_mindspore(v)
        return format_value(v)

    return "{" + ", ".join(f"{format_value(k)}: {text(k, v)}" for k, v in mapping.items()) + "}"


def format_type(type_: ValueType) -> str:
    """`<Tensor[Float32], (16, 32)>` or `<Tuple[...], TupleShape(...)>` (see ir.types)."""
    text = _TYPE_TEXT.get(type_)
    if text is None:
        text = str(type_)
        if len(_TYPE_TEXT) < _MEMO_LIMIT:
            _TYPE_TEXT[type_] = text
    return text


# Texts printed over and over (every dump repeats a model's types, scopes and source lines):
# memoised by value, which is all they depend on.
_MEMO_LIMIT = 200_000
_TYPE_TEXT: dict[ValueType, str] = {}
_SOURCE_TEXT: dict[SourceLoc, str] = {}
_SCOPE_TEXT: dict[str, str] = {}
_HINT_TEXT: dict[str, str] = {}
_DICT_TEXT: dict[tuple[Any, ...], str] = {}
_RANK_DICT_TEXT: dict[tuple[Any, ...], str] = {}
_PARALLEL_TEXT: dict[tuple[Any, ...], str] = {}
_CONST_TEXT: dict[tuple[Any, ...], str] = {}


# -- constants --------------------------------------------------------------------------------


def is_splat(array: np.ndarray) -> bool:
    """True when the array has elements and all of them print the same: bit-identical (so
    `-0.0` and `0.0` differ), or all NaN (the text keeps no NaN sign or payload)."""
    if array.size == 0:
        return False
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype.kind == "f" or flat.dtype == DType.bfloat16.np:
        nan = np.isnan(flat.astype(np.float64))
        if nan.any():
            return bool(nan.all())
    bits = flat.view(f"u{flat.dtype.itemsize}")
    return bool(np.all(bits == bits[0]))


def _element_texts(array: np.ndarray, dtype: DType) -> list[str]:
    flat = array.reshape(-1)
    if dtype is DType.bool_:
        return ["true" if v else "false" for v in flat.tolist()]
    if dtype.is_float:
        return [format_float(v) for v in flat.astype(np.float64).tolist()]
    return [str(int(v)) for v in flat.tolist()]


def _nest(texts: list[str], shape: tuple[int, ...]) -> str:
    """The nested-list spelling of row-major `texts` with the given shape."""
    if not shape:
        return texts[0]
    if len(shape) == 1:
        return "[" + ", ".join(texts) + "]"
    step = len(texts) // shape[0] if shape[0] else 0
    rows = (_nest(texts[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0]))
    return "[" + ", ".join(rows) + "]"


#: Constants with more elements print by digest unless they are splats (`format_constant`).
LARGE_CONSTANT = 1024


def format_constant(const: Constant, rank: int | None = None) -> str:
    """`Tensor(shape=[2, 3], dtype=Float32, value=V)`; V is one number for a splat, the nested
    list of all values, or for a constant of more than `LARGE_CONSTANT` elements `@<digest>`
    (sha256 of its data: a 2048 x 2048 attention mask would be 80 MB of text in every dump).
    A rank-dependent constant prints `rank`'s values."""
    ttype = const.tensor_type
    if isinstance(const, OpaqueConstant):
        return _digest_text(ttype, const.digest)
    if ttype.size > LARGE_CONSTANT:
        # Printed once per dump and per rank: remembered on the constant (its data never
        # changes), so a 16 MB mask is hashed once, not in every dump.
        memo: dict[int | None, str] = const.__dict__.setdefault("_text", {})
        text = memo.get(rank)
        if text is None:
            text = memo[rank] = _format_constant(ttype, np.asarray(constant_at(const, rank)))
        return text
    array = np.asarray(constant_at(const, rank))
    if array.size <= 16:  # scalars and small constants repeat: memoised by their bytes
        key = (ttype, array.dtype.str, array.tobytes())
        text = _CONST_TEXT.get(key)
        if text is None:
            text = _format_constant(ttype, array)
            if len(_CONST_TEXT) < _MEMO_LIMIT:
                _CONST_TEXT[key] = text
        return text
    return _format_constant(ttype, array)


def _digest_text(ttype: Any, digest: str) -> str:
    dims = ", ".join(str(d) for d in ttype.shape)
    return f"Tensor(shape=[{dims}], dtype={ttype.dtype.value}, value=@{digest})"


def _format_constant(ttype: Any, array: np.ndarray) -> str:
    if is_splat(array):
        value = _element_texts(array.reshape(-1)[:1], ttype.dtype)[0]
    elif array.size > LARGE_CONSTANT:
        return _digest_text(ttype, array_digest(array))
    else:
        value = _nest(_element_texts(array, ttype.dtype), ttype.shape)
    dims = ", ".join(str(d) for d in ttype.shape)
    return f"Tensor(shape=[{dims}], dtype={ttype.dtype.value}, value={value})"


# -- graph ------------------------------------------------------------------------------------


def param_ref(index: int, param: GraphParam) -> str:
    """`%para<k>_<name>`, k counting from 1."""
    return f"%para{index + 1}_{format_name(param.name)}"


def format_param_type(param: GraphParam) -> str:
    """The type of a graph parameter in the `# Params:` block."""
    ttype = param.tensor_type
    if param.kind == "input":
        return str(ttype) + ("  :  requires_grad" if param.requires_grad else "")
    flag = "is_parameter" if param.kind == "weight" else "is_state"
    grad = ""
    if param.kind == "weight" and not param.requires_grad:
        grad = ", no_grad"
    elif param.kind == "state" and param.requires_grad:
        grad = ", requires_grad"
    return (
        f"<Ref[Tensor[{ttype.dtype.value}]], {format_shape(ttype.shape)}, "
        f"ref_key={format_name(param.name)}, {flag}{grad}>  :  has_default"
    )


def format_source(source: SourceLoc) -> str:
    """`# In file <file>:<line>/<text>/`; the file is JSON-quoted when it contains `:` (or a
    line break, or starts with a quote); a text with a line break is written as
    `:<line> "<json>"` instead of between slashes."""
    text = _SOURCE_TEXT.get(source)
    if text is None:
        text = _format_source(source)
        if len(_SOURCE_TEXT) < _MEMO_LIMIT:
            _SOURCE_TEXT[source] = text
    return text


def _format_source(source: SourceLoc) -> str:
    file = source.file
    if ":" in file or file.startswith('"') or any(c in file for c in _LINE_BREAKS):
        file = quote(file)
    if any(c in source.text for c in _LINE_BREAKS):
        return f"# In file {file}:{source.line} {quote(source.text)}"
    return f"# In file {file}:{source.line}/{source.text}/"


def format_strategy(value: Any) -> str:
    """A strategy (one tuple of dims per input) as MindSpore prints it: no trailing comma in a
    one-element tuple, `((2, 4))`, `((8))`. Other values print as attribute values."""
    if isinstance(value, tuple) and all(
        isinstance(s, tuple) and all(isinstance(d, (int, np.integer)) and not isinstance(
            d, (bool, np.bool_)) for d in s) for s in value):
        return "(" + ", ".join("(" + ", ".join(str(int(d)) for d in s) + ")" for s in value) + ")"
    return format_value(value)


def _check_keys(mapping: dict[Any, Any], what: str) -> None:
    bad = [k for k in mapping if not isinstance(k, str)]
    if bad:
        raise TypeError(f"{what} keys must be strings, got {bad[0]!r}")


def format_parallel(info: ParallelInfo) -> str:
    """The parallel-info group `{name: value, ...}`: each set field of `ParallelInfo` in the
    order `ParallelInfo.items` gives, its value written by its entry in `PARALLEL_FIELDS`."""
    fields = info.items()
    try:
        key = tuple((name, _field_key(value)) for name, value in fields)
    except TypeError:  # an unhashable value (a list in a strategy): no memo
        return _format_parallel(fields)
    text = _PARALLEL_TEXT.get(key)
    if text is None:
        text = _format_parallel(fields)
        if len(_PARALLEL_TEXT) < _MEMO_LIMIT:
            _PARALLEL_TEXT[key] = text
    return text


def _format_parallel(fields: list[tuple[str, Any]]) -> str:
    return "{" + ", ".join(f"{name}: {PARALLEL_FIELDS[name](value)}"
                           for name, value in fields) + "}"


def _field_key(value: Any) -> Any:
    """`typed_key` through the frozen dataclasses of `ir.parallel_info` (whose own equality
    would take 1 for 1.0 and 0.0 for -0.0)."""
    if is_dataclass(value):
        return (type(value), tuple(_field_key(getattr(value, f.name)) for f in fields(value)))
    if isinstance(value, tuple) and not all(type(v) is int for v in value):
        return (tuple, tuple(_field_key(v) for v in value))
    return typed_key(value)


def _cost_number(value: float | None) -> float | None:
    """A cost as the search's plan writes it: None for an infinite one (no inf in dumps)."""
    return None if value is None or not math.isfinite(value) else value


def _format_layouts(layouts: tuple[LayoutDetail, ...]) -> str:
    return format_mindspore(tuple(layout.as_dict() for layout in layouts))


def _format_cost(cost: SearchCost) -> str:
    out: dict[str, Any] = {}
    if cost.local is not None:
        out["local"] = _cost_number(cost.local)
    out["op"] = _cost_number(cost.op)
    out["redistribution"] = _cost_number(cost.redistribution)
    return format_dict(out)


def _swc_dict(swc: SwcCost) -> dict[str, Any]:
    return {"communication": _cost_number(swc.communication),
            "computation": _cost_number(swc.computation),
            "forward": _cost_number(swc.forward)}


def _format_runner_up(runner: RunnerUp) -> str:
    out: dict[str, Any] = {"strategy": runner.strategy}
    if runner.local is not None:
        out["local"] = _cost_number(runner.local)
    if runner.swc is not None:
        out.update(_swc_dict(runner.swc))
    return format_dict(out)


#: The text of each `ParallelInfo` field's value (`ir.parser.PARALLEL_FIELDS` reads it back):
#: strategies in MindSpore's strategy spelling, layouts as MindSpore's parallel detail prints
#: them (`({'device_matrix': (2, 4), 'tensor_map': (1, 0)})`), the search's costs as dicts of
#: numbers (None for an infinite cost), the rest as attribute values.
PARALLEL_FIELDS: dict[str, Callable[[Any], str]] = {
    "in_strategy": format_strategy,
    "out_strategy": format_strategy,
    "in_layout": _format_layouts,
    "out_layout": _format_layouts,
    "cost": _format_cost,
    "decision": lambda swc: format_dict(_swc_dict(swc)),
    "runner_up": _format_runner_up,
    "decided_by": format_value,
    "micro": format_value,
    "chunk": format_value,
    "reason": format_value,
    "fusion": format_value,
    "members": format_value,
    "bytes": format_value,
    "parameter": format_value,
}


class _Hole:
    """A node whose text depends on the rank (rank-dependent attributes or constants)."""

    def __init__(self, printer: _Printer, index: int, node: Node) -> None:
        self.printer, self.index, self.node = printer, index, node

    def render(self, rank: int) -> str:
        return "\n".join(self.printer.node(self.index, self.node, rank)) + "\n"


class _Printer:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.names: dict[int, str] = {}
        for i, param in enumerate(graph.params):
            self.names[id(param)] = param_ref(i, param)
        for i, node in enumerate(graph.nodes):
            self.names[id(node.result)] = f"%{i}"

    def operand(self, value: Value, user: str, rank: int | None = None) -> str:
        if isinstance(value, Constant):
            return format_constant(value, rank)
        name = self.names.get(id(value))
        if name is None:
            kind = "parameter" if isinstance(value, GraphParam) else "node result"
            if isinstance(value, NodeResult):
                kind += f" of {value.node.op}"
            raise ValueError(
                f"graph {self.graph.name}: {user} uses {kind} {value.name_hint!r}, which is not "
                "in the graph"
            )
        return name

    def operand_type(self, value: Value) -> str:
        return format_type(value.type)

    def node(self, index: int, node: Node, rank: int | None = None) -> list[str]:
        names = self.names
        operand_values = node.operands
        texts = []
        for v in operand_values:
            text = names.get(id(v))  # a parameter or node result: the common case
            texts.append(text if text is not None
                         else self.operand(v, f"node %{index} ({node.op})", rank))
        head = (
            f"{NODE_INDENT}%{index}({sanitize_hint(node.result.name_hint)}) = {node.op}"
            f"({', '.join(texts)})"
        )
        if node.instance_name:
            head += f" {{instance name: {format_word(node.instance_name)}}}"
        if not all(type(k) is str for k in node.attrs):
            _check_keys(node.attrs, f"node %{index} ({node.op}): attribute")
        head += f" primitive_attrs: {format_attrs(node.attrs, rank)}"
        if node.parallel is not None:
            head += " " + format_parallel(node.parallel)
        in_types = ", ".join([format_type(v.type) for v in operand_values])
        scope = _SCOPE_TEXT.get(node.scope)
        if scope is None:
            scope = _SCOPE_TEXT[node.scope] = format_free_text(node.scope)
        lines = [
            head,
            f"{DETAIL_INDENT}: ({in_types}) -> ({format_type(node.result.type)})",
            f"{DETAIL_INDENT}# scope: ({scope})",
        ]
        if node.source is not None:
            lines.append(DETAIL_INDENT + format_source(node.source))
        return lines

    def head(self) -> list[str | _AttrsHole]:
        """Everything before the first node: graph attributes, parameters, counts."""
        g = self.graph
        gname = format_name(g.name)
        lines = [f"# IR entry: @{gname}", "# Total subgraphs: 1", "", "# Attrs:"]
        _check_keys(g.attrs, f"graph {g.name}: attribute")
        out: list[str | _AttrsHole] = []
        head_attrs = [(k, v) for k, v in g.attrs.items()]
        if any(isinstance(v, RankValue) for _, v in head_attrs):
            out.append("\n".join(lines) + "\n")
            out.append(_AttrsHole(head_attrs))
            lines = []
        else:
            for key, value in head_attrs:
                lines.append(f"{format_string(key)}: {format_value(value)}")
        lines += ["", f"# Total params: {len(g.params)}", "# Params:"]
        for i, param in enumerate(g.params):
            lines.append(f"{param_ref(i, param)}: {format_param_type(param)}")
        lines += [
            "",
            "Node counting information:",
            f"Total number of nodes: {len(g.params) + len(g.nodes) + 1}",
            f"Total number of cnodes: {len(g.nodes) + 1}",
            "",
            f"subgraph @{gname}() {{",
        ]
        out.append("\n".join(lines) + "\n")
        return out

    def node_segment(self, index: int, node: Node) -> str | _Hole:
        """A node's lines, or a `_Hole` when they differ between ranks."""
        if _rank_dependent(node):
            return _Hole(self, index, node)
        return "\n".join(self.node(index, node)) + "\n"

    def tail(self) -> str:
        g = self.graph
        outputs = ", ".join(self.operand(v, "Return") for v in g.outputs)
        out_types = ", ".join(self.operand_type(v) for v in g.outputs)
        return "\n".join([
            f"{NODE_INDENT}Return({outputs})",
            f"{DETAIL_INDENT}: ({out_types})",
            f"{DETAIL_INDENT}# scope: ({RETURN_SCOPE})",
            "}",
        ]) + "\n"


class _AttrsHole:
    """The graph attributes, when one of them depends on the rank."""

    def __init__(self, attrs: list[tuple[str, Any]]) -> None:
        self.attrs = attrs

    def render(self, rank: int) -> str:
        return "".join(f"{format_string(k)}: {format_value(resolve(v, rank))}\n"
                       for k, v in self.attrs)


def _rank_dependent(node: Node) -> bool:
    return has_rank_values(node.attrs) or any(isinstance(v, RankConstant)
                                              for v in node.operands)


class GraphText:
    """The text of a graph for any rank, printed once: the parts that do not depend on the rank
    are kept as text, the rest is rendered per rank (printing N ranks costs about one print
    plus the rank-dependent nodes N times).

    `previous`: the text of the same graph before a pass that only appended nodes (and
    parameters) to it; the nodes it printed, unchanged and at the same positions, are not
    printed again."""

    graph: Graph

    def __init__(self, graph: Graph, previous: GraphText | None = None) -> None:
        printer = _Printer(graph)
        self.nodes = list(graph.nodes)
        reuse = previous is not None and previous.graph is graph
        old = previous.nodes if reuse and previous is not None else []
        self.node_segments: list[str | _Hole] = []
        for i, node in enumerate(self.nodes):
            if i < len(old) and old[i] is node:
                assert previous is not None
                self.node_segments.append(previous.node_segments[i])
            else:
                self.node_segments.append(printer.node_segment(i, node))
        self.graph = graph
        self.head = printer.head()
        self.tail = printer.tail()
        self.rank_dependent = any(not isinstance(s, str)
                                  for s in (*self.head, *self.node_segments))

    def render(self, rank: int | None = None) -> str:
        if rank is None:
            if self.rank_dependent:
                raise ValueError("this graph differs between ranks: print_graph(graph, rank)")
            # not rank-dependent: every segment is a str, which mypy cannot see
            return "".join([*self.head, *self.node_segments, self.tail])  # type: ignore[list-item]
        return "".join(s if isinstance(s, str) else s.render(rank)
                       for s in (*self.head, *self.node_segments, self.tail))


def print_graph(graph: Graph, rank: int | None = None) -> str:
    """The graph as IR text (a rank-parametric graph: `rank`'s view of it). Deterministic: the
    same graph always gives the same bytes.

    Raises ValueError when an operand or output is not a constant, a parameter of `graph` or
    the result of one of its nodes (such a value has no name in the text), and TypeError for
    attribute values outside the value grammar."""
    return GraphText(graph).render(rank)
