"""LoRA adapters in a worker: loaded from PEFT folders (lora_files.py), held LRU, applied per
request in one forward pass that mixes adapters and the base model.

An adapted matmul computes `y = x W^T + s (x A^T) B^T` for the rows of requests using that
adapter; W, the base weight, is never changed. Every matmul an adapter may touch is a
`LoraOp`: one Linear module (transformers' modules), or a fused matmul of several (the fast
decoder's q/k/v and gate/up), whose parts are column ranges of its output.

The adapters held (`--max-loras`) are stacked per op, ranks zero-padded to the largest held
(K = parts x rank; the Punica/S-LoRA layout):

    A  [slots, in, K]    A transposed, the parts' ranks side by side
    B  [slots, K, out]   B transposed, the scale folded in; part p's ranks fill p's columns

A step gives each row the slot of its request's adapter (-1: the base model). On the CPU,
the kernel `lora_add` (services/worker/kernels/lora.inc) computes each row's own product, the
BGMV shape: shrink x A_s into float32, expand into each part's columns. Elsewhere (GPUs, a
tensor-parallel rank's partial share, ranks past the kernel's limit) two matmuls over every
held adapter do it, each row masked to its own slot's columns (slots x the FLOPs, but two
passes per op whatever the mix). A step of base-model requests only costs nothing.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from services.worker.kernels import KEY_TILE, LORA_TILE, MAX_LORA_COLS, CpuKernels
from services.worker.lora_files import Adapter, AdapterLoadError, load_adapter
from services.worker.state import RequestState
from shared.messages import AdapterRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraOp:
    """A base matmul adapters may add to."""

    key: str  # unique name: the module's name, or the fused matmul's
    parts: tuple[tuple[str, int], ...]  # (module name, out features) in output column order
    in_features: int  # columns of its input
    # tensor parallel: the slice of a column-parallel layer's output this rank computes, or the
    # slice of a row-parallel layer's input it holds (its share of the delta is summed)
    out_slice: tuple[int, int] | None = None
    in_slice: tuple[int, int] | None = None


@dataclass
class Stack:
    """One op's weights for the adapters held, in slot order; K = parts * rank."""

    a: torch.Tensor  # [slots, in, K]: A transposed, the parts' ranks side by side
    b: torch.Tensor  # [slots, K, out]: B transposed; part p's ranks fill only p's columns
    col_start: torch.Tensor  # [parts] int64: first output column of each part
    col_width: torch.Tensor  # [parts] int64: its width
    is_partial: bool = False  # a row-parallel rank's share: summed over the ranks

    @functools.cached_property
    def a_all(self) -> torch.Tensor:
        """[in, slots * K]: every slot's A, for one matmul over all of them (torch path)."""
        return self.a.permute(1, 0, 2).reshape(self.a.shape[1], -1)


