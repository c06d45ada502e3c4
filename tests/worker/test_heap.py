"""The worker's malloc settings (services/worker/heap.py): a step tensor of megabytes comes from
the heap and its pages stay there once freed.

glibc's mallinfo2 sums every arena of the process, so each measurement runs in a fresh Python
with one thread: in the test process, threads left by earlier tests allocate and free while it
measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

ROOT = Path(__file__).resolve().parents[2]

MEASURE = """
import ctypes, json, sys
import torch
torch.set_num_threads(1)
from services.worker import heap

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
          "fordblks", "keepcost")

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]  # glibc 2.33+: each a size_t

try:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
except (OSError, AttributeError):
    print(json.dumps(None))
    sys.exit(0)
mallinfo2.restype = MallInfo2

def snapshot():
    info = mallinfo2()
    return {name: getattr(info, name) for name in FIELDS}

kept = heap.keep_freed_memory() if sys.argv[1] == "keep" else None
before = snapshot()
step = torch.empty(4 << 20, dtype=torch.uint8).fill_(1)  # a prompt step's product
during = snapshot()
del step
after = snapshot()
print(json.dumps({"kept": kept, "before": before, "during": during, "after": after}))
"""


def measure(mode: str) -> dict:
    """mallinfo2 before, during and after a 4 MiB tensor, in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result is None:
        pytest.skip("no glibc 2.33+ mallinfo2 here")
    return result


def test_step_tensors_come_from_the_heap_and_stay_mapped():
    """After keep_freed_memory, a 4 MiB tensor is no mmap of its own and freeing it leaves the
    heap's pages in place (nothing trimmed)."""
    result = measure("keep")
    before, during, after = result["before"], result["during"], result["after"]
    assert result["kept"] is True
    assert during["hblkhd"] == before["hblkhd"]  # no new mmap
    assert during["uordblks"] >= before["uordblks"] + (4 << 20)  # from the heap
    assert after["arena"] >= during["arena"]  # the heap kept its size: nothing returned


def test_without_the_settings_the_tensor_is_an_mmap_of_its_own():
    """The contrast: glibc's defaults serve the same 4 MiB tensor with an mmap, which is
    unmapped when freed, so the next step's tensor lands on fresh pages."""
    result = measure("default")
    before, during, after = result["before"], result["during"], result["after"]
    assert during["hblkhd"] >= before["hblkhd"] + (4 << 20)  # its own mmap
    assert after["hblkhd"] == before["hblkhd"]  # and gone again once freed
