"""The model's Jinja chat template: chat messages -> the prompt text (pure, no I/O after loading).

Where the template comes from (first found): `chat_template.jinja`, `chat_template.json`
(`{"chat_template": ...}`), then `chat_template` in tokenizer_config.json (a string, or a list of
named templates of which "default" is used). It is rendered in a sandbox the way transformers
and TGI do: `trim_blocks`/`lstrip_blocks`, `add_generation_prompt=True`, `bos_token`,
`eos_token`, a `raise_exception` helper, `strftime_now` and a `tojson` filter. When the last
message is the assistant's, the prompt is cut right after its content so the model continues it
(TGI's rule, taken from transformers' text-generation pipeline).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.gateway.pipeline.errors import GatewayError


class TemplateError(GatewayError):
    """422 `Template error: ...` (no template, a syntax error, or raise_exception)."""

    def __init__(self, detail: str):
        super().__init__(422, f"Template error: {detail}", "template_error", "template")


def no_template() -> TemplateError:
    return TemplateError("template not found")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str:
    """bos/eos tokens in tokenizer_config.json: a string or an AddedToken-like dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def find_template_source(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The template text of a model folder, or None when the model has none."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        source = json.loads(json_file.read_text()).get("chat_template")
        if isinstance(source, str):
            return source
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}]
        named = {
            item.get("name"): item.get("template") for item in source if isinstance(item, dict)
        }
        source = named.get("default")
    return source if isinstance(source, str) else None


class ChatTemplate:
    """A compiled chat template with the tokenizer's bos/eos tokens."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template: jinja2.Template | None = env.from_string(source)
            self.compile_error = ""
        except jinja2.TemplateError as exc:  # reported on use: the gateway still serves /generate
            self.template = None
            self.compile_error = str(exc)

    @classmethod
    def from_folder(cls, folder: Path, tokenizer_config: dict[str, Any]) -> ChatTemplate | None:
        source = find_template_source(folder, tokenizer_config)
        if source is None:
            return None
        return cls(
            source,
            bos_token=_token_text(tokenizer_config.get("bos_token")),
            eos_token=_token_text(tokenizer_config.get("eos_token")),
        )

    @property
    def shows_tools(self) -> bool:
        """The template renders a `tools` list itself (else TGI appends them to the prompt)."""
        return "tools" in self.source

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt for `messages` ([{role, content, ...}], content a string) and `tools`
        (OpenAI's function tools, as transformers hands them to templates); raises
        TemplateError."""
        if self.template is None:
            raise TemplateError(self.compile_error)
        try:
            prompt = self.template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=tools or None,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(str(exc)) from exc
        except Exception as exc:  # a template can fail in arbitrary ways (TypeError, ...)
            raise TemplateError(f"{type(exc).__name__}: {exc}") from exc
        return continue_final_message(prompt, messages)


def continue_final_message(prompt: str, messages: list[dict[str, Any]]) -> str:
    """When the last message is the assistant's, cut `prompt` right after its content (trailing
    whitespace trimmed) so the model continues that message instead of starting a new one."""
    if not messages or messages[-1].get("role") != "assistant":
        return prompt
    content = messages[-1].get("content") or ""
    index = prompt.rfind(content)
    if index < 0:
        return prompt
    return prompt[: index + len(content)].rstrip()
