"""CPU placement of a worker's OpenMP threads (`textgen launch`, the bench's baselines).

Two ways to live beside the control plane on a CPU host. Shared cores (the default): the
spin-wait below. Split cores (`--worker-cpus`): the workers compute on their CPUs; the gateway,
schedulers, Redis and the workers' event loops run on the others (`split_cpus`,
`move_to_io_cpus`), like vLLM's CPU backend, which binds its OpenMP threads and leaves cores
to the serving process.

A forward pass's OpenMP threads meet at a barrier after every parallel op; a thread that
arrives first spins (GNU libgomp: GOMP_SPINCOUNT iterations, 300,000 by default, a few
milliseconds) before it sleeps. On a host where the gateway, the scheduler and Redis run on
the same cores, that spinning holds a core they need while the thread they preempted is
the one everyone waits for. 2,000 iterations (tens of microseconds) still covers the gap
between two ops of a forward pass and frees the core for longer waits: measured with
`textgen bench --rounds 5` on a 2-core host, the server's inter-token latency p50 over the
in-process engine's went from +4.0/+5.6 ms to +3.4/+4.2 ms. It must be in the environment
before torch is imported (libgomp reads it once, when it loads)."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

IO_CPUS_ENV = "TEXTGEN_WORKER_IO_CPUS"  # launch --worker-cpus: where a worker's event loop runs
SPINCOUNT = "2000"  # iterations a libgomp thread spins at a barrier before sleeping
USER_CHOICES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # a user's own setting wins


def share_cores(env: MutableMapping[str, str] = os.environ) -> bool:
    """Set GOMP_SPINCOUNT in `env` unless the user chose a spin or wait policy; True when
    set."""
    if any(name in env for name in USER_CHOICES):
        return False
    env["GOMP_SPINCOUNT"] = SPINCOUNT
    return True


def share_threads(env: MutableMapping[str, str], num_cpus: int, num_processes: int) -> int | None:
    """Set OMP_NUM_THREADS in `env` to each worker process's share of `num_cpus` when
    `num_processes` of them compute (groups x ranks), unless the user set it; the threads each
    gets, or None when nothing was set. torch sizes a process's pool to every CPU it may use,
    so N workers on those CPUs would run N pools on them: on 2 cores, `textgen launch
    --num-groups 2` made 204 tok/s with a pool of 2 per worker and 278 with 1 (SmolLM2-135M's
    shape, 16 streams)."""
    if num_processes < 2 or "OMP_NUM_THREADS" in env:
        return None
    threads = max(1, num_cpus // num_processes)
    env["OMP_NUM_THREADS"] = str(threads)
    return threads


def parse_cpus(text: str) -> set[int]:
    """CPUs in taskset -c syntax ("0-3,8"); ValueError when malformed or empty."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high if sep else low)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: use numbers and ranges, e.g. 0-3,8") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part.strip()!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return cpus


def split_cpus(worker_cpus: str, available: set[int] | None = None) -> tuple[set[int], set[int]]:
    """(the workers' CPUs, the others' CPUs) out of `available` (default: this process's);
    ValueError when the list names a CPU not available or leaves none for the others."""
    available = os.sched_getaffinity(0) if available is None else available
    workers = parse_cpus(worker_cpus)
    if not workers <= available:
        missing, usable = cpu_list(workers - available), cpu_list(available)
        raise ValueError(f"--worker-cpus names CPU {missing}, not available here ({usable})")
    others = available - workers
    if not others:
        raise ValueError(f"--worker-cpus {worker_cpus} leaves no CPU for the other services")
    return workers, others


def cpu_list(cpus: set[int]) -> str:
    """`cpus` in taskset -c syntax, ranges joined: {0, 1, 2, 5} -> "0-2,5"."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and parts[-1].split("-")[-1] == str(cpu - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)


def move_to_io_cpus(env: Mapping[str, str] = os.environ) -> set[int] | None:
    """A split worker (`textgen launch --worker-cpus`): the calling thread, its event loop
    (heartbeats, the metrics endpoint), onto the control plane's CPUs, once its torch thread
    (and so OpenMP's pool) exists on the workers'. None when the launcher did not split the
    CPUs."""
    text = env.get(IO_CPUS_ENV)
    if not text:
        return None
    cpus = parse_cpus(text)
    os.sched_setaffinity(0, cpus)
    return cpus
