import pytest

from services.gateway.pipeline.tokenizer import IncrementalDetokenizer, TextTokenizer

TEXTS = [
    "Once upon a time there was a little girl named Lily.",
    "  leading spaces and\ttabs\nnew lines",
    "multi-byte: café, naïve, 日本語, emoji 🐱🐶!",
]


def detokenize(tokenizer: TextTokenizer, prompt: str, generated: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt))
    texts = [detok.add(token_id) for token_id in generated]
    texts[-1] += detok.flush()
    return texts


@pytest.fixture(params=["tiny", "stories"])
def tokenizer(request, tokenizer_dir, stories_model) -> TextTokenizer:
    folder = tokenizer_dir if request.param == "tiny" else stories_model
    return TextTokenizer.from_folder(folder)


@pytest.mark.parametrize("text", TEXTS)
def test_concatenation_equals_decode(tokenizer, text):
    prompt = "The story begins"
    full = tokenizer.encode(prompt + " " + text)
    prompt_ids = tokenizer.encode(prompt)
    assert full[: len(prompt_ids)] == prompt_ids
    generated = full[len(prompt_ids) :]
    texts = detokenize(tokenizer, prompt, generated)
    expected = tokenizer.decode(full)[len(tokenizer.decode(prompt_ids)) :]
    assert "".join(texts) == expected
    assert expected.endswith(text.rstrip()[-3:])


def test_multibyte_is_held_until_complete(tokenizer):
    generated = tokenizer.encode("日本語🐱")[1:]  # drop BOS
    texts = detokenize(tokenizer, "x", generated)
    assert "\ufffd" not in "".join(texts)
    assert "".join(texts).strip() == "日本語🐱"
    if len(generated) > 4:  # split into byte pieces: some tokens had to wait
        assert "" in texts


def test_special_tokens_have_their_content_and_stay_out_of_text(tokenizer):
    ids = tokenizer.encode("hello world")[1:]
    eos = 2
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("say"))
    texts = [detok.add(i) for i in ids] + [detok.add(eos)]
    assert texts[-1] == "</s>" and tokenizer.is_special(eos)
    assert "".join(texts[:-1]).strip() == "hello world"


def test_spans_have_byte_offsets(tokenizer):
    text = "café world"
    spans = tokenizer.spans(text)
    assert spans[0].id == 1 and spans[0].text == "<s>" and (spans[0].start, spans[0].stop) == (0, 0)
    assert max(span.stop for span in spans) == len(text.encode("utf-8"))
    assert [s.id for s in spans] == tokenizer.encode(text)
    assert [s.id for s in tokenizer.spans(text, truncate=2)] == tokenizer.encode(text)[-2:]


def test_truncate_keeps_last_tokens(tokenizer):
    ids = tokenizer.encode("the cat sat on the big red tree")
    assert tokenizer.encode("the cat sat on the big red tree", truncate=3) == ids[-3:]


@pytest.mark.parametrize("text", TEXTS)
def test_peek_gives_the_text_add_would_give(tokenizer, text):
    """An alternative token's text (top tokens) is decoded where the chosen token is: the same
    id gets the same text, its leading space included, however it is asked for."""
    ids = tokenizer.encode(text)[1:]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("The story begins"))
    for token_id in ids:
        peeked = detok.peek(token_id)
        assert detok.peek(token_id) == peeked  # peeking changes nothing
        added = detok.add(token_id)
        # a piece of a character: "" while it streams, U+FFFD for an alternative
        assert added == peeked or (added == "" and peeked.endswith("\ufffd"))
    prompt_ids = tokenizer.encode("hello")
    after_space = tokenizer.encode("hello there")[len(prompt_ids)]  # the token of " there"
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    assert detok.peek(after_space).startswith(" ")  # the space a standalone decode drops
