"""--quantize: bitsandbytes int8 and nf4 on CPU through the paged engine, greedy-equal to
transformers loaded with the same BitsAndBytesConfig, alone and batched; clear errors for
what cannot load."""

from __future__ import annotations

import pytest
import torch

from services.engine import Engine
from services.worker.quantization import QuantizationError, quantization_config
from tests.support.reference import greedy_continuation

pytest.importorskip("bitsandbytes")

PROMPTS = [[1, 5, 9, 13, 20], [1, 40, 41, 42], [1, *range(60, 90)]]


def hf_quantized(folder, method: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = quantization_config(method, AutoConfig.from_pretrained(folder), torch.float32)
    return AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.float32,
        quantization_config=config,
        device_map="cpu",
        attn_implementation="sdpa",
    ).eval()


@pytest.mark.parametrize(
    ("method", "layer_class"),
    [("bitsandbytes", "Linear8bitLt"), ("bitsandbytes-nf4", "Linear4bit")],
)
def test_greedy_equals_transformers_with_the_same_config(tiny_llama, method, layer_class):
    engine = Engine(str(tiny_llama), num_blocks=64, quantize=method)
    q_proj = engine.loaded.model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == layer_class  # really quantized, not silently full precision
    reference = hf_quantized(tiny_llama, method)
    expected = [greedy_continuation(reference, ids, 12, [2]) for ids in PROMPTS]
    alone = [engine.generate([ids], max_new_tokens=12)[0].token_ids for ids in PROMPTS]
    batched = [out.token_ids for out in engine.generate(PROMPTS, max_new_tokens=12)]
    assert alone == expected
    assert batched == expected
    full_precision = Engine(str(tiny_llama), num_blocks=64).generate(PROMPTS, max_new_tokens=12)
    assert [o.token_ids for o in full_precision] != expected  # the quantization shows


def test_prequantized_methods_need_such_a_checkpoint(tiny_llama):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama)
    for method in ("gptq", "awq"):
        with pytest.raises(QuantizationError, match=f"quantized with {method.upper()}.*has none"):
            quantization_config(method, config, torch.float32)
    with pytest.raises(QuantizationError, match="unknown; choose one of bitsandbytes"):
        quantization_config("int3", config, torch.float32)
    assert quantization_config(None, config, torch.float32) is None


def test_int8_rows_of_one_request_do_not_depend_on_the_others():
    """LLM.int8() computes a column in floating point for every row when any row has an
    outlier there; isolate_int8_rows makes that decision per request."""
    import bitsandbytes as bnb

    from services.worker.int8_rows import isolate_int8_rows

    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 32, bias=False)
    layer = bnb.nn.Linear8bitLt(64, 32, bias=False, has_fp16_weights=False, threshold=6.0)
    layer.load_state_dict(dense.state_dict())
    layer = layer.to("cpu").eval()  # quantizes the weights
    quiet = torch.randn(1, 3, 64).clamp(-2, 2)  # request A: no outliers
    loud = torch.randn(1, 2, 64).clamp(-2, 2)
    loud[0, 0, 5] = 40.0  # request B: an outlier in column 5
    packed = torch.cat([quiet, loud], dim=1)
    with torch.inference_mode():
        alone = layer(quiet)
        assert not torch.equal(layer(packed)[:, :3], alone)  # the batch leaks into A
        segments = isolate_int8_rows(torch.nn.Sequential(layer))
        assert segments is not None
        with segments.active([0, 3, 5]):
            isolated = layer(packed)
        assert torch.equal(isolated[:, :3], alone)
        assert torch.equal(isolated[:, 3:], layer(loud))
    assert isolate_int8_rows(dense) is None  # nothing to isolate in a full-precision layer
    assert isolate_int8_rows(None) is None  # the simulated worker has no model


def test_qlora_an_adapter_on_an_nf4_base_equals_peft(tiny_llama, tmp_path):
    """QLoRA: a LoRA adapter over the bitsandbytes nf4 base, alone and batched with the base
    model, equals transformers (same BitsAndBytesConfig) + PEFT."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from shared.adapters import make_ref

    torch.manual_seed(7)
    config = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    get_peft_model(base, config).save_pretrained(tmp_path / "qlora")
    ref = make_ref("qlora", str(tmp_path / "qlora"), max_rank=64)
    peft = PeftModel.from_pretrained(hf_quantized(tiny_llama, "bitsandbytes-nf4"), ref.path)
    expected = [greedy_continuation(peft.eval(), ids, 12, [2]) for ids in PROMPTS]
    base_expected = [
        greedy_continuation(hf_quantized(tiny_llama, "bitsandbytes-nf4"), ids, 12, [2])
        for ids in PROMPTS
    ]
    assert expected != base_expected  # the adapter shows
    engine = Engine(str(tiny_llama), num_blocks=64, quantize="bitsandbytes-nf4")
    ids = [engine.add(p, 12, adapter=ref) for p in PROMPTS]
    ids += [engine.add(p, 12) for p in PROMPTS]
    engine.run()
    outputs = [engine.take(i).token_ids for i in ids]
    assert outputs == expected + base_expected
