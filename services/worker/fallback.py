"""The fallback backends, for models that cannot read the paged KV cache: decoder-only models
whose transformers code does not route attention through the attention interface (ALiBi
models such as BLOOM and MPT, Falcon) and encoder-decoders (T5).

Scheduling is unchanged: requests join and leave the batch at every step, prompts are
prefilled in chunks, KV blocks are accounted for (sized from the model's real per-token KV
bytes) and preemption recomputes. What differs is the forward pass: each request of a step
runs alone on the model's own cache (a transformers DynamicCache per request, kept between
steps), and only the rows that are sampled or scored go through the lm_head. No prefix caching
(the scheduler is told) and no speculation."""

from __future__ import annotations

import bisect
import inspect
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from services.worker.backends import ForwardBackend, PackedBatch
from services.worker.kv_cache import PagedKVCache


class OwnCache(ForwardBackend):
    """Each request runs alone on the model's own cache (a DynamicCache per request, kept
    between steps); only the wanted rows go through the lm_head."""

    can_speculate = False
    uses_paged_cache = False

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model  # a transformers model: its parts are read by name
        self.device = device
        self.caches: dict[str, Any] = {}  # request id -> its DynamicCache
        self._takes_positions = (
            "position_ids" in inspect.signature(model.base_model.forward).parameters
        )

    def release(self, live_request_ids: Iterable[str]) -> None:
        live = set(live_request_ids)
        for request_id in [r for r in self.caches if r not in live]:
            del self.caches[request_id]

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, kv_cache: PagedKVCache, rows: list[int]) -> torch.Tensor:
        from transformers import DynamicCache

        query_start = batch.query_start
        wanted: dict[int, list[tuple[int, int]]] = defaultdict(list)  # request -> (out, offset)
        for out_index, row in enumerate(rows):
            request = bisect.bisect_right(query_start, row) - 1
            wanted[request].append((out_index, row - query_start[request]))
        logits: list[torch.Tensor | None] = [None] * len(rows)
        head = self.model.get_output_embeddings()
        for request, state in enumerate(batch.states):
            start, end = query_start[request], query_start[request + 1]
            positions = batch.position_ids[:, start:end]
            first = int(positions[0, 0])
            cache = self.caches.get(state.request_id)
            if cache is None or first == 0:
                cache = self.caches[state.request_id] = DynamicCache()
            elif cache.get_seq_length() > first:  # recomputing (never expected): cut back
                cache.crop(first)
            extra = {"position_ids": positions} if self._takes_positions else {}
            hidden = self.model.base_model(
                input_ids=batch.input_ids[:, start:end],
                attention_mask=torch.ones(1, first + end - start, device=self.device),
                past_key_values=cache,
                use_cache=True,
                **extra,
            ).last_hidden_state[0]  # [chunk, hidden]
            if wanted[request]:
                offsets = torch.tensor(
                    [offset for _, offset in wanted[request]], device=self.device
                )
                for (out_index, _), row_logits in zip(
                    wanted[request], head(hidden[offsets]), strict=True
                ):
                    logits[out_index] = row_logits
        if not rows:
            return torch.empty(0, device=self.device)
        return torch.stack(logits)  # type: ignore[arg-type]


class EncoderDecoder(OwnCache):
    """Encoder-decoder models on the same scheduling. The prompt is the encoder's input: its
    chunks cost nothing until the last one, where the encoder runs once over the whole prompt
    and the decoder starts; every later step feeds the decoder the last generated token.
    After preemption the decoder is rebuilt from the start token and the tokens generated so
    far. Prompt logprobs do not exist for such models (NaN)."""

    def __init__(self, model: Any, device: torch.device) -> None:
        super().__init__(model, device)
        self.encoded: dict[str, torch.Tensor] = {}  # request id -> encoder output [1, len, d]
        self.start_token_id = int(self.model.config.decoder_start_token_id or 0)

    def release(self, live_request_ids: Iterable[str]) -> None:
        live = set(live_request_ids)
        super().release(live)
        for request_id in [r for r in self.encoded if r not in live]:
            del self.encoded[request_id]

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, kv_cache: PagedKVCache, rows: list[int]) -> torch.Tensor:
        from transformers import DynamicCache, EncoderDecoderCache

        if batch.draft_rows:
            raise RuntimeError("speculation is off for encoder-decoder models")
        logits = []
        for state in batch.sampling:  # states that compute nothing else are prompt chunks
            cache = self.caches.get(state.request_id)
            generated = state.token_ids[state.num_prompt_tokens :]
            if cache is None:  # first sample here: encode, then decode what exists so far
                prompt = torch.tensor(
                    [state.token_ids[: state.num_prompt_tokens]], device=self.device
                )
                self.encoded[state.request_id] = self.model.get_encoder()(
                    input_ids=prompt
                ).last_hidden_state
                cache = self.caches[state.request_id] = EncoderDecoderCache(
                    DynamicCache(), DynamicCache()
                )
                decoder_ids = [self.start_token_id, *generated]
            else:
                decoder_ids = generated[-1:]
            out = self.model(
                encoder_outputs=(self.encoded[state.request_id],),
                decoder_input_ids=torch.tensor([decoder_ids], device=self.device),
                past_key_values=cache,
                use_cache=True,
            )
            logits.append(out.logits[0, -1])
        vocab = self.model.get_output_embeddings().out_features
        nan = torch.full((len(batch.prompt_rows), vocab), float("nan"), device=self.device)
        if not logits:
            return nan
        return torch.cat([torch.stack(logits), nan.to(logits[0].dtype)])
