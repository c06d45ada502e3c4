"""Constraints as grammars: the one place that turns a `Constraint` into llguidance's grammar
text, used by the gateway to validate (no tokenizer needed) and by the worker to compile.

llguidance (guidance-ai/llguidance) is the engine: a lazy Earley parser with a regex lexer
that fills a token bitmask per step. It needs no ahead-of-time compilation per grammar, and it
bounds its own work (grammar size, lexer states, per-step fuel): a pathological schema or regex
is refused with a message, it never hangs a process. It imports no torch.

JSON comes out in `json.dumps`'s layout (", " and ": ", no other whitespace) unless a request
names its own whitespace pattern: a small or untrained model given free whitespace at
temperature 1 spends its tokens on it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from llguidance import LLMatcher, LLTokenizer, gbnf_to_lark

from shared.messages import Constraint, ConstraintKind

# json.dumps's separators; oneOf read as anyOf (what every engine does; exact oneOf is rarely
# meant); unknown keywords are refused rather than ignored (a constraint silently weakened
# would return output the client's validator then rejects)
JSON_OPTIONS: dict[str, Any] = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
    "coerce_one_of": True,
}
ANY_OBJECT_SCHEMA = '{"type": "object"}'  # OpenAI's json_object: any JSON object


class GrammarError(ValueError):
    """The constraint cannot be turned into a grammar; the message says why."""


def make_constraint(kind: ConstraintKind, spec: str) -> Constraint:
    """A constraint with its cache key (sha256 of kind and spec)."""
    digest = hashlib.sha256(f"{kind.value}\0{spec}".encode()).hexdigest()
    return Constraint(kind=kind, spec=spec, key=digest)


def json_schema_constraint(schema: Any, whitespace_pattern: str | None = None) -> Constraint:
    """A JSON-schema constraint from a schema given as an object (or JSON text). Raises
    GrammarError for text that is not JSON and for a schema that is not an object or boolean."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise GrammarError(f"the schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict | bool):
        raise GrammarError("a JSON schema must be an object")
    spec: dict[str, Any] = schema if isinstance(schema, dict) else {}
    if schema is False:
        raise GrammarError("the schema `false` matches nothing")
    if whitespace_pattern is not None:
        spec = {**spec, "x-guidance": {"whitespace_pattern": whitespace_pattern}}
    return make_constraint(ConstraintKind.JSON_SCHEMA, json.dumps(spec, ensure_ascii=False))


def choice_constraint(choices: Any) -> Constraint:
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise GrammarError("`choice` must be a non-empty list of non-empty strings")
    return make_constraint(ConstraintKind.CHOICE, json.dumps(choices, ensure_ascii=False))


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for the constraint. Raises GrammarError when it cannot be built
    (validity beyond that is `check`'s)."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == ConstraintKind.JSON_SCHEMA:
            schema = json.loads(spec)
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if kind == ConstraintKind.REGEX:
            if (len(spec) - len(spec.rstrip("\\"))) % 2:  # llguidance would drop it silently
                raise GrammarError("the regex ends with an incomplete escape (a lone backslash)")
            return LLMatcher.grammar_from_regex(spec)
        if kind == ConstraintKind.CHOICE:
            literals = " | ".join(json.dumps(choice) for choice in json.loads(spec))
            return LLMatcher.grammar_from_lark(f"start: {literals}")
        if kind == ConstraintKind.GRAMMAR:
            lark = gbnf_to_lark.gbnf_to_lark(spec) if "::=" in spec else spec
            return LLMatcher.grammar_from_lark(lark)
    except (ValueError, gbnf_to_lark.GbnfToLarkError) as exc:
        raise GrammarError(str(exc)) from exc
    raise GrammarError(f"unknown constraint kind {kind!r}")


def check(constraint: Constraint) -> str:
    """Why the constraint is unusable ("" when it is fine), without a tokenizer: what the
    gateway runs before a request is queued."""
    try:
        grammar = grammar_text(constraint)
    except GrammarError as exc:
        return str(exc)
    return first_line(LLMatcher.validate_grammar(grammar))


def first_line(message: str) -> str:
    """llguidance's messages can carry a caret diagram over several lines; clients get the
    first line (and the rest is kept when it names the position)."""
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())[:1000]


def load_tokenizer(folder: Path, vocab_size: int, eos_token_ids: list[int]) -> LLTokenizer:
    """The model's token table for matchers, from its tokenizer.json (the fast tokenizer's
    file, added tokens included); `vocab_size`: the logits' width. Up to a second for a
    large vocabulary: built once."""
    text = (folder / "tokenizer.json").read_text()
    return LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def compile_matcher(tokenizer: LLTokenizer, constraint: Constraint) -> LLMatcher:
    """A matcher in the constraint's start state. Raises GrammarError."""
    matcher = LLMatcher(tokenizer, grammar_text(constraint), log_level=0)
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    return matcher
