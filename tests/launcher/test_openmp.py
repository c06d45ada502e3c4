"""shared.openmp: the spin-wait a core-sharing worker gets, unless the user chose one, the
threads each of several worker processes gets, and the CPU lists of --worker-cpus."""

from __future__ import annotations

import os
import threading

import pytest

from shared.openmp import (
    IO_CPUS_ENV,
    SPINCOUNT,
    cpu_list,
    move_to_io_cpus,
    parse_cpus,
    share_cores,
    share_threads,
    split_cpus,
)


def test_sets_the_spincount():
    env = {"PATH": "/bin"}
    assert share_cores(env) is True
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": SPINCOUNT}


@pytest.mark.parametrize(
    ("name", "value"), [("GOMP_SPINCOUNT", "0"), ("OMP_WAIT_POLICY", "ACTIVE")]
)
def test_a_users_choice_wins(name, value):
    env = {name: value}
    assert share_cores(env) is False
    assert env == {name: value}


@pytest.mark.parametrize(
    ("num_cpus", "num_processes", "threads"), [(2, 2, 1), (16, 4, 4), (6, 4, 1), (2, 3, 1)]
)
def test_several_workers_split_the_cpus(num_cpus, num_processes, threads):
    env = {"PATH": "/bin"}
    assert share_threads(env, num_cpus, num_processes) == threads
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": str(threads)}


def test_one_worker_or_a_users_thread_count_is_left_alone():
    env = {"PATH": "/bin"}
    assert share_threads(env, 8, 1) is None and env == {"PATH": "/bin"}
    env = {"OMP_NUM_THREADS": "3"}
    assert share_threads(env, 8, 2) is None and env == {"OMP_NUM_THREADS": "3"}


@pytest.mark.parametrize(
    ("text", "cpus"), [("0", {0}), ("0-3,8", {0, 1, 2, 3, 8}), (" 2 , 4-5", {2, 4, 5})]
)
def test_cpu_lists_read_as_taskset_does(text, cpus):
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1-", "0,,1"])
def test_malformed_cpu_lists_are_refused(text):
    with pytest.raises(ValueError, match="bad CPU"):
        parse_cpus(text)


def test_cpu_lists_written_back_with_ranges():
    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert cpu_list(parse_cpus("3,1-2")) == "1-3"


def test_the_split_gives_the_others_what_the_workers_leave():
    assert split_cpus("0-5", available=set(range(8))) == ({0, 1, 2, 3, 4, 5}, {6, 7})
    with pytest.raises(ValueError, match="CPU 9, not available here"):
        split_cpus("8-9", available=set(range(9)))
    with pytest.raises(ValueError, match="leaves no CPU for the other services"):
        split_cpus("0-1", available={0, 1})


def test_a_split_workers_event_loop_moves_to_the_io_cpus():
    assert move_to_io_cpus({}) is None
    target = min(os.sched_getaffinity(0))
    seen = {}

    def event_loop_thread():  # a thread of its own: the test's threads keep their CPUs
        seen["moved"] = move_to_io_cpus({IO_CPUS_ENV: str(target)})
        seen["affinity"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=event_loop_thread)
    thread.start()
    thread.join()
    assert seen == {"moved": {target}, "affinity": {target}}
