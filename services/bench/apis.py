"""What the bench sends and how it reads the answer, per API (`--api`).

- `tgi` (textgen's default): `POST /generate_stream`, greedy, one event per token with its id;
  the final event's details give the token count.
- `openai`: `POST /v1/completions`, streamed, greedy, `ignore_eos` (vLLM's extension, which
  textgen honours too), `stream_options.include_usage`: any OpenAI-compatible server (vLLM,
  textgen, ...). A chunk is a token event, its text possibly empty (both servers send a chunk
  per token; arrival times give TTFT and ITL as third-party benchmark clients measure them);
  the usage chunk gives the token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from services.bench.timeline import RequestRecord, record_event
from services.bench.workload import Case

APIS = ("tgi", "openai")


@dataclass(frozen=True)
class Api:
    name: str = "tgi"  # one of APIS
    model: str = ""  # `model` of OpenAI requests: the server's served id (GET /v1/models)

    @property
    def path(self) -> str:
        return "/v1/completions" if self.name == "openai" else "/generate_stream"

    def body(self, case: Case) -> dict:
        if self.name == "openai":
            return {
                "model": case.adapter or self.model,
                "prompt": case.prompt,
                "max_tokens": case.max_new_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
        parameters: dict = {"max_new_tokens": case.max_new_tokens, "details": True}
        if case.grammar is not None:
            parameters["grammar"] = case.grammar
        if case.adapter is not None:
            parameters["adapter_id"] = case.adapter
        return {"inputs": case.prompt, "parameters": parameters}

    def record(self, record: RequestRecord, payload: dict, at: float) -> None:
        """Add one decoded `data:` payload to the record."""
        if self.name != "openai":
            record_event(record, payload, at)
            return
        if "error" in payload:
            error = payload["error"]
            record.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        usage = payload.get("usage")
        if usage:
            record.reported_tokens = int(usage.get("completion_tokens", 0))
        for choice in payload.get("choices") or []:
            if choice.get("finish_reason") and not choice.get("text"):
                continue  # a finish after the last token (textgen sends one), not a token
            record.event_times.append(at)
            record.events.append({"token": {"id": -1, "text": choice.get("text", "")}})


def served_api(name: str, url: str) -> Api:
    """The Api for a server: for `openai`, its served model id from GET /v1/models."""
    if name != "openai":
        return Api(name)
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return Api(name, models[0]["id"])
