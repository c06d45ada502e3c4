"""The in-process engine's offline API: text prompts in, texts out, equal to transformers."""

from __future__ import annotations

import torch

from services.engine import Engine
from shared.messages import FinishReason


def test_generate_matches_transformers_for_a_batch_of_text_prompts(stories_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = Engine(str(stories_model), num_blocks=256)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    outputs = engine.generate(prompts, max_new_tokens=24)
    tokenizer = AutoTokenizer.from_pretrained(stories_model)
    reference = AutoModelForCausalLM.from_pretrained(stories_model).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = tokenizer(prompt).input_ids
        expected = reference.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0
        )[0, len(ids) :].tolist()
        assert output.token_ids == expected
        assert output.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert output.finish_reason == FinishReason.LENGTH and output.num_prompt_tokens == len(ids)
    assert max(engine.stats.step_sizes) == 3
    assert engine.scheduler.blocks.num_free_blocks == 256
    # a gap between each two consecutive tokens of a request, none before a first token
    assert len(engine.stats.token_gaps) == 3 * (24 - 1)
    assert all(gap > 0 for gap in engine.stats.token_gaps)
    assert engine.num_unfinished == 0
