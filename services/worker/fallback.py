"""The fallback runner, for decoder-only models whose transformers code does not route
attention through the attention interface (ALiBi models such as BLOOM and MPT, Falcon), so they
cannot read the paged KV cache.

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

import torch

from services.worker.loader import FALLBACK, SEQ2SEQ
from services.worker.runner import ModelRunner, PackedBatch


class FallbackRunner(ModelRunner):
    def __init__(self, *args, **kwargs) -> None:
        kwargs["num_speculative_tokens"] = 0
        super().__init__(*args, **kwargs)
        self.caches: dict[str, object] = {}  # request id -> its DynamicCache
        base = self.model.base_model
        self._takes_positions = "position_ids" in inspect.signature(base.forward).parameters

    def _drop_finished_caches(self) -> None:
        for request_id in [r for r in self.caches if r not in self.requests]:
            del self.caches[request_id]

    @torch.inference_mode()
    def _forward(self, batch: PackedBatch) -> torch.Tensor:
        from transformers import DynamicCache

        self._drop_finished_caches()
        query_start = batch.metadata.query_start
        rows = batch.sample_rows.tolist() + batch.draft_rows + batch.prompt_rows
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
        stacked = torch.stack(logits)  # type: ignore[arg-type]
        num_kept = len(batch.sampling) + len(batch.draft_rows)
        if batch.prompt_rows:
            self._score_prompt(batch, stacked[num_kept:])
        return stacked[:num_kept]


class Seq2SeqRunner(FallbackRunner):
    """Encoder-decoder models on the same scheduling. The prompt is the encoder's input: its
    chunks cost nothing until the last one, where the encoder runs once over the whole prompt
    and the decoder starts; every later step feeds the decoder the last generated token.
    After preemption the decoder is rebuilt from the start token and the tokens generated so
    far. Prompt logprobs do not exist for such models (NaN)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.encoded: dict[str, torch.Tensor] = {}  # request id -> encoder output [1, len, d]
        self.start_token_id = int(self.model.config.decoder_start_token_id or 0)

    def _drop_finished_caches(self) -> None:
        super()._drop_finished_caches()
        for request_id in [r for r in self.encoded if r not in self.requests]:
            del self.encoded[request_id]

    @torch.inference_mode()
    def _forward(self, batch: PackedBatch) -> torch.Tensor:
        from transformers import DynamicCache, EncoderDecoderCache

        self._drop_finished_caches()
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
        if batch.draft_rows:
            raise RuntimeError("speculation is off for encoder-decoder models")
        if batch.prompt_rows:
            vocab = self.model.get_output_embeddings().out_features
            nan = torch.full((len(batch.prompt_rows), vocab), float("nan"), device=self.device)
            self._score_prompt(batch, nan)
        if not logits:
            return torch.empty(0, device=self.device)
        return torch.stack(logits)


def make_runner(loaded, cache, num_speculative_tokens: int = 0) -> ModelRunner:
    """The runner the loaded model needs (LoadedModel.runner: paged, fallback, seq2seq); the
    paged runner forwards through the fast CPU decoder where that can run the model."""
    runner_class = {FALLBACK: FallbackRunner, SEQ2SEQ: Seq2SeqRunner}.get(
        loaded.runner, ModelRunner
    )
    extra = {"decoder": loaded.decoder} if runner_class is ModelRunner else {}
    return runner_class(
        loaded.model,
        cache,
        loaded.eos_token_ids,
        loaded.max_model_len,
        loaded.device,
        num_speculative_tokens=num_speculative_tokens,
        **extra,
    )
