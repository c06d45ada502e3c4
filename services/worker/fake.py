"""A simulated worker (`--fake-step-ms N`): every step takes N ms and emits deterministic
tokens, with no model. The scheduler, the KV block accounting, Redis and the gateways run for
real, so the control plane can be measured alone: N groups with fixed step times show how
throughput scales with groups."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from services.worker import kernels
from services.worker.backends import ForwardBackend, PackedBatch
from services.worker.kv_cache import CacheShape, PagedKVCache
from services.worker.loader import LoadedModel
from shared.model_files import context_length, eos_token_ids, resolve_model_dir

FAKE_SHAPE = CacheShape(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)


def fake_model(model_id: str, revision: str | None = None) -> LoadedModel:
    """What the worker needs to know of a model (tokenizer-side facts), without weights."""
    folder: Path = resolve_model_dir(model_id, revision)
    return LoadedModel(
        model=None,  # type: ignore[arg-type]
        folder=folder,
        cache_shape=FAKE_SHAPE,
        eos_token_ids=eos_token_ids(folder),
        max_model_len=context_length(folder),
        device=torch.device("cpu"),
        # greedy sampling on the CPU kernels: torch's log_softmax over a batch of 32 rows of a
        # 49152-token vocabulary took ~6 ms on one thread, more than the simulated GPU step
        kernels=kernels.load(),
    )


class Simulated(ForwardBackend):
    """A forward pass that sleeps `step_ms` and favours one non-EOS token per sampling row."""

    can_speculate = False
    uses_paged_cache = False
    launches_async = True  # as a CUDA graph's replay: the pass runs on while the host sends

    def __init__(self, step_ms: float, vocab_size: int, eos_token_ids: list[int]) -> None:
        # no real compute here: one thread, so no OpenMP team spins between the tiny tensor
        # ops of each step (it cost a third of a core per simulated group)
        torch.set_num_threads(1)
        self.step_s = step_ms / 1000
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)

    def forward(self, batch: PackedBatch, kv_cache: PagedKVCache, rows: list[int]) -> torch.Tensor:
        """The step's logits, returned `step_ms` after the call: the time spent building them
        counts in it, as a GPU's forward pass holds its own output."""
        started = time.perf_counter()
        num_sampling = len(batch.sampling)
        logits = torch.empty(num_sampling + len(batch.prompt_rows), self.vocab_size)
        logits[:num_sampling].zero_()
        logits[num_sampling:].fill_(float("nan"))  # prompt logprobs do not exist here
        for row, state in enumerate(batch.sampling):
            token_id = (len(state.token_ids) * 7 + 3) % self.vocab_size
            while token_id in self.eos_token_ids:
                token_id = (token_id + 1) % self.vocab_size
            logits[row, token_id] = 10.0
        self.queued()  # a GPU's pass runs from here on: the step before's output goes out
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))
        return logits
