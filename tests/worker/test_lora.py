"""LoRA adapters in the worker: each request's greedy output equals transformers + PEFT with its
adapter, alone and in one batch that mixes three adapters and the base model, on the fast CPU
decoder (Llama, fused q/k/v and gate/up) and on transformers' own modules (Llama without the
kernels, its q/k/v and gate/up fused there too: services/worker/fused_layers.py; GPT-NeoX's
own fused query_key_value)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

from services.engine import Engine
from services.worker.loader import load_model
from shared.adapters import make_ref
from shared.messages import AdapterRef
from tests.support.tiny_models import make_tiny_llama
from tests.worker.test_architectures import PAGED, build

PROMPTS = [[1, 17, 40, 9, 33], [1, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95]]
NEW_TOKENS = 10
# (name, peft LoraConfig arguments): ranks, targets, alpha and rsLoRA scaling all differ
ADAPTERS = {
    "llama": [
        ("attn", dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
        ("mlp", dict(r=8, lora_alpha=8, target_modules=["gate_proj", "down_proj", "o_proj"])),
        (
            "all",
            dict(
                r=2,
                lora_alpha=4,
                use_rslora=True,
                target_modules="all-linear",
                rank_pattern={"up_proj": 6},
                alpha_pattern={"k_proj": 12},
            ),
        ),
    ],
    "gpt_neox": [
        ("qkv", dict(r=4, lora_alpha=16, target_modules=["query_key_value"])),
        ("mlp", dict(r=8, lora_alpha=8, target_modules=["dense_h_to_4h", "dense_4h_to_h"])),
        ("all", dict(r=2, lora_alpha=4, use_rslora=True, target_modules="all-linear")),
    ],
}


def make_adapters(base: Path, folder: Path, specs) -> dict[str, AdapterRef]:
    """Random adapters (B not zero: each changes the output) saved as PEFT folders."""
    from peft import LoraConfig, get_peft_model

    refs = {}
    for seed, (name, kwargs) in enumerate(specs):
        torch.manual_seed(100 + seed)
        model = T.AutoModelForCausalLM.from_pretrained(base)
        config = LoraConfig(init_lora_weights=False, **kwargs)
        peft_model = get_peft_model(model, config)
        peft_model.save_pretrained(folder / name)
        refs[name] = make_ref(name, str(folder / name), max_rank=64)
    return refs


def reference(base: Path, adapter: AdapterRef | None) -> list[list[int]]:
    """transformers' greedy generate, with PEFT applying the adapter."""
    from peft import PeftModel

    model = T.AutoModelForCausalLM.from_pretrained(base).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter.path).eval()
    outputs = []
    for ids in PROMPTS:
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


@pytest.fixture(scope="module", params=["llama-fast", "llama-modules", "gpt_neox"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    arch = "gpt_neox" if request.param == "gpt_neox" else "llama"
    if arch == "gpt_neox":
        base = build(root / "base", PAGED["gpt_neox"])
    else:
        base = make_tiny_llama(root / "base")
    refs = make_adapters(base, root / "adapters", ADAPTERS[arch])
    expected = {name: reference(base, ref) for name, ref in refs.items()}
    expected[""] = reference(base, None)
    loaded = load_model(str(base), cpu_kernels=request.param != "llama-modules")
    assert (loaded.decoder is not None) == (request.param == "llama-fast")
    assert loaded.projections_fused == (request.param == "llama-modules")  # q/k/v, gate/up fused
    return loaded, refs, expected


def run(loaded, jobs: list[tuple[str, list[int]]], refs, max_loras=4, engine=None):
    engine = engine or Engine(loaded, num_blocks=128, max_loras=max_loras)
    ids = [
        engine.add(prompt, NEW_TOKENS, adapter=refs.get(name), stop_token_ids=[])
        for name, prompt in jobs
    ]
    engine.run()
    return engine, [engine.take(i).token_ids for i in ids]


def test_each_adapter_alone_equals_peft(setup):
    loaded, refs, expected = setup
    for name in ["", *refs]:
        _, outputs = run(loaded, [(name, p) for p in PROMPTS], refs)
        assert outputs == expected[name], name
    # every adapter changes the output: the comparison above tests the adapters
    assert all(expected[name] != expected[""] for name in refs)


def test_one_batch_mixes_three_adapters_and_the_base_model(setup):
    loaded, refs, expected = setup
    jobs = [(name, p) for p in PROMPTS for name in ["", *refs]]
    engine, outputs = run(loaded, jobs, refs)
    for (name, prompt), output in zip(jobs, outputs, strict=True):
        assert output == expected[name][PROMPTS.index(prompt)], name
    assert max(engine.stats.step_sizes) == len(jobs)  # all in one batch


def test_more_adapters_than_slots_take_turns(setup):
    """Two slots for three adapters: the scheduler never mixes more than two in a step, the
    worker evicts the least recently used, and every output still equals PEFT's."""
    loaded, refs, expected = setup
    jobs = [(name, PROMPTS[0]) for name in refs]
    engine, outputs = run(loaded, jobs, refs, max_loras=2)
    assert outputs == [expected[name][0] for name in refs]
    lora = engine.runner.lora
    assert lora is not None and len(lora.held) == 2


def test_an_unreadable_adapter_fails_its_request_alone(setup, tmp_path):
    loaded, refs, expected = setup
    missing = AdapterRef(name="gone", path=str(tmp_path / "nothing"), id="gone-1")
    engine = Engine(loaded, num_blocks=128)
    bad = engine.add(PROMPTS[0], NEW_TOKENS, adapter=missing)
    good = engine.add(PROMPTS[0], NEW_TOKENS, adapter=next(iter(refs.values())))
    engine.run()
    with pytest.raises(RuntimeError, match="cannot read LoRA adapter 'gone'"):
        engine.take(bad)
    assert engine.take(good).token_ids == next(iter(expected.values()))[0]
    assert engine.scheduler.blocks.num_free_blocks == 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_and_the_torch_path_agree(dtype):
    """lora_add (each row its own adapter's product) against the masked matmuls over every
    held adapter, on a fused op of three parts with rows of two adapters and of none."""
    from services.worker.kernels import load
    from services.worker.lora import LoraOp, LoraSet
    from services.worker.lora_files import Adapter

    kernels = load()
    if kernels is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    torch.manual_seed(0)
    parts = (("q", 64), ("k", 32), ("v", 32))
    op = LoraOp("qkv", parts, 48)
    modules = {name: (48, width) for name, width in parts}

    def adapter(name, rank, targets):
        weights = {
            t: (torch.randn(rank, 48).to(dtype), torch.randn(modules[t][1], rank).to(dtype))
            for t in targets
        }
        return Adapter(AdapterRef(name=name, path="/", id=name), weights, rank)

    lora = LoraSet(2, dtype, modules, {"qkv": op})
    lora.held.update(x=adapter("x", 4, ["q", "v"]), y=adapter("y", 8, ["k"]))
    lora._restack()
    lora.begin_step([("x", 0, 3), (None, 3, 5), ("y", 5, 9)], 9)
    x = torch.randn(9, 48).to(dtype)
    base = torch.randn(9, 128).to(dtype)
    with_torch, with_kernel = base.clone(), base.clone()
    lora.add("qkv", x, with_torch)
    lora.kernels = kernels
    lora.add("qkv", x, with_kernel)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(with_kernel, with_torch, rtol=tolerance, atol=tolerance * 10)
    assert torch.equal(with_kernel[3:5], base[3:5])  # base-model rows untouched
    assert not torch.equal(with_kernel[:3], base[:3])
