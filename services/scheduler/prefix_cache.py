"""The prefix cache as the scheduler uses it: which leading blocks of a request are cached
already, and which of the blocks a planned step computes enter the cache. Hashes chain over
full blocks and the request's LoRA adapter (services/scheduler/block_manager.py)."""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager, block_hashes
from services.scheduler.request import SchedRequest


def cached_prefix(blocks: BlockManager, request: SchedRequest, enabled: bool) -> list[int]:
    """Cached blocks of the request's leading full blocks (a reference taken on each). At
    least one token is always left to compute: its logits give the next token."""
    if not enabled or request.message.sampling.prefill_logprobs:
        return []
    num_full = (len(request.token_ids) - 1) // blocks.block_size
    if num_full == 0:
        return []
    hashes = block_hashes(request.token_ids, blocks.block_size, num_full, request.adapter_id)
    return blocks.cached_prefix(hashes)


def register_planned_blocks(
    blocks: BlockManager, request: SchedRequest, enabled: bool
) -> list[int]:
    """Put the request's full blocks that the step being planned computes in the prefix cache
    (the blocks registered). A request planned later may take them at once: the worker runs
    steps in plan order, and within a step writes every token's keys before any attention
    reads them. vLLM caches blocks at scheduling time too; a long shared prompt is then
    computed once even when its requests arrive together."""
    num_full = request.num_computed_tokens // blocks.block_size
    if num_full <= request.num_hashed_blocks or not enabled:
        return []
    hashes = block_hashes(request.token_ids, blocks.block_size, num_full, request.adapter_id)
    registered = []
    for index in range(request.num_hashed_blocks, num_full):
        if blocks.register(request.block_ids[index], hashes[index]):
            registered.append(request.block_ids[index])
    request.num_hashed_blocks = num_full
    return registered
