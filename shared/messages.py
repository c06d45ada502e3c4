"""Every message that crosses Redis, in one place.

Each message is a msgspec Struct encoded as a plain msgpack map (field name -> value), so any
msgpack library (and `redis-cli` plus a decoder) can read what is on the bus. Fields that hold
their default are omitted on the wire; unknown fields are ignored when decoding, so a newer
sender can add fields without breaking an older receiver. `v` is the schema version.

Who sends what:

    gateway   --GenerateRequest-->  {textgen}:requests            (stream, group "schedulers")
    gateway   --AbortRequest----->  {textgen}:aborts              (pub/sub, every scheduler)
    scheduler --StepPlan--------->  {textgen:group:<g>}:steps     (stream, read by worker rank 0)
    worker    --StepResult------->  {textgen:group:<g>}:results   (stream, read by the scheduler)
    worker    --ReplyBatch------->  {textgen}:reply:<gateway_id>  (pub/sub, one PUBLISH per
                                                                 gateway per step)
    worker    --WorkerReady------>  {textgen:group:<g>}:worker    (key: capacity of the group)
    worker    --Heartbeat-------->  {textgen:group:<g>}:heartbeat (key with a TTL)
    scheduler --SchedulerStats--->  {textgen:group:<g>}:scheduler (key: live counters)
    any       --AdapterRef------->  {textgen}:adapters            (hash: name -> LoRA adapter)

(`textgen` is --namespace; the braces are Redis Cluster hash tags, see shared/channels.py.)

No tensors travel: token ids are lists of ints, times are unix seconds (float).
"""

from __future__ import annotations

import enum

import msgspec

SCHEMA_VERSION = 1


class FinishReason(enum.StrEnum):
    """Why a generation ended; the values are TGI's API strings."""

    LENGTH = "length"  # max_new_tokens (or the context) reached
    EOS_TOKEN = "eos_token"  # the model produced an end-of-sequence / stop token id
    STOP_SEQUENCE = "stop_sequence"  # a stop string matched (decided by the gateway)


