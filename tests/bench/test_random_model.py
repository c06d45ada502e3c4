"""`--random-model`: a seeded random-weight folder of a named checkpoint's shape, built once."""

from __future__ import annotations

import json

import pytest

from services.bench import random_model
from services.bench.random_model import SHAPES, build_random_model

TINY = {
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def test_builds_the_shape_once_and_it_loads(monkeypatch, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setitem(SHAPES, "tiny", TINY)
    folder = build_random_model("tiny", cache=tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert {k: config[k] for k in TINY if k != "model_type"} == {
        k: v for k, v in TINY.items() if k != "model_type"
    }
    assert config["dtype"] == "bfloat16" and config["eos_token_id"] == 2
    assert list(tmp_path.iterdir()) == [folder]  # no partial folder left behind
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert build_random_model("tiny", cache=tmp_path) == folder  # cached
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("the little girl played with the ball").input_ids
    assert ids[0] == 1 and max(ids) < 1024  # <s> first; the tokenizer covers the first ids
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 2048


def test_unknown_shape_names_the_known_ones():
    with pytest.raises(ValueError, match="smollm2-135m"):
        build_random_model("gpt-5")


def test_default_cache_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert random_model.default_cache() == tmp_path / "textgen" / "random-models"
