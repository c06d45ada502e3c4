"""Constrained decoding in the worker (the in-process engine: the real scheduler and runner).

Every output under a JSON schema parses and validates (jsonschema), every output under a
regex matches it, every choice is one of the choices: greedy and sampled at temperature 1
with several seeds, on the random tiny Llama and on stories260k (which never writes JSON by
itself). Unconstrained requests batched with constrained ones still equal transformers'
greedy output token for token. A grammar that compiles slowly delays only its request; one
that fails or times out fails only its request; a resumed request's matcher is rebuilt from
the tokens it had generated.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from services.engine.engine import Engine
from shared.grammar import choice_constraint, json_schema_constraint, make_constraint
from shared.messages import ConstraintKind, FinishReason, SamplingParams
from tests.support.reference import greedy_continuation, reference_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "pets": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["cat", "dog"]},
                    "legs": {"type": "integer", "minimum": 0, "maximum": 4},
                },
                "required": ["kind", "legs"],
                "additionalProperties": False,
            },
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "mood", "pets", "address"],
    "additionalProperties": False,
}
FLAGS = {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "boolean"}}
REGEXES = [r"[0-9]{3}-[a-z]{2,5}", r"(yes|no|maybe)!", r"[A-Z][a-z]{1,6} (the|a) [a-z]{1,5}\."]
CHOICES = ["red", "green", "blue sky", "日本"]
SEEDS = range(6)


def sampling(constraint, seed: int | None) -> SamplingParams:
    if seed is None:
        return SamplingParams(constraint=constraint)
    return SamplingParams(constraint=constraint, do_sample=True, temperature=1.0, seed=seed)


@pytest.fixture(scope="module", params=["tiny_llama", "stories_model"])
def engine(request) -> Engine:
    return Engine(request.getfixturevalue(request.param), max_batch_size=64)


def run_all(engine: Engine, constraint, max_new_tokens: int = 200):
    """One greedy and len(SEEDS) sampled generations, all in one batch."""
    seeds = [None, *SEEDS]
    prompt = engine.tokenizer.encode("Once upon a time").ids
    request_ids = [engine.add(prompt, max_new_tokens, sampling(constraint, seed)) for seed in seeds]
    engine.run()
    return [engine.take(request_id) for request_id in request_ids]


@pytest.mark.parametrize("schema", [PERSON, FLAGS], ids=["nested", "array"])
def test_every_json_output_validates(engine, schema):
    for output in run_all(engine, json_schema_constraint(schema)):
        assert output.finish_reason == FinishReason.EOS_TOKEN, output.text
        jsonschema.validate(json.loads(output.text), schema)


@pytest.mark.parametrize("pattern", REGEXES)
def test_every_regex_output_matches(engine, pattern):
    for output in run_all(engine, make_constraint(ConstraintKind.REGEX, pattern), 60):
        assert output.finish_reason == FinishReason.EOS_TOKEN
        assert re.fullmatch(pattern, output.text), output.text


def test_every_choice_output_is_a_choice(engine):
    outputs = run_all(engine, choice_constraint(CHOICES), 20)
    assert all(output.text in CHOICES for output in outputs), [o.text for o in outputs]


def test_unconstrained_requests_in_a_constrained_batch_equal_transformers(tiny_llama):
    engine = Engine(tiny_llama, max_batch_prefill_tokens=64)
    prompts = [engine.tokenizer.encode(f"the cat sat {i} on the mat").ids for i in range(6)]
    constrained = [
        engine.add(prompts[0], 300, sampling(json_schema_constraint(PERSON), seed))
        for seed in (None, 1, 2)
    ]
    plain = [engine.add(prompt, 30) for prompt in prompts]
    engine.run()
    model = reference_model(tiny_llama)
    for request_id, prompt in zip(plain, prompts, strict=True):
        assert engine.take(request_id).token_ids == greedy_continuation(model, prompt, 30, [2])
    for request_id in constrained:
        jsonschema.validate(json.loads(engine.take(request_id).text), PERSON)


def test_a_slow_compile_delays_only_its_request(tiny_llama):
    engine = Engine(tiny_llama)
    grammar = engine.runner.grammar
    compile_ = grammar.build
    release = threading.Event()

    def slow(constraint):
        release.wait(10)
        return compile_(constraint)

    grammar.build = slow
    prompt = engine.tokenizer.encode("the dog ran").ids
    waiting = engine.add(prompt, 40, sampling(json_schema_constraint(FLAGS), None))
    plain = engine.add(prompt, 8)
    for _ in range(40):  # the plain request finishes while the grammar compiles
        engine.step()
    ended = {request.request_id for request in engine.ended}
    assert plain in ended and waiting not in ended
    assert len(engine.take(plain).token_ids) == 8
    release.set()
    engine.run()
    output = engine.take(waiting)
    jsonschema.validate(json.loads(output.text), FLAGS)


def test_a_compile_timeout_or_error_fails_only_its_request(tiny_llama):
    engine = Engine(tiny_llama)
    grammar = engine.runner.grammar
    grammar.compile_timeout_s = 0.2
    compile_ = grammar.build
    grammar.build = lambda constraint: time.sleep(1.0) or compile_(constraint)
    prompt = engine.tokenizer.encode("the dog ran").ids
    timed_out = engine.add(prompt, 20, sampling(make_constraint(ConstraintKind.REGEX, "a+"), None))
    plain = engine.add(prompt, 30)
    engine.run()
    with pytest.raises(RuntimeError, match="did not compile within 0.2 s"):
        engine.take(timed_out)
    assert engine.take(plain).token_ids == greedy_continuation(
        reference_model(tiny_llama), prompt, 30, [2]
    )
    grammar.build = compile_
    broken = engine.add(prompt, 20, sampling(make_constraint(ConstraintKind.REGEX, "(a"), None))
    fine = engine.add(prompt, 20, sampling(make_constraint(ConstraintKind.REGEX, "b+"), None))
    engine.run()
    with pytest.raises(RuntimeError, match="could not be built"):
        engine.take(broken)
    assert re.fullmatch("b+", engine.take(fine).text)


def test_a_resumed_request_continues_its_grammar(stories_model):
    """After preemption or failover a request arrives with its generated tokens: the matcher
    consumes them, and the rest of the output completes the same document."""
    constraint = json_schema_constraint(PERSON)
    engine = Engine(stories_model)
    prompt = engine.tokenizer.encode("Once upon a time").ids
    whole = engine.generate([prompt], 200, sampling(constraint, 3))[0]
    for cut in (1, 5, len(whole.token_ids) // 2):
        request_id = engine.add(
            prompt, 200, sampling(constraint, 3), generated_ids=whole.token_ids[:cut]
        )
        engine.run()
        assert whole.token_ids[:cut] + engine.take(request_id).token_ids == whole.token_ids


def test_constrained_requests_survive_preemption_and_skip_speculation(tiny_llama):
    """A KV cache too small for the batch preempts requests (recomputed later from their
    tokens, matcher rebuilt); with --speculate, constrained requests get no proposals and
    plain greedy ones still do."""
    engine = Engine(tiny_llama, num_blocks=24, block_size=16, speculate=3)
    prompt = engine.tokenizer.encode("the cat sat on the mat").ids
    constrained = [
        engine.add(prompt, 250, sampling(json_schema_constraint(PERSON), seed))
        for seed in (None, 1, 2, 3, 4)
    ]
    plain = engine.add(prompt, 40)
    engine.run()
    assert engine.scheduler.counters.num_preempted > 0
    for request_id in constrained:
        jsonschema.validate(json.loads(engine.take(request_id).text), PERSON)
    expected = greedy_continuation(reference_model(tiny_llama), prompt, 40, [2])
    assert engine.take(plain).token_ids == expected
    assert engine.stats.num_draft_tokens > 0
