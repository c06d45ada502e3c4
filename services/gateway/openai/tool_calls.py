"""The model's text -> OpenAI tool calls, whole or as stream deltas.

Formats `tool_choice: auto` reads (the model's own; `--tool-call-parser`, default: from the
chat template):
- hermes (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call, text before the first block is the message's content;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- llama3_json: the whole answer is `{"name": ..., "parameters": {...}}` (calls may be
  separated by `;`), optionally after `<|python_tag|>`.
`required` output is vLLM's JSON array of `{"name", "parameters"}`; a `named` output is the
arguments themselves.

Streaming follows OpenAI's contract (structured-output-tools-lora.md §B1): a call's first delta
carries `index`, `id`, `type` and `function.name`, later ones `function.arguments` pieces.
Content streams until a call may be starting (text that could open a call is held back); a
named call's arguments stream as they come; other calls go out whole once complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.openai.tools import ToolPlan

PARSERS = ("hermes", "mistral", "llama3_json")
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parser_for_template(source: str | None, configured: str = "auto") -> str:
    """The parser `--tool-call-parser` names, or the one the chat template's format implies."""
    if configured != "auto":
        return configured
    source = source or ""
    for name in ("mistral", "hermes"):
        if MARKERS[name] in source:
            return name
    if "<|python_tag|>" in source or "<|eom_id|>" in source:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text (what OpenAI clients json.loads)
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def as_delta(self, index: int) -> dict[str, Any]:
        return {"index": index, **self.as_message()}


def call_from(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def json_values(text: str) -> list[Any]:
    """The JSON values written one after another in `text` (separators `;`, `,`, space)."""
    decoder, position = json.JSONDecoder(), 0
    values: list[Any] = []
    while position < len(text):
        while position < len(text) and text[position] in " \t\r\n;,":
            position += 1
        if position >= len(text):
            break
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return values
        values.append(value)
    return values


def parse_auto(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of free text in the model's format; no calls: the text is content."""
    if parser == "hermes":
        start = text.find(MARKERS["hermes"])
        if start < 0:
            return text, []
        calls = [
            call_from(v, "arguments")
            for b in HERMES_BLOCK.findall(text[start:])
            for v in json_values(b)
        ]
        found = [c for c in calls if c is not None]
        return (text[:start].strip(), found) if found else (text, [])
    if parser == "mistral":
        start = text.find(MARKERS["mistral"])
        if start < 0:
            return text, []
        values = json_values(text[start + len(MARKERS["mistral"]) :])
        items = [item for v in values for item in (v if isinstance(v, list) else [v])]
        found = [c for c in (call_from(i, "arguments") for i in items) if c is not None]
        return (text[:start].strip(), found) if found else (text, [])
    body = text.strip().removeprefix(MARKERS["llama3_json"]).strip()
    if not body.startswith("{"):
        return text, []
    found = [c for c in (call_from(v, "parameters") for v in json_values(body)) if c is not None]
    return ("", found) if found else (text, [])


def parse(plan: ToolPlan, parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer under the request's tool plan."""
    if plan.mode == "named":
        return ("", [ToolCall(plan.name, text)]) if json_values(text) else (text, [])
    if plan.mode == "required":
        values = json_values(text)
        if values and isinstance(values[0], list):
            found = [c for c in (call_from(v, "parameters") for v in values[0]) if c is not None]
            if found:
                return "", found
        return text, []
    if plan.mode == "auto":
        return parse_auto(parser, text)
    return text, []


class ToolCallStream:
    """One streamed choice's text -> its deltas (content or tool calls)."""

    def __init__(self, plan: ToolPlan, parser: str) -> None:
        self.plan, self.parser = plan, parser
        self.marker = MARKERS.get(parser, "")
        self.pending = ""  # text held back: a call may be starting
        self.is_in_call = False  # the rest is a call's text: given out whole at the end
        self.has_content = False  # content went out already
        self.named: ToolCall | None = None  # named: the call whose arguments stream
        self.num_calls = 0

    def push(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.plan.mode == "named":
            if self.named is None:
                self.named = ToolCall(self.plan.name, "")
                self.num_calls = 1
                return [
                    {
                        "tool_calls": [
                            {
                                **self.named.as_delta(0),
                                "function": {"name": self.plan.name, "arguments": text},
                            }
                        ]
                    }
                ]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        if self.plan.mode == "none":
            return [{"content": text}]
        self.pending += text
        if self.is_in_call or self.plan.mode == "required":
            return []
        return self._release()

    def _release(self) -> list[dict[str, Any]]:
        """Content that cannot be part of a call goes out; the rest waits."""
        if self.parser == "llama3_json" and not self.has_content:
            head = self.pending.lstrip()
            if head.startswith("{") or head.startswith(self.marker):
                self.is_in_call = True
                return []
            if not head or self.marker.startswith(head):
                return []
        start = self.pending.find(self.marker)
        if start >= 0 and self.parser != "llama3_json":
            content, self.pending, self.is_in_call = (
                self.pending[:start],
                self.pending[start:],
                True,
            )
            return self._content(content)
        keep = next(
            (
                n
                for n in range(min(len(self.marker), len(self.pending)), 0, -1)
                if self.marker.startswith(self.pending[-n:])
            ),
            0,
        )
        content = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return self._content(content)

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.has_content = True
        return [{"content": text}]

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left at the end: the calls found, or the held text as content."""
        if self.plan.mode in ("named", "none") or not self.pending:
            return []
        content, calls = parse(self.plan, self.parser, self.pending)
        deltas = self._content(content)
        if calls:
            deltas.append({"tool_calls": [c.as_delta(i) for i, c in enumerate(calls)]})
            self.num_calls = len(calls)
        self.pending = ""
        return deltas
