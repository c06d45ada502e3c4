"""`textgen bench --lora N`: requests spread over N LoRA adapters, and what that costs.

The adapters are random PEFT adapters of the model (rank `--lora-rank`, every linear layer
of the decoder adapted, B not zero), built once into the cache. The launched server
registers them (`--lora-adapters`, `--max-loras N`) and each case names one, round robin.
With `--compare-lora`, each server first runs the levels once, unmeasured, on other prompts
(a fresh server's first requests pay one-time costs: oneDNN kernels built per shape, first
touches; the measured prompts would then hit the prefix cache); then each closed-loop level
also runs:

- `base`: the same prompts on the base model alone (same server);
- `one_per_step`: the same adapters on a second server launched with `--max-loras 1`, so each
  step serves one adapter's requests (serving the adapters one batch per adapter).

The report gives output throughput of each and the ratios mixed / base and
mixed / one_per_step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from services.bench.random_model import default_cache
from services.bench.workload import Case


def adapter_folders(model_dir: Path, count: int, rank: int) -> dict[str, str]:
    """`count` random adapters of the model (name -> folder), built on first use into
    ~/.cache/textgen/lora-adapters (the model's folder may be read-only)."""
    digest = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:8]
    root = default_cache().parent / "lora-adapters" / f"{model_dir.name}-{digest}-r{rank}"
    folders = {f"lora{i}": root / f"lora{i}" for i in range(count)}
    missing = [
        name for name, folder in folders.items() if not (folder / "adapter_config.json").is_file()
    ]
    if missing:
        _build(model_dir, {name: folders[name] for name in missing}, rank)
    return {name: str(folder) for name, folder in folders.items()}


def _build(model_dir: Path, folders: dict[str, Path], rank: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for name, folder in folders.items():
        torch.manual_seed(int(name.removeprefix("lora")) + 1)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False
        )
        get_peft_model(model, config).save_pretrained(str(folder))


def launch_args(folders: dict[str, str], max_loras: int) -> list[str]:
    spec = ",".join(f"{name}={folder}" for name, folder in folders.items())
    return ["--lora-adapters", spec, "--max-loras", str(max_loras)]


def spread(cases: list[Case], names: list[str]) -> list[Case]:
    """The cases, each naming an adapter in turn."""
    return [dataclasses.replace(c, adapter=names[i % len(names)]) for i, c in enumerate(cases)]


def compare(mixed: list[dict], base: list[dict], one_per_step: list[dict]) -> dict[str, Any]:
    """Per level: output tok/s of the three runs and the ratios the goal is stated in."""
    levels = []
    for m, b, o in zip(mixed, base, one_per_step, strict=True):
        tok = m["output_token_throughput"]
        levels.append(
            {
                "level": m["level"] if "level" in m else f"{m['mode']}={m['value']:g}",
                "tokens_per_s_mixed": tok,
                "tokens_per_s_base": b["output_token_throughput"],
                "tokens_per_s_one_per_step": o["output_token_throughput"],
                "mixed_over_base": _ratio(tok, b["output_token_throughput"]),
                "mixed_over_one_per_step": _ratio(tok, o["output_token_throughput"]),
            }
        )
    return {"levels": levels}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def format_lora(section: dict[str, Any]) -> list[str]:
    return [
        f"lora {level['level']}: {level['tokens_per_s_mixed']:.1f} tok/s mixed adapters, "
        f"{level['tokens_per_s_base']:.1f} base alone (x{level['mixed_over_base']}), "
        f"{level['tokens_per_s_one_per_step']:.1f} one adapter per step "
        f"(x{level['mixed_over_one_per_step']})"
        for level in section["levels"]
    ]
