"""`--worker-cpus`: the bench on the same CPU split as the server it launches.

The launched workers compute on the given CPUs and the control plane runs on the others
(`textgen launch --worker-cpus`). The bench follows the split so that every side of a
comparison computes on the same CPUs: the in-process engine, transformers and the ceiling run
on the workers' CPUs with as many torch threads, and the load generator, like any client of
the server, runs on the others.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from shared.openmp import cpu_list, split_cpus

log = logging.getLogger(__name__)


class Placement:
    def __init__(self, worker_cpus: str | None = None) -> None:
        """ValueError when `worker_cpus` is malformed, unavailable or leaves no CPU over."""
        self.worker_cpus = worker_cpus  # as given; None: no split, everything shares
        self.split = None if worker_cpus is None else split_cpus(worker_cpus)

    def launch_args(self) -> list[str]:
        """The flags that give a launched server the same split."""
        return [] if self.worker_cpus is None else ["--worker-cpus", self.worker_cpus]

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Torch work in the block runs on the workers' CPUs, with one thread per CPU."""
        if self.split is None:
            yield
            return
        import torch

        threads_before = torch.get_num_threads()
        with _on(self.split[0]):
            torch.set_num_threads(len(self.split[0]))
            try:
                yield
            finally:
                torch.set_num_threads(threads_before)

    @contextmanager
    def client(self) -> Iterator[None]:
        """The load generator in the block runs on the control plane's CPUs."""
        if self.split is None:
            yield
            return
        with _on(self.split[1]):
            yield


@contextmanager
def _on(cpus: set[int]) -> Iterator[None]:
    """This thread on `cpus` for the block (OpenMP's pool follows: its threads are only used
    up to torch's thread count, set by the caller)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    log.debug("bench thread on CPUs %s", cpu_list(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
