"""The worker's malloc settings (services/worker/heap.py): a step tensor of megabytes comes from
the heap and its pages stay there once freed."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from services.worker import heap


class MallInfo2(ctypes.Structure):
    _fields_ = [  # glibc's struct mallinfo2 (2.33+): every field a size_t
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )  # fmt: skip
    ]


def mallinfo2():
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        pytest.skip("no glibc 2.33+ mallinfo2 here")
    function.restype = MallInfo2
    return function()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_step_tensors_come_from_the_heap_and_stay_mapped():
    """After keep_freed_memory, a 4 MiB tensor (a prompt step's product) is no mmap of its own
    (glibc's default threshold starts at 128 KiB), and freeing it leaves the heap's pages in
    place (nothing trimmed)."""
    assert heap.keep_freed_memory()
    before = mallinfo2()
    step = torch.empty(4 << 20, dtype=torch.uint8).fill_(1)
    during = mallinfo2()
    assert during.hblkhd == before.hblkhd  # no new mmap
    assert during.uordblks >= before.uordblks + (4 << 20)  # from the heap
    del step
    after = mallinfo2()
    assert after.arena >= during.arena  # the heap kept its size: nothing returned