class Message(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Base of every bus message."""

    v: int = SCHEMA_VERSION  # schema version of the sender


class ConstraintKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"  # spec: a JSON Schema, as JSON text
    REGEX = "regex"  # spec: a regular expression the whole output matches
    CHOICE = "choice"  # spec: a JSON list of strings; the output is exactly one of them
    GRAMMAR = "grammar"  # spec: a context-free grammar in Lark syntax (or GBNF, converted)


class Constraint(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """What the output must match: every dialect (TGI's grammar, OpenAI's response_format,
    vLLM's structured_outputs and guided_*, tools) becomes one of these at the gateway."""

    kind: ConstraintKind  # how to read `spec`
    spec: str  # the schema, regex, choices or grammar, as text
    key: str  # sha256 of (kind, spec): the worker's compile-cache key


class AdapterRef(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """A LoRA adapter as registered in Redis (shared/adapters.py): what a request names and
    what a worker loads. Stored whole in the registry hash and carried by every request that
    uses it, so a worker needs no lookup to load it."""

    name: str  # what clients select it by: OpenAI `model`, TGI `parameters.adapter_id`
    path: str  # folder holding adapter_config.json and adapter_model.safetensors (PEFT's)
    id: str  # unique per registration: a name registered again is a new adapter to workers
    rank: int = 0  # the largest LoRA rank in its config (r and rank_pattern)
    base_model: str = ""  # base_model_name_or_path of its config (informational)
    created: int = 0  # unix s it was registered


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How the worker turns logits into the next token. Defaults mean "off" (greedy)."""

    do_sample: bool = False  # False: argmax (greedy); True: draw from the processed distribution
    temperature: float = 1.0  # logits are divided by this (> 0); 1.0 = unchanged
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus: keep the smallest set with cumulative probability >= p; 1.0 = off
    typical_p: float = 1.0  # locally typical sampling mass; 1.0 = off
    repetition_penalty: float = 1.0  # CTRL-style penalty on tokens already seen; 1.0 = off
    frequency_penalty: float = 0.0  # subtract count * value from logits of generated tokens
    presence_penalty: float = 0.0  # subtract value from logits of every token seen (OpenAI's)
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before picking (OpenAI's)
    seed: int = 0  # sampling seed; each token is drawn from (seed, token index)
    top_n_tokens: int = 0  # also return this many most likely alternatives per token
    watermark: bool = False  # bias toward a green list seeded by the previous token (Kirchenbauer)
    prefill_logprobs: bool = False  # also return the logprob of every prompt token
    constraint: Constraint | None = None  # the output must match it (tokens outside are masked)

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax of the logits (masked by the constraint, if any): no draw, no penalty, no
        watermark. Such a token depends on its own logits row only."""
        return not (
            self.do_sample
            or self.watermark
            or self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.logit_bias
        )

    @property
    def can_speculate(self) -> bool:
        """n-gram proposals are verified for plain greedy requests without a constraint (a
        constraint's mask would have to be checked per proposal: off, said in /info)."""
        return self.is_plain_greedy and self.constraint is None


class StoppingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Token-level stop rules, applied by the worker (stop strings are the gateway's)."""

    max_new_tokens: int  # generation ends with `length` after this many new tokens
    stop_token_ids: list[int] = []  # ids that end generation with `eos_token`, besides the model's
    ignore_eos: bool = False  # do not stop on the model's EOS ids


class GenerateRequest(Message):
    """A validated, tokenized request from a gateway; one entry of the request stream."""

    request_id: str  # globally unique id assigned by the gateway
    input_ids: list[int]  # prompt token ids after truncation, special tokens included
    sampling: SamplingParams  # how to pick tokens
    stopping: StoppingParams  # when to stop
    reply_to: str  # pub/sub channel of the gateway that waits for the tokens
    created_at: float  # unix s when the gateway accepted the request
    deadline: float  # unix s after which nobody waits for the result: drop it
    priority: int = 0  # higher is scheduled first; ties keep arrival order
    generated_ids: list[int] = []  # tokens already delivered (resumption after a failure)
    # the gateway's re-submissions after Redis lost the request's events; a scheduler holding
    # a lower attempt replaces it (services/gateway/pipeline/resume.py)
    attempt: int = 0
    traceparent: str = ""  # W3C trace context of the gateway's span
    adapter: AdapterRef | None = None  # the LoRA adapter to apply; None: the base model


class AbortRequest(Message):
    """The gateway no longer wants a request (client gone, stop sequence hit, deadline)."""

    request_id: str  # the request to drop; unknown ids are ignored
    reason: str = ""  # free text for logs: "disconnect", "stop_sequence", ...
    # 0: every copy; k: only attempts below k (stale copies once the gateway re-submitted the
    # request as attempt k: services/gateway/pipeline/resume.py)
    below_attempt: int = 0


class NewRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A request the worker has not seen yet (or must rebuild after preemption): full data."""

    request_id: str  # id from GenerateRequest
    input_ids: list[int]  # prompt token ids
    generated_ids: list[int] = []  # tokens generated before (preemption or resumption)
    sampling: SamplingParams  # from GenerateRequest
    stopping: StoppingParams  # from GenerateRequest
    reply_to: str  # from GenerateRequest
    block_ids: list[int]  # KV blocks owned by this request, in order (block table)
    num_computed_tokens: int = 0  # tokens whose KV is already in the blocks (prefix cache hit)
    num_scheduled_tokens: int  # tokens to compute in this step, starting at num_computed_tokens
    scheduled_at: float = 0.0  # unix s the scheduler first scheduled it (queue time ends)
    traceparent: str = ""  # trace context, for the worker's spans
    adapter: AdapterRef | None = None  # from GenerateRequest: the LoRA adapter to apply
    attempt: int = 0  # from GenerateRequest: echoed in its token events


class RunningRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A request the worker already holds: only what changed since the last step."""

    request_id: str  # id of a request sent earlier as NewRequest
    new_block_ids: list[int] = []  # blocks appended to its block table in this step
    num_scheduled_tokens: int  # tokens to compute in this step (1 for a decode)


class StepPlan(Message):
    """One forward pass for a worker group: what to compute, with which blocks."""

    step_id: int  # increasing within a scheduler session; echoed in StepResult
    session: str = ""  # the scheduler session that planned it (random); echoed in StepResult
    reset: bool = False  # first plan of a scheduler session: drop every request held
    new_requests: list[NewRequest] = []  # requests to add, with their first chunk
    running: list[RunningRequest] = []  # requests continued from earlier steps
    released_ids: list[str] = []  # requests to forget (finished, aborted, preempted)
    sent_at: float = 0.0  # unix s when the scheduler sent it


class RequestOutput(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What one request got from one step."""

    request_id: str  # id of the request
    token_ids: list[int] = []  # tokens sampled this step; empty while the prompt is still chunked
    finish_reason: FinishReason | None = None  # set when this step ended the request
    error: str = ""  # non-empty: this request failed alone (its grammar did not compile); it ends
    awaits_grammar: bool = False  # no token: its grammar is compiling; its last token is recomputed
    refused: bool = False  # with `error`: failed before the forward pass, nothing was computed


class StepResult(Message):
    """The worker's answer to one StepPlan."""

    step_id: int  # the plan this answers
    session: str = ""  # that plan's scheduler session: a new session's step ids start again
    outputs: list[RequestOutput] = []  # one per scheduled request, in plan order
    num_tokens: int = 0  # tokens computed in the forward pass
    forward_s: float = 0.0  # seconds spent in the model forward
    sample_s: float = 0.0  # seconds spent sampling
    step_s: float = 0.0  # seconds from reading the plan to publishing the tokens
    error: str = ""  # non-empty: the step failed and every request in it failed with this
    num_draft_tokens: int = 0  # speculative proposals computed in the forward pass
    num_accepted_tokens: int = 0  # of those, the ones greedy decoding confirmed


class TopToken(msgspec.Struct, omit_defaults=True, kw_only=True, array_like=True):
    """One alternative token (encoded as [id, logprob] to keep events small)."""

    id: int  # token id
    logprob: float  # log probability under the processed distribution


class TokenEvent(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Tokens of one request from one step, or the error that ended it."""

    request_id: str  # the request these tokens belong to
    index: int = 0  # 1-based index of token_ids[0] among the generated tokens
    token_ids: list[int] = []  # new tokens, in order
    attempt: int = 0  # the request's attempt that made these tokens (GenerateRequest.attempt)
    logprobs: list[float] = []  # one per token in token_ids
    top_tokens: list[list[TopToken]] = []  # per token, top_n_tokens alternatives (if asked)
    finish_reason: FinishReason | None = None  # set on the request's last event
    scheduled_at: float = 0.0  # on the first event: unix s the request was first scheduled
    prefill_logprobs: list[float] = []  # on the first event, if asked: logprob of each prompt
    # token given the ones before it (the first is NaN: nothing precedes it)
    error: str = ""  # non-empty: the request failed; the message for the client
    error_type: str = ""  # TGI error_type of `error` ("generation", ...)


class ReplyBatch(Message):
    """Everything one step produced for one gateway: one PUBLISH."""

    events: list[TokenEvent] = []  # token events for requests of that gateway


class WorkerReady(Message):
    """Capacity of a worker group, written once the model is loaded and the cache allocated."""

    group: str  # worker group id
    model_id: str  # what was loaded (hub id or path)
    num_blocks: int  # KV-cache blocks available to the scheduler
    block_size: int  # tokens per KV block
    max_batch_size: int  # most requests one step may hold
    max_model_len: int  # context length of the model (max_position_embeddings)
    eos_token_ids: list[int] = []  # ids that end generation
    dtype: str = ""  # weight/KV dtype, e.g. "float32"
    device: str = ""  # "cpu", "cuda:0", ...
    world_size: int = 1  # ranks in the tensor-parallel group
    num_speculative_tokens: int = 0  # n-gram proposals the worker adds to a greedy decode step
    runner: str = "paged"  # "paged" KV cache, or "fallback" (per-request caches: no prefix cache)
    attention: str = "sdpa"  # paged runner's kernel: "flash-attn" (CUDA) or "sdpa" (torch's)
    started_at: float = 0.0  # unix s
    # tokens per step the worker suggests for its speed (services/worker/step_budget.py);
    # 0: the device's default. --max-batch-prefill-tokens overrides it
    step_tokens: int = 0
    max_loras: int = 0  # LoRA adapters the group holds at once; the most one step may mix


class Heartbeat(Message):
    """Liveness of a worker group; stored under a key that expires."""

    group: str  # worker group id
    at: float  # unix s of the beat
    last_step_id: int = 0  # last step executed
    num_requests: int = 0  # requests held by the worker
    is_last_step_ok: bool = True  # False after a failed step, until a step succeeds again
    adapters: list[str] = []  # ids of the LoRA adapters the group holds (gateways route by it)


class SchedulerStats(Message):
    """Live state of one scheduler, for `textgen queue`, dashboards and tests."""

    group: str  # worker group this scheduler drives
    at: float  # unix s of the snapshot
    num_running: int = 0  # requests with blocks
    num_waiting: int = 0  # requests pulled but not admitted
    num_blocks: int = 0  # KV blocks in the group
    num_free_blocks: int = 0  # KV blocks free now
    num_steps: int = 0  # steps planned since start
    num_finished: int = 0  # requests finished since start
    max_step_batch_size: int = 0  # most requests seen in one step
    num_joined_running: int = 0  # requests admitted while others were already running
    num_prefill_chunks: int = 0  # partial prompt chunks scheduled (chunked prefill)
    num_prompt_tails: int = 0  # prompts finished past the step budget (by 1/16 of it at most)
    num_mixed_steps: int = 0  # steps that prefilled and decoded in one forward
    num_preempted: int = 0  # requests preempted (recompute) since start
    num_admitted_tokens: int = 0  # known tokens of admitted requests since start
    num_cached_tokens: int = 0  # of those, found in the prefix cache (hit rate = ratio)
    num_cached_blocks: int = 0  # blocks holding a registered prefix now
    draining: bool = False  # no longer pulling new requests
