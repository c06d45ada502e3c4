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

from services.worker.runner import ModelRunner, PackedBatch

RUNNER_NAME = "fallback"  # what /info reports for such models (the paged path is "paged")


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


def make_runner(loaded, cache, num_speculative_tokens: int = 0) -> ModelRunner:
    """The runner the loaded model needs: paged, or this fallback."""
    runner_class = FallbackRunner if loaded.runner == RUNNER_NAME else ModelRunner
    return runner_class(
        loaded.model,
        cache,
        loaded.eos_token_ids,
        loaded.max_model_len,
        loaded.device,
        num_speculative_tokens=num_speculative_tokens,
    )
