"""Names of a model's parameters in another checkpoint format (Hugging Face's) and in a model
file, both ways: `load_checkpoint(path, name_map=...)` renames a Hugging Face checkpoint's
tensors to the model's names (and stacks per-expert tensors into one parameter) without
reading them; `pcompile-merge DIR --names ...` writes merged tensors under Hugging Face's names.

A `NameMap` is a list of `NameRule`s, each a pair of name patterns in which `{i}`, `{e}` (any
`{word}`) stand for a number: `theirs` (e.g. Hugging Face's
`model.layers.{i}.self_attn.q_proj.weight`) and `ours` (the model file's
`model.layers.{i}.attention.wq.weight`). A rule may also say
* `stack="e"`: the tensors of `theirs` for e = 0, 1, ... are the slices, in order, of ours
  along its first dim (Mixtral's experts, one tensor each in Hugging Face's files, one
  stacked parameter in examples/mixtral.py);
* `transpose=True`: each of theirs is ours transposed (a 2-D [out, in] Linear weight against
  a [in, out] matmul operand).
`ties` name parameters that take another's value when the checkpoint lacks theirs (a model
with `tie_word_embeddings`: lm_head from the embedding table). Names no rule matches are left
as they are.

Built in (`NAME_MAPS`, by name): `"llama"` (Hugging Face `LlamaForCausalLM` <->
examples/llama.py) and `"mixtral"` (Hugging Face `MixtralForCausalLM` <-> examples/mixtral.py).
A model file of another family writes its own: `NameMap({theirs: ours, ...})`, or a JSON file
`{"rules": [{"theirs": ..., "ours": ..., "stack": ..., "transpose": ...}], "ties": {...}}` for
`pcompile-merge --names FILE.json`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcompile.ir.errors import PcompileError

_FIELD = re.compile(r"\{(\w+)\}")


class NameMapError(PcompileError):
    """A name map that cannot be built or applied (the message says why)."""


@dataclass(frozen=True)
class NameRule:
    """One parameter's names: `theirs` (the checkpoint format's) and `ours` (the model
    file's), patterns with `{word}` numbers; `stack`: the number of `theirs` that indexes the
    first dim of ours; `transpose`: each of theirs is ours (or its slice) transposed."""

    theirs: str
    ours: str
    stack: str | None = None
    transpose: bool = False

    def __post_init__(self) -> None:
        theirs, ours = set(_FIELD.findall(self.theirs)), set(_FIELD.findall(self.ours))
        if self.stack is not None and self.stack not in theirs:
            raise NameMapError(f"name map rule {self.theirs!r}: stack={self.stack!r} is not "
                               "one of its {numbers}")
        if theirs - {self.stack} != ours:
            raise NameMapError(f"name map rule {self.theirs!r} -> {self.ours!r}: both sides "
                               "must have the same {numbers} (but the stacked one)")

    def pattern(self, side: str) -> re.Pattern[str]:
        text = self.theirs if side == "theirs" else self.ours
        pieces = _FIELD.split(text)  # literal, field, literal, field, ...
        return re.compile("".join(re.escape(piece) if k % 2 == 0 else f"(?P<{piece}>\\d+)"
                                  for k, piece in enumerate(pieces)) + "$")


class NameMap:
    """The names of one model family in a checkpoint format and in a model file (module
    docstring). `rules`: NameRules, (theirs, ours) pairs, or a dict {theirs: ours}."""

    def __init__(self, rules: Iterable[NameRule | tuple[str, str]] | Mapping[str, str],
                 ties: Mapping[str, str] | None = None, name: str = "") -> None:
        items = rules.items() if isinstance(rules, Mapping) else rules
        self.rules = [r if isinstance(r, NameRule) else NameRule(*r) for r in items]
        self.ties = dict(ties or {})
        self.name = name or "name map"
        self._theirs = [(rule, rule.pattern("theirs")) for rule in self.rules]
        self._ours = [(rule, rule.pattern("ours")) for rule in self.rules]

    # -- a checkpoint's names -> the model's (loading) --------------------------------------
    def from_theirs(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """`params` ({name: value} under the checkpoint's names, e.g. `load_checkpoint`'s)
        under the model's names: renamed, stacked (`stack` rules: a PretrainedTensor per
        slice stays a reference, `serialization.StackedTensor`; arrays are stacked), tied;
        names no rule matches are kept as they are."""
        out: dict[str, Any] = {}
        stacks: dict[tuple[int, str], dict[int, Any]] = {}
        for name, value in params.items():
            for k, (rule, pattern) in enumerate(self._theirs):
                m = pattern.match(name)
                if m is None:
                    continue
                fields = m.groupdict()
                if rule.stack is None:
                    out[rule.ours.format(**fields)] = _transposed(value, rule)
                else:
                    at = int(fields.pop(rule.stack))
                    stacks.setdefault((k, rule.ours.format(**fields)), {})[at] = value
                break
            else:
                out.setdefault(name, value)
        for (k, ours), parts in sorted(stacks.items()):
            rule = self.rules[k]
            missing = sorted(set(range(max(parts) + 1)) - set(parts))
            if missing:
                raise NameMapError(f"{self.name}: {ours} stacks {rule.theirs} for "
                                   f"{rule.stack} = 0..{max(parts)}, but the checkpoint has no "
                                   f"{rule.stack} = {', '.join(map(str, missing))}")
            out[ours] = _stacked(ours, [parts[i] for i in range(len(parts))], rule)
        for target, source in self.ties.items():
            if target not in out and source in out:
                out[target] = out[source]
        return out

    # -- the model's names -> a checkpoint's (merging) --------------------------------------
    def their_shapes(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The checkpoint format's names and shapes of our tensor `name` of `shape` (several
        for a stacked one; itself when no rule matches). A name with a prefix (optimizer
        state: `moments.` + a weight's name) keeps the prefix."""
        found = self._match_ours(name)
        if found is None:
            return [(name, tuple(shape))]
        rule, prefix, fields = found
        part = tuple(shape[1:]) if rule.stack is not None else tuple(shape)
        if rule.transpose:
            part = part[::-1]
        if rule.stack is None:
            return [(prefix + rule.theirs.format(**fields), part)]
        return [(prefix + rule.theirs.format(**fields, **{rule.stack: e}), part)
                for e in range(shape[0])]

    def to_theirs(self, name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        """Our tensor `name` as the checkpoint format's tensors (their_shapes' order)."""
        found = self._match_ours(name)
        if found is None:
            yield name, array
            return
        rule, prefix, fields = found
        parts = ([array] if rule.stack is None else [array[e] for e in range(array.shape[0])])
        for e, part in enumerate(parts):
            fields_e = dict(fields, **({rule.stack: e} if rule.stack is not None else {}))
            yield (prefix + rule.theirs.format(**fields_e),
                   np.ascontiguousarray(part.T if rule.transpose else part))

    def _match_ours(self, name: str) -> tuple[NameRule, str, dict[str, str]] | None:
        starts = [0] + [i + 1 for i, c in enumerate(name) if c == "."]
        for start in starts:  # the whole name first, then without each leading prefix
            for rule, pattern in self._ours:
                m = pattern.match(name, start)
                if m is not None and m.start() == start:
                    return rule, name[:start], m.groupdict()
        return None

    # -- as data ----------------------------------------------------------------------------
    @staticmethod
    def from_json(text: str, name: str = "") -> NameMap:
        """`{"rules": [{"theirs", "ours", "stack"?, "transpose"?}, ...], "ties": {...}}`, or
        a plain `{theirs: ours}` object."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise NameMapError(f"{name or 'name map'}: not JSON ({exc})") from None
        if isinstance(data, dict) and "rules" in data:
            rules = data["rules"]
            if not isinstance(rules, list) or not all(
                    isinstance(r, dict) and {"theirs", "ours"} <= set(r) for r in rules):
                raise NameMapError(f"{name or 'name map'}: rules must be a list of objects "
                                   "with theirs and ours")
            return NameMap([NameRule(str(r["theirs"]), str(r["ours"]), r.get("stack"),
                                     bool(r.get("transpose", False))) for r in rules],
                           data.get("ties") or {}, name)
        if isinstance(data, dict) and all(isinstance(v, str) for v in data.values()):
            return NameMap(data, name=name)
        raise NameMapError(f"{name or 'name map'}: expected {{\"rules\": [...]}} or "
                           "{theirs: ours}")


def _transposed(value: Any, rule: NameRule) -> Any:
    if not rule.transpose:
        return value
    return _stacked(rule.ours, [value], rule, stack=False)


def _stacked(ours: str, parts: list[Any], rule: NameRule, stack: bool = True) -> Any:
    """One parameter of `parts` (stacked along a new first dim when `stack`, each transposed
    when the rule says so): a reference when they are load_checkpoint's Parameters."""
    from pcompile.compiler.frontend.initializer import InitializedData
    from pcompile.compiler.frontend.serialization import PretrainedTensor, StackedTensor
    from pcompile.compiler.frontend.tensor import Parameter, Tensor

    sources = [p.source.array if isinstance(p, Parameter) else None for p in parts]
    if all(isinstance(s, PretrainedTensor) for s in sources):
        tensor = StackedTensor(ours, sources, rule.transpose, stack)  # type: ignore[arg-type]
        return Parameter(InitializedData(None, tensor.shape, tensor.dtype, None, tensor),
                         name=ours)
    arrays = [p.asnumpy() if isinstance(p, Tensor) else np.asarray(p) for p in parts]
    arrays = [a.T if rule.transpose else a for a in arrays]
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise NameMapError(f"{ours}: the tensors stacked into it have different shapes "
                           f"{sorted(shapes)}")
    return np.stack(arrays) if stack else arrays[0]


def _llama_rules(prefix: str) -> list[NameRule]:
    """Hugging Face Llama's decoder layers and ends, as examples/llama.py (and mixtral.py,
    `prefix` ''): both store Linear weights as [out, in] and apply rotary embedding in the
    rotate-half convention (Hugging Face's conversion already permuted Meta's q/k rows), so
    every tensor is taken as it is; gate_proj is w1 (SiLU), up_proj w3, down_proj w2."""
    layer = "model.layers.{i}."
    ours = prefix + "layers.{i}."
    return [
        NameRule("model.embed_tokens.weight", prefix + "embedding_weight"),
        NameRule(layer + "input_layernorm.weight", ours + "attention_norm.weight"),
        NameRule(layer + "self_attn.q_proj.weight", ours + "attention.wq.weight"),
        NameRule(layer + "self_attn.k_proj.weight", ours + "attention.wk.weight"),
        NameRule(layer + "self_attn.v_proj.weight", ours + "attention.wv.weight"),
        NameRule(layer + "self_attn.o_proj.weight", ours + "attention.wo.weight"),
        NameRule(layer + "post_attention_layernorm.weight", ours + "ffn_norm.weight"),
        NameRule("model.norm.weight", prefix + "norm_out.weight"),
        NameRule("lm_head.weight", "lm_head.weight"),
    ]


#: Hugging Face LlamaForCausalLM <-> examples/llama.py; a checkpoint without lm_head.weight
#: (tie_word_embeddings) gives the LM head the embedding table
LLAMA = NameMap([
    *_llama_rules("model."),
    NameRule("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.feed_forward.w1.weight"),
    NameRule("model.layers.{i}.mlp.up_proj.weight", "model.layers.{i}.feed_forward.w3.weight"),
    NameRule("model.layers.{i}.mlp.down_proj.weight", "model.layers.{i}.feed_forward.w2.weight"),
], ties={"lm_head.weight": "model.embedding_weight"}, name="llama")

#: Hugging Face MixtralForCausalLM <-> examples/mixtral.py: the router is the gate's [experts,
#: hidden] weight as it is; each expert's w1, w3 ([ffn, hidden]) and w2 ([hidden, ffn]) are
#: one slice, transposed, of the stacked [experts, hidden, ffn] (w2: [experts, ffn, hidden])
#: parameters that the batched matmuls read
MIXTRAL = NameMap([
    *_llama_rules(""),
    NameRule("model.layers.{i}.block_sparse_moe.gate.weight",
             "layers.{i}.moe.router.dense.weight"),
    *(NameRule(f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{w}.weight",
               f"layers.{{i}}.moe.experts.{w}", stack="e", transpose=True)
      for w in ("w1", "w2", "w3")),
], ties={"lm_head.weight": "embedding_weight"}, name="mixtral")

NAME_MAPS: dict[str, NameMap] = {"llama": LLAMA, "mixtral": MIXTRAL}


def name_map(value: str | NameMap | Mapping[str, str]) -> NameMap:
    """A NameMap from a built-in's name ("llama", "mixtral"), a NameMap, or a dict
    {theirs: ours}."""
    if isinstance(value, NameMap):
        return value
    if isinstance(value, str):
        if value not in NAME_MAPS:
            raise NameMapError(f"name map {value!r}: the built-in ones are "
                               f"{', '.join(sorted(NAME_MAPS))} (or give a NameMap or a dict "
                               "{theirs: ours})")
        return NAME_MAPS[value]
    if isinstance(value, Mapping):
        return NameMap(value)
    raise NameMapError(f"name map: expected a name, a NameMap or a dict, got "
                       f"{type(value).__name__}")
