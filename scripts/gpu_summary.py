"""The numbers of scripts/gpu_check.sh's reports.jsonl, a line each, for a device run's output
(its files may not all come back).

    python3 scripts/gpu_summary.py DIR/reports.jsonl
"""

from __future__ import annotations

import json
import sys
from typing import Any


def level_line(stage: str, level: dict[str, Any], inprocess_at: int | None) -> str:
    ttft, itl, tpot = level["ttft"], level["itl"], level["tpot"]
    line = (
        f"{stage} c={level['value']}: {level['output_token_throughput']} tok/s, "
        f"TTFT p50/p99 {ttft['p50_ms']}/{ttft['p99_ms']} ms, "
        f"ITL p50/p99 {itl['p50_ms']}/{itl['p99_ms']} ms, TPOT p50 {tpot['p50_ms']} ms"
    )
    if level["value"] == inprocess_at:  # the in-process engine ran at this level's concurrency
        ratio, added = level["ratio_vs"]["inprocess"], level["itl_p50_added_ms"]["inprocess"]
        line += f", server/in-process x{ratio} (ITL p50 {added:+} ms)"
    return line


def engine_lines(stage: str, name: str, run: dict[str, Any]) -> list[str]:
    roofline = run.get("roofline_batch1", {})
    lines = [
        f"{stage} {name}: step {roofline.get('step_ms')} ms (roofline "
        f"{roofline.get('fraction')}), replay {roofline.get('forward_ms')} ms "
        f"({roofline.get('forward_fraction')}), batch-32 step {run.get('decode_batch32_ms')} "
        f"ms, first token {run.get('first_token_ms')} ms, 32 prompts "
        f"{run.get('first_tokens_32_prompts_ms')}"
    ]
    for key in ("batch1_kernels", "batch1_kernels_unsplit"):
        kernels = run.get(key) or []
        attention = [k for k in kernels if k[0].startswith(("_paged", "_merge"))]
        if kernels:
            lines.append(f"{stage} {name} {key} attention: {attention}")
    for path, kernels in (run.get("prompts32_kernels") or {}).items():
        lines.append(f"{stage} {name} 32 prompts by {path}, top kernels: {kernels[:6]}")
    return lines


def main() -> None:
    for raw in open(sys.argv[1]):
        entry = json.loads(raw)
        stage, report = entry["stage"], entry["report"]
        if "levels" in report:
            inprocess = report.get("baselines", {}).get("inprocess")
            at = inprocess["concurrency"] if inprocess else None
            print("\n".join(level_line(stage, level, at) for level in report["levels"]))
            if inprocess:
                rate, itl = inprocess["tokens_per_s"], inprocess["itl"]["p50_ms"]
                print(f"{stage} in-process: {rate} tok/s, ITL p50 {itl} ms")
        for name in ("eager", "compiled", "unfused", "tuned"):  # gpu_compile_ab.py's AB_MODES
            if name in report:
                print("\n".join(engine_lines(stage, name, report[name])))


if __name__ == "__main__":
    main()
