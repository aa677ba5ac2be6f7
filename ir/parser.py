"""The IR text parser: `parse_graph(text, filename) -> Graph`, the inverse of `ir.printer`.

A hand-written recursive-descent parser over the lines of the file, following the grammar in
`ir.printer` (and `docs/ir-reference.md`) production by production. It is strict about
spacing, so that `print_graph(parse_graph(text)) == text` for everything the printer writes.

Nodes are rebuilt directly as `ir.core.Node`s and appended with `Graph.append`, so their
fullnames are regenerated. A node's result type comes from its type line and is checked
against the op's inference rule; the operand types written on the type line are checked against
the operands. Every problem raises `ParseError` with a `file:line:column: expected X, got Y`
message.

The text may come from anywhere, so the parser is bounded by design: the file's size
(`MAX_TEXT_CHARS`), nesting of attribute values (`MAX_DEPTH`), a number's length
(`MAX_NUMBER_CHARS`: Python's `int()` refuses thousands of digits), a shape's rank, dimensions
and element count (`MAX_RANK`, `MAX_DIMENSION`, `MAX_ELEMENTS`), and the elements a constant
allocates (`MAX_CONSTANT_ELEMENTS`: a one-number splat constant would otherwise allocate
whatever shape it declares). Each bound is a `ParseError` naming it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from pcompile.ir.core import (
    Constant,
    Graph,
    GraphParam,
    Node,
    OpaqueConstant,
    ParallelInfo,
    SourceLoc,
    Value,
)
from pcompile.ir.errors import PcompileError, ShapeError
from pcompile.ir.parallel_info import FIELD_READERS as PARALLEL_FIELDS
from pcompile.ir.printer import (
    BARE_NAME,
    BARE_STRING,
    BARE_WORD,
    DETAIL_INDENT,
    DTYPE_NAMES,
    HINT,
    NODE_INDENT,
    RETURN_SCOPE,
    format_name,
)
from pcompile.ir.registry import OpDef, get_op
from pcompile.ir.types import DType, TensorType, TupleType, ValueType


class ParseError(PcompileError):
    """Malformed IR text; the message reads `file:line:column: expected X, got Y`."""

    def __init__(self, filename: str, line: int, column: int, message: str) -> None:
        super().__init__(f"{filename}:{line}:{column}: {message}")
        self.filename = filename
        self.line = line
        self.column = column
        self.message = message


MAX_TEXT_CHARS = 1 << 29  # a dump of 512 MiB; real ones are a few MB at most
MAX_DEPTH = 64  # nesting of tuples, lists and dicts in attribute values
MAX_NUMBER_CHARS = 40  # int64 has 19 digits, a float's repr at most 24 characters
MAX_RANK = 32  # numpy's limit was 32 dimensions until 2.0
MAX_DIMENSION = 1 << 48
MAX_ELEMENTS = 1 << 62  # of a shape in a type (products stay inside int64)
MAX_CONSTANT_ELEMENTS = 1 << 24  # what a constant may allocate (64 MiB of float32)

_INT = re.compile(r"-?[0-9]+")
_UINT = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"-?(?:inf|[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)")
_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DTYPE_WORD = re.compile(r"[A-Za-z0-9]+")
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|%?[A-Za-z0-9_.\-]+|\s+|.')


def _show(text: str) -> str:
    return repr(text)


STRATEGY_KEYS = ("in_strategy", "out_strategy")  # printed as MindSpore prints them
_DIGEST = re.compile(r"[0-9a-f]{16}")
# MS_DEV_DUMP_IR_PARALLEL_DETAIL keys (ir.printer.DETAIL_KEYS): MindSpore's tuple spelling, and
# single-quoted keys in the layout dicts of LAYOUT_KEYS
DETAIL_KEYS = ("inputs_tensor_map", "outputs_tensor_map", "device_matrix", "in_layout",
               "out_layout")
LAYOUT_KEYS = ("in_layout", "out_layout")
_QUOTED_KEY = re.compile(r"'([A-Za-z_][A-Za-z0-9_]*)'")


class _Line:
    """A cursor over one line of the file; all lexing happens here."""

    def __init__(self, filename: str, lineno: int, text: str) -> None:
        self.filename = filename
        self.lineno = lineno
        self.text = text
        self.pos = 0
        self.depth = 0
        self._strategy_syntax = False
        self._quoted_keys = False

    # -- errors -------------------------------------------------------------------------------
    def got(self, pos: int | None = None) -> str:
        pos = self.pos if pos is None else pos
        if pos >= len(self.text):
            return "end of line"
        match = _TOKEN.match(self.text, pos)
        assert match is not None
        return _show(match.group())

    def fail(self, message: str, pos: int | None = None) -> NoReturn:
        column = (self.pos if pos is None else pos) + 1
        raise ParseError(self.filename, self.lineno, column, message)

    def expected(self, what: str, pos: int | None = None, got: str | None = None) -> NoReturn:
        self.fail(f"expected {what}, got {self.got(pos) if got is None else got}", pos)

    # -- lexing -------------------------------------------------------------------------------
    def peek(self, literal: str) -> bool:
        return self.text.startswith(literal, self.pos)

    def accept(self, literal: str) -> bool:
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def expect(self, literal: str, what: str | None = None) -> None:
        if not self.accept(literal):
            self.expected(what or _show(literal))

    def separator(self, close: str) -> None:
        """The `, ` between list items, where `close` could also have come."""
        if not self.accept(", "):
            self.expected(f"', ' or {_show(close)}")

    def match(self, pattern: re.Pattern[str], what: str) -> str:
        found = pattern.match(self.text, self.pos)
        if found is None or not found.group():
            self.expected(what)
        self.pos = found.end()
        return found.group()

    def number_text(self, pattern: re.Pattern[str], what: str) -> str:
        """A number's text, at most MAX_NUMBER_CHARS long."""
        start = self.pos
        text = self.match(pattern, what)
        if len(text) > MAX_NUMBER_CHARS:
            self.expected(f"{what} of at most {MAX_NUMBER_CHARS} characters", start,
                          f"{len(text)} digits")
        return text

    def integer(self, what: str = "an integer", signed: bool = False) -> int:
        return int(self.number_text(_INT if signed else _UINT, what))

    def dimensions(self, close: str, what: str) -> tuple[int, ...]:
        """Dimensions separated by ', ' (the opening bracket consumed), up to `close`, within
        the rank, dimension and element bounds."""
        start = self.pos
        dims: list[int] = []
        while not self.accept(close):
            if dims:
                self.separator(close)
            if len(dims) == MAX_RANK:
                self.expected(f"{what} of rank at most {MAX_RANK}", start)
            pos = self.pos
            dims.append(self.integer("a dimension"))
            if dims[-1] > MAX_DIMENSION:
                self.expected(f"a dimension of at most {MAX_DIMENSION}", pos, str(dims[-1]))
        if math.prod(dims) > MAX_ELEMENTS:
            self.expected(f"{what} of at most {MAX_ELEMENTS} elements", start,
                          str(math.prod(dims)))
        return tuple(dims)

    def json_string(self) -> str:
        """A JSON string literal starting at the cursor."""
        start = self.pos
        if not self.peek('"'):
            self.expected("a string")
        i = start + 1
        while i < len(self.text) and self.text[i] != '"':
            i += 2 if self.text[i] == "\\" else 1
        if i >= len(self.text):
            self.fail("expected a closing '\"' of the string, got end of line", start)
        try:
            value = json.loads(self.text[start : i + 1])
        except json.JSONDecodeError as exc:
            self.fail(f"expected a valid JSON string, got {exc.msg.lower()}", start)
        self.pos = i + 1
        assert isinstance(value, str)
        return value

    def name_or_string(self, bare: re.Pattern[str], what: str) -> str:
        if self.peek('"'):
            return self.json_string()
        return self.match(bare, what)

    def end(self) -> None:
        if self.pos != len(self.text):
            self.expected("end of line")

    # -- values -------------------------------------------------------------------------------
    def value(self) -> Any:
        """One attribute value (see the value grammar in ir.printer)."""
        if self.peek("("):
            return tuple(self._sequence("(", ")", tuple_syntax=True))
        if self.peek("["):
            return self._sequence("[", "]", tuple_syntax=False)
        if self.peek("{"):
            return self.dict_value()
        if self.peek('"'):
            return self.json_string()
        if self.peek("-") or (self.pos < len(self.text) and self.text[self.pos].isdigit()):
            return self._number()
        found = BARE_STRING.match(self.text, self.pos)
        if found is None:
            self.expected("a value")
        self.pos = found.end()
        word = found.group()
        keywords: dict[str, Any] = {
            "true": True,
            "false": False,
            "None": None,
            "inf": float("inf"),
            "nan": float("nan"),
        }
        if word in keywords:
            return keywords[word]
        return DTYPE_NAMES.get(word, word)

    def _number(self) -> int | float:
        text = self.number_text(_NUMBER, "a number")
        if any(c in text for c in ".eEn"):
            return float(text)
        return int(text)

    def nest(self) -> None:
        """Enter one level of nesting (MAX_DEPTH at most)."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.fail(f"expected a value nested at most {MAX_DEPTH} deep, got one nested deeper "
                      f"than {MAX_DEPTH}")

    def _sequence(self, open_: str, close: str, *, tuple_syntax: bool) -> list[Any]:
        self.nest()
        try:
            return self._items(open_, close, tuple_syntax=tuple_syntax)
        finally:
            self.depth -= 1

    def _items(self, open_: str, close: str, *, tuple_syntax: bool) -> list[Any]:
        self.expect(open_)
        items: list[Any] = []
        if self.accept(close):
            return items
        items.append(self.value())
        if tuple_syntax and self.accept(",)"):
            return items
        while not self.accept(close):
            self.separator(close)
            items.append(self.value())
        if tuple_syntax and len(items) == 1 and not self._strategy_syntax:
            self.expected("',)' (a 1-tuple)", self.pos - 1)
        return items

    def dict_value(self, str_keys: bool = False, strategy_keys: tuple[str, ...] = (),
                   key_positions: dict[Any, int] | None = None) -> dict[Any, Any]:
        """`{key: value, ...}`; the values of `strategy_keys` use the strategy spelling
        (`((2, 4))`: a one-element tuple needs no trailing comma, as MindSpore prints it).
        `key_positions`, when given, receives where each key starts."""
        self.nest()
        try:
            return self._dict_items(str_keys, strategy_keys, key_positions)
        finally:
            self.depth -= 1

    def _dict_items(self, str_keys: bool, strategy_keys: tuple[str, ...],
                    key_positions: dict[Any, int] | None = None) -> dict[Any, Any]:
        self.expect("{")
        out: dict[Any, Any] = {}
        if self.accept("}"):
            return out
        while True:
            key_pos = self.pos
            if self._quoted_keys and self.peek("'"):
                key = self.match(_QUOTED_KEY, "a quoted key")[1:-1]
            else:
                key = self.value()
            if str_keys and not isinstance(key, str):
                self.expected("a string key", key_pos)
            try:
                duplicate = key in out
            except TypeError:
                self.expected("a hashable key", key_pos)
            if duplicate:
                self.fail(f"duplicate key {key!r}", key_pos)
            if key_positions is not None:
                key_positions[key] = key_pos
            self.expect(": ")
            if key in strategy_keys:
                self._strategy_syntax = True
                self._quoted_keys = key in LAYOUT_KEYS
                try:
                    out[key] = self.value()
                finally:
                    self._strategy_syntax = False
                    self._quoted_keys = False
            else:
                out[key] = self.value()
            if self.accept("}"):
                return out
            self.separator("}")

    # -- types --------------------------------------------------------------------------------
    def dtype(self) -> DType:
        start = self.pos
        word = self.match(_DTYPE_WORD, "a dtype")
        if word not in DTYPE_NAMES:
            self.expected(f"a dtype ({', '.join(DTYPE_NAMES)})", start)
        return DTYPE_NAMES[word]

    def shape(self) -> tuple[int, ...]:
        """`()`, `(8,)` or `(16, 32)`."""
        self.expect("(", "a shape")
        if self.accept(")"):
            return ()
        pos = self.pos
        first = self.integer("a dimension")
        if self.accept(",)"):
            if first > MAX_DIMENSION:
                self.expected(f"a dimension of at most {MAX_DIMENSION}", pos, str(first))
            return (first,)
        self.separator(",)")  # one dimension is spelt `(8,)`
        self.pos = pos
        return self.dimensions(")", "a shape")

    def value_type(self) -> ValueType:
        """`<Tensor[D], shape>` or `<Tuple[...], TupleShape(shape, ...)>`."""
        if self.accept("<Tensor["):
            dtype = self.dtype()
            self.expect("], ")
            shape = self.shape()
            self.expect(">")
            return TensorType(dtype, shape)
        if not self.accept("<Tuple["):
            self.expected("a type ('<Tensor[...' or '<Tuple[...')")
        dtypes: list[DType] = []
        count: int | None = None
        if not self.peek("]"):
            self.expect("Tensor[")
            dtypes.append(self.dtype())
            self.expect("]")
            if self.accept("*"):
                count = self.integer("an element count")
            while count is None and self.accept(","):
                self.expect("Tensor[")
                dtypes.append(self.dtype())
                self.expect("]")
        self.expect("], TupleShape(")
        shapes_pos = self.pos
        shapes: list[tuple[int, ...]] = []
        if not self.accept(")"):
            shapes.append(self.shape())
            while not self.accept(")"):
                self.separator(")")
                shapes.append(self.shape())
        self.expect(">")
        want = len(dtypes) if count is None else count
        if want != len(shapes):  # before `dtypes * count`, which would allocate `count`
            self.expected(f"{want} element shape(s)", shapes_pos, str(len(shapes)))
        if count is not None:
            dtypes = dtypes * count
        return TupleType(tuple(TensorType(d, s) for d, s in zip(dtypes, shapes)))

    def type_list(self, close: str) -> tuple[list[tuple[int, ValueType]], int]:
        """Comma-separated types up to `close`, each with its position, and the position of
        `close`."""
        out: list[tuple[int, ValueType]] = []
        while True:
            if self.peek(close):
                self.pos += len(close)
                return out, self.pos - len(close)
            if out:
                self.separator(close)
            out.append((self.pos, self.value_type()))

    # -- constants ----------------------------------------------------------------------------
    def element(self, dtype: DType) -> Any:
        start = self.pos
        if dtype is DType.bool_:
            if self.accept("true"):
                return True
            if self.accept("false"):
                return False
            self.expected("true or false")
        if dtype.is_float:
            if self.accept("nan"):
                return float("nan")
            return float(self.number_text(_NUMBER, f"a {dtype.value} number"))
        value = int(self.number_text(_INT, f"an {dtype.value} integer"))
        info = np.iinfo(dtype.np)
        if not info.min <= value <= info.max:
            self.expected(f"an {dtype.value} integer", start, str(value))
        return value

    def nested(self, dtype: DType, shape: tuple[int, ...], out: list[Any]) -> None:
        """A nested list of exactly `shape`, appending its elements in row-major order."""
        if not shape:
            out.append(self.element(dtype))
            return
        self.expect("[")
        for i in range(shape[0]):
            if i and not self.accept(", "):
                self.expected(f"', ' (the dimension has {shape[0]} entries)")
            self.nested(dtype, shape[1:], out)
        if not self.accept("]"):
            self.expected(f"']' (the dimension has {shape[0]} entries)")

    def constant(self) -> Constant:
        """`Tensor(shape=[...], dtype=D, value=V)` (the `Tensor(` is already consumed)."""
        self.expect("shape=[")
        start = self.pos
        shape = self.dimensions("]", "a constant's shape")
        if math.prod(shape) > MAX_CONSTANT_ELEMENTS:
            self.expected(f"a constant of at most {MAX_CONSTANT_ELEMENTS} elements", start,
                          f"shape {list(shape)} ({math.prod(shape)} elements)")
        self.expect(", dtype=")
        dtype = self.dtype()
        self.expect(", value=")
        if self.accept("@"):  # a large constant printed by its digest: no data
            digest = self.match(_DIGEST, "a 16-digit hex digest")
            self.expect(")")
            return OpaqueConstant(TensorType(dtype, tuple(shape)), digest)
        values: list[Any] = []
        if self.peek("[") and shape:
            self.nested(dtype, shape, values)
            array = np.asarray(values, dtype=dtype.np).reshape(shape)
        else:
            values.append(self.element(dtype))
            array = np.full(shape, values[0], dtype=dtype.np)
        self.expect(")")
        return Constant(array, dtype)


class _Parser:
    def __init__(self, text: str, filename: str) -> None:
        self.filename = filename
        if len(text) > MAX_TEXT_CHARS:
            raise ParseError(filename, 1, 1, f"expected a dump of at most {MAX_TEXT_CHARS} "
                             f"characters, got {len(text)}")
        self.lines = text.split("\n")
        if self.lines and self.lines[-1] == "":
            self.lines.pop()
        self.index = 0
        self.graph = Graph("")

    # -- lines --------------------------------------------------------------------------------
    def next_line(self, what: str) -> _Line:
        if self.index >= len(self.lines):
            raise ParseError(self.filename, self.index + 1, 1, f"expected {what}, got end of file")
        line = _Line(self.filename, self.index + 1, self.lines[self.index])
        self.index += 1
        return line

    def peek_line(self) -> str | None:
        return self.lines[self.index] if self.index < len(self.lines) else None

    def fixed(self, text: str) -> None:
        line = self.next_line(_show(text))
        line.expect(text)
        line.end()

    def blank(self) -> None:
        line = self.next_line("an empty line")
        if line.text:
            line.expected("an empty line")

    # -- sections -----------------------------------------------------------------------------
    def header(self) -> None:
        line = self.next_line("'# IR entry: @<graph name>'")
        line.expect("# IR entry: @")
        self.graph.name = line.name_or_string(BARE_NAME, "a graph name")
        line.end()
        line = self.next_line("'# Total subgraphs: 1'")
        line.expect("# Total subgraphs: ")
        start = line.pos
        if line.integer() != 1:
            line.expected("1 (files hold exactly one graph)", start)
        line.end()
        self.blank()

    def attrs(self) -> None:
        self.fixed("# Attrs:")
        while (text := self.peek_line()) is not None and text:
            line = self.next_line("an attribute")
            key = self._key(line)
            if key in self.graph.attrs:
                line.fail(f"duplicate graph attribute {key!r}", 0)
            line.expect(": ")
            self.graph.attrs[key] = line.value()
            line.end()
        self.blank()

    def _key(self, line: _Line) -> str:
        start = line.pos
        key = line.value()
        if not isinstance(key, str):
            line.expected("an attribute name", start)
        return key

    def params(self) -> None:
        count_line, count_pos, count = self.count_line("# Total params: ")
        self.fixed("# Params:")
        while (text := self.peek_line()) is not None and text:
            self.param(self.next_line("a parameter"))
        if len(self.graph.params) != count:
            count_line.expected(
                f"{len(self.graph.params)} (the number of parameters listed)",
                count_pos,
                str(count),
            )
        self.blank()

    def param(self, line: _Line) -> None:
        k = len(self.graph.params) + 1
        line.expect("%para", f"'%para{k}_<name>'")
        start = line.pos
        if line.integer() != k:
            line.expected(f"parameter number {k}", start)
        line.expect("_")
        name_pos = line.pos
        name = line.name_or_string(BARE_NAME, "a parameter name")
        line.expect(": ")
        kind = "input"
        if line.accept("<Ref[Tensor["):
            dtype = line.dtype()
            line.expect("]], ")
            shape = line.shape()
            line.expect(", ref_key=")
            key_pos = line.pos
            if line.name_or_string(BARE_NAME, "a parameter name") != name:
                line.expected(f"ref_key={name}", key_pos)
            line.expect(", ")
            if line.accept("is_parameter"):
                kind, requires_grad = "weight", not line.accept(", no_grad")
            else:
                line.expect("is_state", "'is_parameter' or 'is_state'")
                kind, requires_grad = "state", line.accept(", requires_grad")
            line.expect(">  :  has_default")
            ttype = TensorType(dtype, shape)
        else:
            type_pos = line.pos
            found = line.value_type()
            if not isinstance(found, TensorType):
                line.expected("a tensor type for a graph parameter", type_pos, "a tuple type")
            ttype = found
            requires_grad = line.accept("  :  requires_grad")
        line.end()
        try:
            self.graph.add_param(GraphParam(ttype, name, kind, requires_grad))
        except ValueError:
            line.fail(f"duplicate parameter name {name!r}", name_pos)

    def count_line(self, prefix: str) -> tuple[_Line, int, int]:
        """`<prefix><n>`: the line, the column of n, and n."""
        line = self.next_line(_show(prefix + "<n>"))
        line.expect(prefix)
        pos = line.pos
        count = line.integer()
        line.end()
        return line, pos, count

    # -- body ---------------------------------------------------------------------------------
    def operand(self, line: _Line) -> Value:
        start = line.pos
        if line.accept("%para"):
            k = line.integer("a parameter number")
            line.expect("_")
            name = line.name_or_string(BARE_NAME, "a parameter name")
            params = self.graph.params
            if not 1 <= k <= len(params):
                line.expected(f"a parameter %para1..%para{len(params)}", start, _show(f"%para{k}"))
            param = params[k - 1]
            if param.name != name:
                line.expected(
                    f"%para{k}_{format_name(param.name)}", start, _show(line.text[start : line.pos])
                )
            return param
        if line.accept("%"):
            n = line.integer("a node number")
            if n >= len(self.graph.nodes):
                defined = f"%0..%{len(self.graph.nodes) - 1}" if self.graph.nodes else "none yet"
                line.expected(f"a node defined above ({defined})", start, _show(f"%{n}"))
            return self.graph.nodes[n].result
        if line.accept("Tensor("):
            return line.constant()
        line.expected("an operand (%<n>, %para<k>_<name> or Tensor(...))")

    def operands(self, line: _Line) -> list[tuple[int, Value]]:
        out: list[tuple[int, Value]] = []
        if line.accept(")"):
            return out
        while True:
            pos = line.pos
            out.append((pos, self.operand(line)))
            if line.accept(")"):
                return out
            line.expect(", ", "', ' or ')'")

    def check_types(
        self,
        line: _Line,
        operands: list[tuple[int, Value]],
        types: list[tuple[int, ValueType]],
        close_pos: int,
    ) -> None:
        """The types written on a type line must be those of the operands."""
        if len(types) != len(operands):
            pos = types[len(operands)][0] if len(types) > len(operands) else close_pos
            line.expected(f"{len(operands)} operand type(s)", pos, f"{len(types)}")
        for (_, value), (pos, type_) in zip(operands, types):
            if type_ != value.type:
                line.expected(f"the operand's type {value.type}", pos, str(type_))

    def scope_line(self) -> str:
        line = self.next_line("'      # scope: (...)'")
        line.expect(DETAIL_INDENT + "# scope: (")
        if line.peek('"'):
            scope = line.json_string()
            line.expect(")")
            line.end()
            return scope
        if not line.text.endswith(")"):
            line.expected("')' at the end of the line", len(line.text), "end of line")
        return line.text[line.pos : -1]

    def source_line(self) -> SourceLoc | None:
        text = self.peek_line()
        if text is None or not text.startswith(DETAIL_INDENT + "# In file "):
            return None
        line = self.next_line("a source line")
        line.expect(DETAIL_INDENT + "# In file ")
        if line.peek('"'):
            file = line.json_string()
        else:
            colon = line.text.find(":", line.pos)
            if colon < 0:
                line.expected("'<file>:<line>'", len(line.text), "end of line")
            file = line.text[line.pos : colon]
            line.pos = colon
        line.expect(":")
        lineno = line.integer("a line number", signed=True)
        if line.accept(" "):
            src = line.json_string()
            line.end()
        else:
            line.expect("/", "'/' or ' \"'")
            if not line.text.endswith("/") or len(line.text) == line.pos:
                line.expected("'/' at the end of the line", len(line.text), "end of line")
            src = line.text[line.pos : -1]
        return SourceLoc(file, lineno, src)

    def node(self, line: _Line) -> None:
        g = self.graph
        line.expect(NODE_INDENT + "%", "'  %<n>(' or '  Return('")
        start = line.pos
        if line.integer("a node number") != len(g.nodes):
            line.expected(f"%{len(g.nodes)} (nodes are numbered in order)", start - 1)
        line.expect("(")
        hint = line.match(HINT, "a name hint")
        line.expect(") = ")
        op_pos = line.pos
        op = line.match(_OP_NAME, "an op name")
        try:
            opdef = get_op(op)
        except KeyError:
            line.expected("a registered op", op_pos)
        line.expect("(")
        operands = self.operands(line)
        instance_name = ""
        if line.accept(" {instance name: "):
            instance_name = line.name_or_string(BARE_WORD, "an instance name")
            line.expect("}")
        line.expect(" primitive_attrs: ", "' {instance name: ' or ' primitive_attrs: '")
        attrs: dict[str, Any] = line.dict_value(str_keys=True,
                                                strategy_keys=STRATEGY_KEYS + DETAIL_KEYS)
        parallel: ParallelInfo | None = None
        if line.accept(" "):
            parallel = self.parallel(line)
        line.end()

        type_line = self.next_line("the type line '      : (...) -> (...)'")
        type_line.expect(DETAIL_INDENT + ": (")
        in_types, close_pos = type_line.type_list(")")
        type_line.expect(" -> (")
        out_pos = type_line.pos
        result_type = type_line.value_type()
        type_line.expect(")")
        type_line.end()
        self.check_types(type_line, operands, in_types, close_pos)

        for key, default in opdef.attrs.items():
            attrs.setdefault(key, default)
        values = [v for _, v in operands]
        inferred = self.infer(line, op_pos, opdef, values, attrs)
        if inferred != result_type:
            type_line.expected(
                f"the result type {inferred} that {op} infers", out_pos, str(result_type)
            )
        scope = self.scope_line()
        source = self.source_line()
        node = Node(
            op,
            values,
            attrs,
            result_type,
            instance_name=instance_name,
            scope=scope,
            source=source,
            name_hint=hint,
            parallel=parallel,
        )
        g.append(node)

    def parallel(self, line: _Line) -> ParallelInfo:
        """The parallel-info group: each field read by its entry in `PARALLEL_FIELDS` and set
        in the order of the text (which is the order it prints in)."""
        info = ParallelInfo()
        positions: dict[str, int] = {}
        group = line.dict_value(str_keys=True, strategy_keys=STRATEGY_KEYS + DETAIL_KEYS,
                                key_positions=positions)
        for key, value in group.items():
            read = PARALLEL_FIELDS.get(key)
            if read is None:
                line.expected(f"a parallel annotation ({', '.join(ParallelInfo.FIELDS)})",
                              positions[key])
            try:
                setattr(info, key, read(value))
            except (TypeError, ValueError) as exc:
                line.fail(f"expected {exc} as the value of {key}", positions[key])
        if [k for k, _ in info.items()] != list(group):
            line.fail(f"expected the parallel annotations in the order "
                      f"{', '.join(k for k, _ in info.items())}", positions[next(iter(group))])
        return info

    def infer(
        self, line: _Line, pos: int, opdef: OpDef, operands: list[Value], attrs: dict[str, Any]
    ) -> ValueType:
        impl: Callable[[dict[str, Any]], dict[str, Any]] | None = getattr(opdef, "impl_attrs", None)
        declared = impl(attrs) if impl else {k: v for k, v in attrs.items() if k in opdef.attrs}
        try:
            opdef.check_arity(len(operands))
            return opdef.infer_type([v.type for v in operands], declared)
        except ShapeError as exc:
            line.fail(f"{opdef.name} rejects its operands: {exc}", pos)
        except Exception as exc:  # noqa: BLE001  (untrusted text reaches the op's rule)
            line.fail(f"{opdef.name} rejects its operands or attributes: {exc!r}", pos)

    def body(self) -> None:
        line = self.next_line("'subgraph @<graph name>() {'")
        line.expect("subgraph @")
        start = line.pos
        name = line.name_or_string(BARE_NAME, "a graph name")
        if name != self.graph.name:
            line.expected(
                f"the entry graph @{format_name(self.graph.name)}", start, _show(format_name(name))
            )
        line.expect("() {")
        line.end()
        while True:
            line = self.next_line("a node or '  Return(...)'")
            if line.accept(NODE_INDENT + "Return("):
                self.return_(line)
                break
            self.node(line)
        self.fixed("}")
        while self.index < len(self.lines):
            self.blank()

    def return_(self, line: _Line) -> None:
        operands = self.operands(line)
        line.end()
        type_line = self.next_line("the type line '      : (...)'")
        type_line.expect(DETAIL_INDENT + ": (")
        types, close_pos = type_line.type_list(")")
        type_line.end()
        self.check_types(type_line, operands, types, close_pos)
        self.fixed(f"{DETAIL_INDENT}# scope: ({RETURN_SCOPE})")
        self.graph.outputs = [v for _, v in operands]

    def run(self) -> Graph:
        self.header()
        self.attrs()
        self.params()
        self.fixed("Node counting information:")
        nodes_line, nodes_pos, nodes = self.count_line("Total number of nodes: ")
        cnodes_line, cnodes_pos, cnodes = self.count_line("Total number of cnodes: ")
        self.blank()
        self.body()
        g = self.graph
        want = len(g.params) + len(g.nodes) + 1
        if nodes != want:
            nodes_line.expected(f"{want} (parameters + nodes + 1)", nodes_pos, str(nodes))
        if cnodes != len(g.nodes) + 1:
            cnodes_line.expected(f"{len(g.nodes) + 1} (nodes + 1)", cnodes_pos, str(cnodes))
        return g


def parse_graph(text: str, filename: str = "<string>") -> Graph:
    """Parse IR text written by `ir.printer.print_graph` back into a `Graph`.

    Raises `ParseError` (a `PcompileError`) naming `filename:line:column` on malformed text,
    unknown ops, undefined operands, and type lines that disagree with the operands or with
    the op's inference rule."""
    return _Parser(text, filename).run()
