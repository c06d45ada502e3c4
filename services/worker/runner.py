"""Executes StepPlans: the one runner, whatever runs the forward pass.

Input: a StepPlan (new requests in full, running ones as diffs). Output: a StepResult for the
scheduler and TokenEvents grouped by reply channel for the gateways. A step: apply the plan,
pack the scheduled tokens (PackedBatch), let the ForwardBackend picked at load compute the
wanted rows' logits (services/worker/backends.py), sample, advance each request and decide
its stops. The runner holds no Redis: `service.py` moves the messages.

The interface its callers use: `execute(plan)`, `kv_cache`, `attention` (the backend's name),
`num_speculative_tokens`, `requests` (held by id), `kernels` (the CPU kernels, or None).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from services.worker.backends import ForwardBackend, PackedBatch
from services.worker.grammar import GrammarEngine, RequestGrammar
from services.worker.kernels import CpuKernels
from services.worker.kv_cache import PagedKVCache
from services.worker.lora import LoraSet, hold_adapters
from services.worker.sampling import Sampled, needs_own_row, sample_greedy_batch, sample_one
from services.worker.speculation import accepted, propose
from services.worker.state import RequestState, stop_reason
from shared.messages import FinishReason, RequestOutput, StepPlan, StepResult, TokenEvent
from shared.telemetry import record_span

log = logging.getLogger(__name__)


@dataclass
class StepOutcome:
    result: StepResult  # for the scheduler
    events: dict[str, list[TokenEvent]]  # reply channel -> events of its requests


class ModelRunner:
    def __init__(
        self,
        backend: ForwardBackend,
        kv_cache: PagedKVCache,
        eos_token_ids: list[int],
        max_model_len: int,
        device: torch.device,
        num_speculative_tokens: int = 0,
        kernels: CpuKernels | None = None,
        grammar: GrammarEngine | None = None,
        lora: LoraSet | None = None,
    ) -> None:
        self.backend = backend  # runs the forward pass
        self.attention = backend.name  # "cpu-kernels", "flash-attn" or "sdpa": /info, metrics
        # n-gram proposals per step, where the backend verifies them in the same pass
        self.num_speculative_tokens = num_speculative_tokens if backend.can_speculate else 0
        self.kernels = kernels  # the CPU kernels (greedy sampling), None where not built
        self.kv_cache = kv_cache
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.device = device
        self.requests: dict[str, RequestState] = {}
        self.grammar = grammar  # constrained decoding; None: requests with a constraint fail
        self.lora = lora  # LoRA adapters; None: requests naming one fail

    def execute(self, plan: StepPlan) -> StepOutcome:
        started = time.perf_counter()
        scheduled = self._apply_plan(plan)
        refused = hold_adapters(self.lora, scheduled, self.requests)
        self.backend.release(self.requests)  # state of requests gone since the last step
        if not scheduled:
            return self._with_refused(StepOutcome(StepResult(step_id=plan.step_id), {}), refused)
        try:
            batch = self._pack(scheduled)
            forward_started = time.perf_counter()
            logits = self._forward(batch)  # on CUDA: launched, not waited for
            forward_s = time.perf_counter() - forward_started
            sample_started = time.perf_counter()
            grammars = [state.grammar for state in batch.sampling]
            ruled_out = self.grammar.masks(grammars, logits.device) if self.grammar else {}
            samples = self._sample(batch, logits, ruled_out)
            sample_s = time.perf_counter() - sample_started
        except Exception as exc:  # the whole step fails; every request in it ends
            log.exception("step %d failed: %s", plan.step_id, [s.shape for s in scheduled])
            return self._fail(plan.step_id, scheduled, f"{type(exc).__name__}: {exc}")
        outcome = self._with_refused(self._advance(plan.step_id, scheduled, samples), refused)
        outcome.result.num_tokens = int(batch.input_ids.shape[1])
        outcome.result.num_draft_tokens = len(batch.draft_rows)
        outcome.result.forward_s, outcome.result.sample_s = forward_s, sample_s
        outcome.result.step_s = time.perf_counter() - started
        return outcome

    def _apply_plan(self, plan: StepPlan) -> list[RequestState]:
        if plan.reset:
            self.requests.clear()
        for request_id in plan.released_ids:
            self.requests.pop(request_id, None)
        scheduled = []
        for new in plan.new_requests:
            state = RequestState.from_new(new)
            if new.sampling.constraint is not None:
                state.grammar = self._attach(new.sampling.constraint, new.generated_ids)
            self.requests[state.request_id] = state
            scheduled.append(state)
        for running in plan.running:
            held = self.requests.get(running.request_id)
            if held is None:  # it finished in the previous step (overlapped scheduling)
                log.debug("plan %d names finished request %s", plan.step_id, running.request_id)
                continue
            held.block_ids.extend(running.new_block_ids)
            held.num_scheduled_tokens = running.num_scheduled_tokens
            scheduled.append(held)
        return scheduled

    @staticmethod
    def _with_refused(outcome: StepOutcome, refused: list[tuple[RequestState, str]]) -> StepOutcome:
        for state, error in refused:
            outcome.result.outputs.append(
                RequestOutput(request_id=state.request_id, error=error, refused=True)
            )
            outcome.events.setdefault(state.reply_to, []).append(
                TokenEvent(request_id=state.request_id, error=error, error_type="validation")
            )
        return outcome

    def _attach(self, constraint, generated_ids: list[int]) -> RequestGrammar:
        if self.grammar is not None:
            return self.grammar.attach(constraint, generated_ids)
        return RequestGrammar.failed(constraint, "this worker has no tokenizer to build grammars")

    def _pack(self, scheduled: list[RequestState]) -> PackedBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        sampling: list[RequestState] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_owners: list[RequestState] = []
        draft_rows: list[int] = []
        draft_owners: list[RequestState] = []
        for state in scheduled:
            start = state.num_computed_tokens
            end = start + state.num_scheduled_tokens
            state.draft_ids = self._drafts(state, end)
            stop = end + len(state.draft_ids)  # drafts are computed after the real tokens
            input_ids.extend(state.token_ids[start:end] + state.draft_ids)
            positions.extend(range(start, stop))
            slot_mapping.extend(self.kv_cache.slot_range(state.block_ids, start, stop))
            context_lens.append(stop)
            query_start.append(query_start[-1] + stop - start)
            if state.samples_this_step:
                sample_rows.append(query_start[-1] - 1 - len(state.draft_ids))
                sampling.append(state)
                draft_rows.extend(range(query_start[-1] - len(state.draft_ids), query_start[-1]))
                draft_owners.extend([state] * len(state.draft_ids))
            if state.wants_prompt_logprobs:
                if start == 0:
                    state.prompt_logprobs = [float("nan")]  # nothing precedes the first token
                for position in range(start, min(end, state.num_prompt_tokens - 1)):
                    prompt_rows.append(query_start[-2] + position - start)
                    prompt_targets.append(state.token_ids[position + 1])
                    prompt_owners.append(state)
        batch = PackedBatch(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=self.device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),
            query_start=query_start,
            context_lens=context_lens,
            block_tables=[s.block_ids for s in scheduled],
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            sample_rows=sample_rows,
            sampling=sampling,
            prompt_rows=prompt_rows,
            prompt_targets=prompt_targets,
            prompt_owners=prompt_owners,
            draft_rows=draft_rows,
            draft_owners=draft_owners,
            states=scheduled,
        )
        batch.prepared = self.backend.prepare(batch, self.kv_cache)  # once, for every layer
        if self.lora is not None:
            self.lora.begin_step(
                (
                    (state.adapter.id if state.adapter else None, start, end)
                    for state, start, end in zip(scheduled, query_start, query_start[1:])
                ),
                len(input_ids),
            )
        return batch

    def _drafts(self, state: RequestState, end: int) -> list[int]:
        """n-gram proposals for a plain greedy decode, as many as its blocks, its
        max_new_tokens and the context length leave room for."""
        if not (
            self.num_speculative_tokens
            and state.num_scheduled_tokens == 1
            and state.samples_this_step
            and state.sampling.can_speculate
        ):
            return []
        room = min(
            self.num_speculative_tokens,
            len(state.block_ids) * self.kv_cache.block_size - end,
            state.stopping.max_new_tokens - state.num_generated - 1,
            self.max_model_len - len(state.token_ids) - 1,
        )
        return propose(state.token_ids, room)

    def _forward(self, batch: PackedBatch) -> torch.Tensor:
        """Logits of the sampling rows, then of the draft rows (prompt rows are scored into
        their requests on the way). [num_sampling + drafts, vocab]"""
        # nothing wanted (prompt chunks that score nothing): one row keeps the pass valid
        rows = batch.kept_rows or [batch.input_ids.shape[1] - 1]
        try:
            logits = self.backend.forward(batch, self.kv_cache, rows)
        finally:
            if self.lora is not None:
                self.lora.step = None  # the adapters' rows apply to this pass only
        num_kept = len(batch.sampling) + len(batch.draft_rows)
        if batch.prompt_rows:
            self._score_prompt(batch, logits[num_kept:])
        return logits[:num_kept]

    @staticmethod
    def _score_prompt(batch: PackedBatch, logits: torch.Tensor) -> None:
        """Append each prompt token's logprob to its request. logits: [num_prompt_rows, vocab]"""
        targets = torch.tensor(batch.prompt_targets, device=logits.device)[:, None]
        logprobs = logits.float().log_softmax(-1).gather(1, targets)[:, 0].tolist()
        for owner, logprob in zip(batch.prompt_owners, logprobs, strict=True):
            owner.prompt_logprobs.append(logprob)

    def _sample(
        self, batch: PackedBatch, logits: torch.Tensor, ruled_out: dict[int, torch.Tensor]
    ) -> list[list[Sampled]]:
        """Per sampling request: its token, then the greedy token after each of its drafts
        (none for a request whose grammar is not ready: it samples nothing this step)."""
        sampling = batch.sampling
        candidates = [
            [sample] if sample is not None else []
            for sample in self._sample_rows(sampling, logits, ruled_out)
        ]
        if batch.draft_rows:
            draft_logits = logits[len(sampling) :]
            verified = sample_greedy_batch(
                draft_logits,
                [owner.sampling.top_n_tokens for owner in batch.draft_owners],
                self.kernels,
            )
            index = {id(state): i for i, state in enumerate(sampling)}
            for owner, sample in zip(batch.draft_owners, verified, strict=True):
                candidates[index[id(owner)]].append(sample)
        return candidates

    def _sample_rows(
        self,
        sampling: list[RequestState],
        logits: torch.Tensor,
        ruled_out: dict[int, torch.Tensor],
    ) -> list[Sampled | None]:
        """Per sampling request its token; None for one whose grammar is not ready.
        `ruled_out`: row -> the tokens its grammar forbids."""
        samples: list[Sampled | None] = [None] * len(sampling)
        greedy_rows = [
            i
            for i, s in enumerate(sampling)
            if not needs_own_row(s.sampling) and (s.grammar is None or i in ruled_out)
        ]
        if greedy_rows:
            batch = sample_greedy_batch(
                logits,
                [sampling[i].sampling.top_n_tokens for i in greedy_rows],
                self.kernels,
                greedy_rows,
                ruled_out,
            )
            for row, sample in zip(greedy_rows, batch):
                samples[row] = sample
        for i, state in enumerate(sampling):
            if samples[i] is None and (state.grammar is None or i in ruled_out):
                samples[i] = sample_one(
                    logits[i],
                    state.sampling,
                    state.token_ids,
                    state.num_generated + 1,
                    ruled_out.get(i),
                )
        return samples

    def _advance(
        self, step_id: int, scheduled: list[RequestState], samples: list[list[Sampled]]
    ) -> StepOutcome:
        sampling_iter = iter(samples)
        events: dict[str, list[TokenEvent]] = defaultdict(list)
        outputs: list[RequestOutput] = []
        num_accepted = 0
        now = time.time()
        for state in scheduled:
            is_sampling = state.samples_this_step
            state.num_steps += 1
            state.first_step_at = state.first_step_at or now
            if not is_sampling:
                state.num_computed_tokens += state.num_scheduled_tokens
                outputs.append(RequestOutput(request_id=state.request_id))
                continue
            candidates = next(sampling_iter)
            if not candidates:  # its grammar is not ready, or never will be
                outputs.append(self._unsampled(state, events))
                continue
            emitted = accepted(state.draft_ids, [c.token_id for c in candidates])
            # the accepted drafts' keys and values were computed from the right tokens
            state.num_computed_tokens += state.num_scheduled_tokens + len(emitted) - 1
            num_accepted += len(emitted) - 1
            first_index = state.num_generated + 1
            taken: list[Sampled] = []
            reason = None
            for sample in candidates[: len(emitted)]:
                state.token_ids.append(sample.token_id)
                taken.append(sample)
                reason = stop_reason(state, sample.token_id, self.eos_token_ids, self.max_model_len)
                if state.grammar is not None and reason != FinishReason.EOS_TOKEN:
                    error = GrammarEngine.accept(state.grammar, sample.token_id)
                    if error:  # never expected: the token was drawn from the allowed ones
                        log.error("request %s: %s", state.request_id, error)
                        reason = FinishReason.EOS_TOKEN
                if reason is not None:
                    break
            token_ids = [sample.token_id for sample in taken]
            if state.adapter is not None and self.lora is not None:
                self.lora.on_tokens(state.adapter.name, len(token_ids))
            outputs.append(
                RequestOutput(
                    request_id=state.request_id, token_ids=token_ids, finish_reason=reason
                )
            )
            event = TokenEvent(
                request_id=state.request_id,
                index=first_index,
                token_ids=token_ids,
                attempt=state.attempt,
                logprobs=[sample.logprob for sample in taken],
                top_tokens=[s.top_tokens for s in taken] if taken[0].top_tokens else [],
                finish_reason=reason,
            )
            if not state.has_sent_first_event:
                event.scheduled_at = state.scheduled_at
                if state.wants_prompt_logprobs:
                    event.prefill_logprobs = state.prompt_logprobs
                state.has_sent_first_event = True
            events[state.reply_to].append(event)
            if reason is not None:
                del self.requests[state.request_id]
                record_span(
                    "worker.generate",
                    state.traceparent,
                    state.first_step_at,
                    time.time(),
                    {
                        "request_id": state.request_id,
                        "finish_reason": reason.value,
                        "num_steps": state.num_steps,
                        "num_generated_tokens": state.num_generated,
                        "constraint": state.grammar.constraint.kind.value if state.grammar else "",
                    },
                )
        result = StepResult(step_id=step_id, outputs=outputs, num_accepted_tokens=num_accepted)
        return StepOutcome(result, dict(events))

    def _unsampled(self, state: RequestState, events: dict[str, list[TokenEvent]]) -> RequestOutput:
        """A sampling request that took no token: its grammar is compiling (its last token is
        computed again next step), or failed to compile (it ends here, alone)."""
        grammar = state.grammar
        assert grammar is not None
        if not grammar.error:
            state.num_computed_tokens += state.num_scheduled_tokens - 1
            return RequestOutput(request_id=state.request_id, awaits_grammar=True)
        log.warning("request %s failed: %s", state.request_id, grammar.error)
        del self.requests[state.request_id]
        events[state.reply_to].append(
            TokenEvent(request_id=state.request_id, error=grammar.error, error_type="validation")
        )
        return RequestOutput(request_id=state.request_id, error=grammar.error)

    def _fail(self, step_id: int, scheduled: list[RequestState], error: str) -> StepOutcome:
        events: dict[str, list[TokenEvent]] = defaultdict(list)
        for state in scheduled:
            self.requests.pop(state.request_id, None)
            events[state.reply_to].append(
                TokenEvent(request_id=state.request_id, error=error, error_type="generation")
            )
        result = StepResult(
            step_id=step_id,
            outputs=[RequestOutput(request_id=s.request_id) for s in scheduled],
            error=error,
        )
        return StepOutcome(result, dict(events))