@dataclass
class StepRows:
    """Which rows of the packed step use which held adapter."""

    slots: torch.Tensor  # [rows] int64: each row's adapter slot, -1 for the base model
    num_slots: int  # adapters held
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # K -> [rows, slots * K]

    @functools.cached_property
    def tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapted rows grouped by slot, and where each tile of at most LORA_TILE rows of
        one slot starts among them (the CPU kernel's work items)."""
        adapted = (self.slots >= 0).nonzero().flatten()
        order = adapted[torch.argsort(self.slots[adapted], stable=True)]
        owners = self.slots[order].tolist()
        starts = [0]
        for i in range(1, len(owners) + 1):
            if i == len(owners) or owners[i] != owners[starts[-1]] or i - starts[-1] == LORA_TILE:
                starts.append(i)
        return order, torch.tensor(starts, dtype=torch.int64)

    def mask(self, cols: int) -> torch.Tensor:
        """1 on a row's own slot's `cols` shrunk columns, 0 elsewhere (torch path)."""
        mask = self.masks.get(cols)
        if mask is None:
            owner = torch.arange(self.num_slots)[None, :] == self.slots[:, None]
            mask = owner[:, :, None].expand(-1, -1, cols).reshape(len(self.slots), -1)
            self.masks[cols] = mask
        return mask


@dataclass
class LoraSet:
    """The adapters a worker group holds (at most `capacity`), and the step being computed."""

    capacity: int  # --max-loras
    dtype: torch.dtype  # of the stacked weights (the model's)
    modules: dict[str, tuple[int, int]]  # adaptable module name -> (in, out)
    ops: dict[str, LoraOp]  # op key -> op
    on_load: Callable[[str, float], None] = lambda name, seconds: None  # metrics hooks
    on_evict: Callable[[str], None] = lambda name: None
    on_request: Callable[[str], None] = lambda name: None  # a request started with it
    on_tokens: Callable[[str, int], None] = lambda name, count: None  # tokens it sampled
    held: OrderedDict[str, Adapter] = field(default_factory=OrderedDict)  # id -> adapter, LRU
    slot_of: dict[str, int] = field(default_factory=dict)  # adapter id -> its stacked slot
    stacks: dict[str, Stack | None] = field(default_factory=dict)  # op key -> its stack
    step: StepRows | None = None  # set for the forward pass of a step that uses an adapter
    registered: set[str] | None = None  # ids still in the registry (None: not known yet)
    rank: int = 0  # the stacked rank (largest held)
    install: Callable[[], None] | None = None  # run before the first load (hooks the modules)
    kernels: CpuKernels | None = None  # the CPU kernels: each row's own product (lora.inc)

    def acquire(self, ref: AdapterRef, in_use: set[str]) -> None:
        """Hold `ref`'s adapter, loading it (and evicting the least recently used adapter no
        live request uses) when it is not held. Raises AdapterLoadError."""
        if ref.id in self.held:
            self.held.move_to_end(ref.id)
            return
        self._evict(in_use, room_for=1)
        if len(self.held) >= self.capacity:
            raise AdapterLoadError(
                f"LoRA adapter {ref.name!r}: all {self.capacity} adapter slots of this worker "
                "group are in use by running requests (--max-loras)"
            )
        if self.install is not None:
            self.install()
            self.install = None
        started = time.perf_counter()
        adapter = load_adapter(ref, self.modules, self.dtype)
        self.held[ref.id] = adapter
        self._restack()
        seconds = time.perf_counter() - started
        log.info("loaded LoRA adapter %s (rank %d) in %.3f s", ref.name, adapter.rank, seconds)
        self.on_load(ref.name, seconds)

    def retain(self, in_use: set[str]) -> None:
        """Drop adapters that left the registry once no live request uses them."""
        if self.registered is not None:
            self._evict(in_use, room_for=0)

    def _evict(self, in_use: set[str], room_for: int) -> None:
        gone = [i for i in self.held if self.registered is not None and i not in self.registered]
        victims = [i for i in gone if i not in in_use]
        for adapter_id in self.held:  # least recently used first
            if len(self.held) - len(victims) + room_for <= self.capacity:
                break
            if adapter_id not in in_use and adapter_id not in victims:
                victims.append(adapter_id)
        for adapter_id in victims:
            adapter = self.held.pop(adapter_id)
            log.info("evicted LoRA adapter %s", adapter.ref.name)
            self.on_evict(adapter.ref.name)
        if victims:
            self._restack()

    def _restack(self) -> None:
        self.slot_of = {adapter_id: slot for slot, adapter_id in enumerate(self.held)}
        adapters = list(self.held.values())
        self.rank = max((a.rank for a in adapters), default=0)
        self.stacks = {key: self._stack(op, adapters) for key, op in self.ops.items()}

    def _stack(self, op: LoraOp, adapters: list[Adapter]) -> Stack | None:
        names = [name for name, _ in op.parts]
        if not any(name in a.weights for a in adapters for name in names):
            return None
        out_slice, in_slice = op.out_slice, op.in_slice  # set only on single-part ops
        widths = [width for _, width in op.parts]
        if out_slice is not None:
            widths = [out_slice[1] - out_slice[0]]
        in_features = in_slice[1] - in_slice[0] if in_slice is not None else op.in_features
        rank, starts = self.rank, [sum(widths[:p]) for p in range(len(widths))]
        cols = -(-len(names) * rank // KEY_TILE) * KEY_TILE  # the CPU kernel's vector width
        a = torch.zeros(len(adapters), in_features, cols, dtype=self.dtype)
        b = torch.zeros(len(adapters), cols, sum(widths), dtype=self.dtype)
        for slot, adapter in enumerate(adapters):
            for p, name in enumerate(names):
                if name not in adapter.weights:
                    continue
                lora_a, lora_b = adapter.weights[name]  # [r, in], [out, r]
                if in_slice is not None:
                    lora_a = lora_a[:, in_slice[0] : in_slice[1]]
                if out_slice is not None:
                    lora_b = lora_b[out_slice[0] : out_slice[1]]
                r = lora_a.shape[0]
                a[slot, :, p * rank : p * rank + r] = lora_a.T
                b[slot, p * rank : p * rank + r, starts[p] : starts[p] + widths[p]] = lora_b.T
        return Stack(
            a, b, torch.tensor(starts), torch.tensor(widths), is_partial=in_slice is not None
        )

    def begin_step(self, segments: Iterable[tuple[str | None, int, int]], num_rows: int) -> None:
        """The step's rows: (adapter id or None, first row, end row) per request, applied by its
        forward pass (the runner clears `step` after it)."""
        self.step = None
        slots = None
        for adapter_id, start, end in segments:
            if adapter_id is None:
                continue
            if slots is None:
                slots = torch.full((num_rows,), -1, dtype=torch.int64)
            slots[start:end] = self.slot_of[adapter_id]
            self.held.move_to_end(adapter_id)  # LRU order; slots stay until a restack
        if slots is not None:
            self.step = StepRows(slots, len(self.held))

    def add(self, key: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += the step's adapters' share of op `key`. x: [rows, in], out: [rows, out]."""
        step, stack = self.step, self.stacks.get(key)
        if step is None or stack is None:
            return
        kernels, cols = self.kernels, stack.a.shape[2]
        if (
            kernels is not None
            and not stack.is_partial
            and cols <= MAX_LORA_COLS
            and x.dtype == out.dtype == self.dtype
            and x.stride(1) == out.stride(1) == 1
        ):  # each row its own adapter's product, no padding (lora.inc)
            order, tile_starts = step.tiles
            kernels.lora_add(
                x,
                step.slots,
                order,
                tile_starts,
                stack.a,
                stack.b,
                self.rank,
                stack.col_start,
                stack.col_width,
                out,
            )
            return
        shrunk = x.to(self.dtype) @ stack.a_all  # [rows, slots * K]: every held adapter
        shrunk.mul_(step.mask(cols))  # each row keeps its own adapter's columns
        b = stack.b.view(-1, stack.b.shape[2]).to(out.dtype)
        if stack.is_partial:  # the ranks' shares, summed ([rows, out] alike on every rank)
            delta = shrunk.to(out.dtype) @ b
            torch.distributed.all_reduce(delta)
            out += delta
            return
        out.addmm_(shrunk.to(out.dtype), b)


def linear_modules(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """The names PEFT adapters may target: the model's Linear layers (bitsandbytes' included)
    but its output head, and the projections a fused layer holds -> (in, out)."""
    return {
        part: (module.in_features, out)
        for name, module in _linears(model)
        for part, out in _parts(name, module)
    }


def _linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    ]


def _parts(name: str, module: torch.nn.Linear) -> tuple[tuple[str, int], ...]:
    """(adaptable name, out features) of each projection a Linear computes: several for a
    FusedLinear (services/worker/fused_layers.py: its `parts` are its parent's attributes)."""
    fused = getattr(module, "parts", None)
    if fused is None:
        return ((name, module.out_features),)
    parent = name.rpartition(".")[0]
    return tuple((f"{parent}.{part}" if parent else part, out) for part, out in fused)


HOOKED = "_textgen_lora"  # the model attribute naming the LoraSet its hooks apply


def hook_modules(model: torch.nn.Module, lora: LoraSet) -> None:
    """Apply `lora` inside transformers' modules: a forward hook on each adaptable Linear adds
    its adapters' share to the module's output (in place; the weights are untouched). A model
    is hooked once; a later set (another runner of the same model) takes the hooks over."""
    already = hasattr(model, HOOKED)
    setattr(model, HOOKED, lora)
    if already:
        return
    for name, module in model.named_modules():
        if name not in lora.ops:
            continue

        def hook(_module, args, output, key=name):
            current = getattr(model, HOOKED)
            if current.step is not None:
                x = args[0]
                current.add(key, x.reshape(-1, x.shape[-1]), output.view(-1, output.shape[-1]))

        module.register_forward_hook(hook)


def module_ops(model: torch.nn.Module) -> dict[str, LoraOp]:
    """One op per Linear module (transformers' modules run each on its own; a fused one holds
    several projections); under tensor parallelism each rank's slice of a sharded module
    (transformers' column- and row-wise plans shard weights as DTensors)."""
    ops = {}
    for name, module in _linears(model):
        op = LoraOp(name, _parts(name, module), module.in_features)
        weight: Any = module.weight  # a DTensor under tensor parallelism
        placements = getattr(weight, "placements", None)
        if placements:  # a DTensor: Shard(0) splits the output, Shard(1) the input
            dim = getattr(placements[0], "dim", None)
            world, rank = weight.device_mesh.size(), weight.device_mesh.get_local_rank()
            if dim == 0:
                op = replace(op, out_slice=_chunk(module.out_features, world, rank))
            elif dim in (1, -1):
                op = replace(op, in_slice=_chunk(module.in_features, world, rank))
        ops[name] = op
    return ops


def _chunk(size: int, world: int, rank: int) -> tuple[int, int]:
    """The rank's slice of a dimension split as torch.chunk splits it."""
    step = -(-size // world)
    return min(size, rank * step), min(size, (rank + 1) * step)


def hold_adapters(
    lora: LoraSet | None, scheduled: list[RequestState], requests: dict[str, RequestState]
) -> list[tuple[RequestState, str]]:
    """Hold the adapters of a step's new requests (`requests`: every request the worker holds,
    the step's new ones included); each request whose adapter cannot be held leaves
    `scheduled` and `requests`, returned with the reason."""
    wanting = [s for s in scheduled if s.adapter is not None and s.num_steps == 0]
    in_use = adapters_in_use(requests) if wanting else set()
    refused = []
    for state in wanting:
        assert state.adapter is not None
        try:
            if lora is None:
                raise AdapterLoadError(
                    "this worker group cannot apply LoRA adapters (the per-request fallback "
                    "runners and simulated workers do not)"
                )
            lora.acquire(state.adapter, in_use)
            lora.on_request(state.adapter.name)
        except AdapterLoadError as exc:
            log.warning("request %s refused: %s", state.request_id, exc)
            refused.append((state, str(exc)))
            scheduled.remove(state)
            del requests[state.request_id]
    retain_registered(lora, requests)
    return refused


def adapters_in_use(requests: dict[str, RequestState]) -> set[str]:
    """The ids of the adapters the held requests name: none of them may be evicted."""
    return {s.adapter.id for s in requests.values() if s.adapter is not None}


def retain_registered(lora: LoraSet | None, requests: dict[str, RequestState]) -> None:
    """Drop the adapters that left the registry and no held request uses (at each step, and
    while the worker is idle)."""
    if lora is not None and lora.registered is not None:
        lora.retain(adapters_in_use(requests))
