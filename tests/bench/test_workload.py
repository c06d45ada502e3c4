"""Synthetic prompts tokenize to their drawn lengths (the real stories260k tokenizer); output
lengths stay in range; datasets are read and cycled."""

from __future__ import annotations

import json
import random

import pytest

from services.bench.workload import (
    dataset_workload,
    parse_range,
    prompt_of_length,
    synthetic_workload,
    tokenizer_counter,
)


@pytest.fixture(scope="module")
def count_tokens(stories_model):
    return tokenizer_counter(stories_model)


def test_lengths_in_range(count_tokens):
    cases = synthetic_workload(40, (16, 300), (8, 64), count_tokens, seed=5)
    lengths = [count_tokens(case.prompt) for case in cases]
    assert all(16 <= n <= 300 for n in lengths), lengths
    assert all(8 <= case.max_new_tokens <= 64 for case in cases)
    assert len(set(lengths)) > 20  # mixed, not one length
    assert max(lengths) - min(lengths) > 150


def test_each_prompt_hits_its_drawn_length(count_tokens):
    for target in (6, 17, 128, 500):
        cases = synthetic_workload(3, (target, target), (4, 4), count_tokens, seed=target)
        for case in cases:
            assert count_tokens(case.prompt) == target


def test_seeded(count_tokens):
    first = synthetic_workload(5, (10, 50), (1, 9), count_tokens, seed=1)
    assert first == synthetic_workload(5, (10, 50), (1, 9), count_tokens, seed=1)
    assert first != synthetic_workload(5, (10, 50), (1, 9), count_tokens, seed=2)


def test_parse_range():
    assert parse_range("32:512") == (32, 512)
    assert parse_range("32-512") == (32, 512)
    assert parse_range("7") == (7, 7)
    for bad in ("0:4", "9:3", "1:2:3"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_dataset_cycles_and_defaults(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "Once upon a time", "max_new_tokens": 12}, {"prompt": "The dog"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    cases = dataset_workload(path, 5, default_max_new_tokens=30)
    assert [c.max_new_tokens for c in cases] == [12, 30, 12, 30, 12]
    assert cases[1].prompt == "The dog"
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        dataset_workload(path, 1, 30)


def test_shared_prefix_starts_every_prompt(count_tokens):
    cases = synthetic_workload(6, (8, 24), (4, 4), count_tokens, seed=3, shared_prefix_len=100)
    prefix = prompt_of_length(100, count_tokens, random.Random(~3)) + " "
    assert count_tokens(prefix.rstrip()) == 100
    for case in cases:
        assert case.prompt.startswith(prefix)
        # the prefix, then the drawn length (one BOS between them, the joining space)
        assert 100 + 8 - 2 <= count_tokens(case.prompt) <= 100 + 24 + 1
    assert len({case.prompt for case in cases}) == 6
    assert synthetic_workload(6, (8, 24), (4, 4), count_tokens, seed=3) != cases
