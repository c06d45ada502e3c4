"""Tensor-parallel worker groups (`--num-shard N`): N ranks, one process each, one model.

Rank 0 is the worker service: it alone reads the bus. It starts ranks 1..N-1 as child
processes (`textgen worker` with TEXTGEN_SHARD_RANK set), which die with it. All ranks join
one torch.distributed group (NCCL on CUDA, gloo on CPU) and load the model sharded by
transformers' tensor-parallel plan, so each holds its share of the attention heads, the MLP and
the KV cache. For every step rank 0 broadcasts the StepPlan and all ranks run the same forward
pass (the all-reduces inside keep them identical); only rank 0's tokens are published.

A group is the unit of failure: when any rank dies, the others see a collective fail (or rank 0
sees the child exit) and the whole group exits, so the scheduler hands its requests to another
group instead of waiting on a hung collective."""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

import torch

from shared.codec import decode, encode
from shared.messages import StepPlan
from shared.net import free_port

log = logging.getLogger(__name__)

RANK_ENV = "TEXTGEN_SHARD_RANK"  # set in the children: their rank
PORT_ENV = "TEXTGEN_SHARD_PORT"  # the rendezvous port rank 0 chose
# ranks 1.. wait in a collective for the next plan however long the group idles; a dead peer
# fails the collective at once (and rank 0 also watches its children), so this never hangs
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)
STOP = b""  # broadcast instead of a plan: the group is stopping


@dataclass
class Shard:
    rank: int
    world_size: int
    device: torch.device


def shard_rank() -> int:
    """This process's rank: 0 unless started by a rank 0 as one of its shards."""
    return int(os.environ.get(RANK_ENV, "0"))


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ShardProcesses:
    """Rank 0's children, ranks 1..world_size-1: started with this process's own command
    line, killed with it, and fatal to it when one exits unasked."""

    def __init__(self, world_size: int) -> None:
        self.port = free_port()  # the rendezvous of the process group
        self.children: list[subprocess.Popen] = []
        self.is_stopping = False
        for rank in range(1, world_size):
            env = {**os.environ, RANK_ENV: str(rank), PORT_ENV: str(self.port)}
            argv = [sys.executable, "-m", "services.launcher.cli", *sys.argv[1:]]
            self.children.append(subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent))
            log.info("started shard %d/%d (pid %d)", rank, world_size, self.children[-1].pid)

    def watch(self) -> None:
        """Exit this process (the whole group) as soon as a shard exits while serving."""
        for child in self.children:
            threading.Thread(target=self._watch_one, args=(child,), daemon=True).start()

    def _watch_one(self, child: subprocess.Popen) -> None:
        code = child.wait()
        if not self.is_stopping:
            log.critical("shard pid %d exited with code %s: the group stops", child.pid, code)
            os._exit(1)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Tell the shards to stop (a STOP broadcast) and wait for them."""
        self.is_stopping = True
        broadcast_plan(None)
        for child in self.children:
            try:
                child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()


def join_group(rank: int, world_size: int, port: int, device: torch.device) -> Shard:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    log.info("rank %d/%d joined (%s on %s)", rank, world_size, backend, device)
    return Shard(rank, world_size, device)


def broadcast_int(value: int) -> int:
    """Rank 0's value on every rank (e.g. the number of KV blocks, which must agree)."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def broadcast_plan(plan: StepPlan | None) -> StepPlan | None:
    """Rank 0 sends `plan` (None: stop); the others get it."""
    import torch.distributed as dist

    box = [encode(plan) if plan is not None else STOP]
    dist.broadcast_object_list(box, src=0)
    return decode(box[0], StepPlan) if box[0] != STOP else None


def follow(runner) -> None:
    """Ranks 1..N-1: run every plan rank 0 broadcasts until it says stop."""
    while True:
        plan = broadcast_plan(None)
        if plan is None:
            log.info("rank 0 stopped the group")
            return
        runner.execute(plan)
