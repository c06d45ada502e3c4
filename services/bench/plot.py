"""`--plot FILE.png`: output tokens/s and p50/p99 latencies against concurrency (closed loop)
and request rate (open loop). matplotlib is optional (the `bench` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MISSING = "--plot needs matplotlib: pip install 'textgen[bench]' (or pip install matplotlib)"


def can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(report: dict[str, Any], path: Path) -> None:
    """One column per mode that ran: throughput on top, latencies (log scale) below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("concurrency", "rate") if any(x["mode"] == m for x in report["levels"])]
    figure, axes = plt.subplots(2, len(modes), figsize=(6 * len(modes), 8), squeeze=False)
    for column, mode in enumerate(modes):
        levels = [x for x in report["levels"] if x["mode"] == mode]
        xs = [x["value"] for x in levels]
        top, bottom = axes[0][column], axes[1][column]
        top.plot(xs, [x["output_token_throughput"] for x in levels], "o-", label="output tok/s")
        top.set_ylabel("output tokens/s")
        twin = top.twinx()
        twin.plot(xs, [x["request_throughput"] for x in levels], "s--", color="gray")
        twin.set_ylabel("requests/s (dashed)")
        top.set_title(f"{Path(report['model']).name}: throughput vs {mode}")
        for metric in ("ttft", "itl", "e2e"):
            for p, style in (("p50", "o-"), ("p99", "x:")):
                values = [x[metric][f"{p}_ms"] for x in levels]
                bottom.plot(xs, values, style, label=f"{metric} {p}")
        bottom.set_yscale("log")
        bottom.set_ylabel("latency (ms)")
        bottom.set_xlabel("concurrent requests" if mode == "concurrency" else "requests/s")
        bottom.legend(fontsize="small", ncol=3)
        for axis in (top, bottom):
            axis.set_xscale("log", base=2)
            axis.set_xticks(xs, [f"{x:g}" for x in xs])
            axis.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
