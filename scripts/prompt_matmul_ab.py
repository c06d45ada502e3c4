"""Prompt chunks' bfloat16 matmuls three ways, timed in turns:
`python scripts/prompt_matmul_ab.py [--rows 512,1024,2048]`.

SmolLM2-135M's four packed matmuls of 30 layers at each row count:
- own: textgen's kernel as this host builds it (AMX tiles, or AVX512-BF16 without them);
- unpacked: what PackedLinear runs past the AMX kernel's row limit (packed_linear.AMX_MAX_ROWS):
  the weight unpacked at every call, then F.linear (oneDNN); off AMX, F.linear on the plain
  weight (there is no unpack: the own kernel takes every row count);
- reordered: oneDNN on a weight reordered for it once (torch.ops.mkldnn._reorder_linear_weight),
  which PackedLinear could keep beside the packed one, at the cost of a second copy.
Prints each way's median and its ratio to the own kernel's (kernel_ab.compare): the numbers
behind the AMX row limits, and whether a kept oneDNN copy would pay on this host."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from kernel_ab import HIDDEN, LAYERS, MATMULS, compare

from services.worker import kernels
from services.worker.huge_pages import HugePageArena


def runs(ops: kernels.CpuKernels, rows: int) -> tuple[list[str], list]:
    matmul = ops.matmul
    arena = HugePageArena()  # the packed weights on huge pages, as the worker keeps them
    layers = []
    for _ in range(LAYERS):
        layer = []
        for n, k in MATMULS:
            weight = (torch.randn(n, k) * 0.02).bfloat16()
            reordered = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
            layer.append((n, k, weight, arena.keep(matmul.pack(weight)), reordered))
        layers.append(layer)
    inputs = {k: torch.randn(rows, k).bfloat16() for _, k in MATMULS}

    def own() -> torch.Tensor:
        for layer in layers:
            for n, k, _, packed, _ in layer:
                out = matmul.linear(inputs[k], packed, None, n)
        return out

    def unpacked() -> torch.Tensor:
        for layer in layers:
            for n, k, weight, packed, _ in layer:
                plain = matmul.unpack(packed, n, k) if matmul.has_amx else weight
                out = F.linear(inputs[k], plain)
        return out

    def reordered() -> torch.Tensor:
        for layer in layers:
            for _, k, _, _, onednn in layer:
                out = torch.ops.mkldnn._linear_pointwise(inputs[k], onednn, None, "none", [None], "")
        return out

    names = [f"own ({matmul.kind(torch.bfloat16)})", "unpacked, F.linear", "reordered once"]
    return names, [own, unpacked, reordered]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="512,1024,2048", help="row counts")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    ops = kernels.load()
    weight = torch.zeros(MATMULS[0], dtype=torch.bfloat16)
    if ops is None or not ops.matmul.takes(weight):
        raise SystemExit("no bfloat16 matmul of textgen's own on this host")
    print(f"{torch.get_num_threads()} threads, kernels {ops.level}, {HIDDEN} wide")
    for rows in (int(r) for r in args.rows.split(",")):
        names, timed = runs(ops, rows)
        compare(f"{rows} rows", names, timed, args.rounds)


if __name__ == "__main__":
    main()
