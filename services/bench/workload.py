"""What the bench sends: synthetic prompts of seeded random length, or a JSON-lines dataset.

Synthetic prompts are built from common English words (the vocabulary of children's stories,
which every tokenizer covers) and trimmed against the model's tokenizer so each prompt tokenizes
to its drawn length (exactly, where one word is not already longer). Requests are greedy; only
`max_new_tokens` varies."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WORDS = (
    "the a little girl boy named Lily Tom Ben Sue Mom Dad dog cat bird fish tree park sun "
    "moon sky house garden ball kite cake toy box car boat friend day night time happy sad "
    "big small red blue green yellow warm cold fast slow old new good kind funny brave loved "
    "played ran jumped saw found made went said looked smiled laughed helped wanted liked had "
    "was were is and but so then with in on under over near to of for very too all one two "
    "she he they we it her his their together outside inside home school water grass flower "
    "apple bread milk hat shoe door window bed chair table story song game"
).split()


@dataclass(frozen=True)
class Case:
    prompt: str  # text sent as `inputs`
    max_new_tokens: int  # requested output length
    grammar: dict | None = None  # TGI's `grammar` parameter (--constrained-share)
    adapter: str | None = None  # the LoRA adapter it names (--lora); None: the base model


def parse_range(text: str) -> tuple[int, int]:
    """`"32:512"` (or `"32-512"`, or one number) to an inclusive (low, high)."""
    parts = text.replace("-", ":").split(":")
    low, high = int(parts[0]), int(parts[-1])
    if len(parts) > 2 or low < 1 or high < low:
        raise ValueError(f"expected LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def prompt_of_length(
    num_tokens: int, count_tokens: Callable[[str], int], rng: random.Random
) -> str:
    """Words drawn from `rng`: the longest prefix that stays within `num_tokens` tokens (binary
    search: token counts grow with the number of words), then "a"s (one token in any
    vocabulary) until the count is reached. At least one word."""
    words = [rng.choice(WORDS) for _ in range(num_tokens)]  # >= 1 token each
    low, high = 1, len(words)  # find the largest prefix length with count <= num_tokens
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens(" ".join(words[:middle])) <= num_tokens:
            low = middle
        else:
            high = middle - 1
    words = words[:low]
    for _ in range(num_tokens):  # bounded: each "a" adds a token
        if count_tokens(" ".join(words)) >= num_tokens:
            break
        words.append("a")
    return " ".join(words)


def synthetic_workload(
    num_requests: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    count_tokens: Callable[[str], int],
    seed: int,
    shared_prefix_len: int = 0,
) -> list[Case]:
    """`num_requests` cases, prompt and output lengths uniform in their inclusive ranges.
    With `shared_prefix_len`, every prompt starts with the same text of that many tokens (a
    system prompt, a few-shot preamble) and the drawn length is what follows it."""
    rng = random.Random(seed)
    prefix = ""
    if shared_prefix_len:
        prefix = prompt_of_length(shared_prefix_len, count_tokens, random.Random(~seed)) + " "
    cases = []
    for _ in range(num_requests):
        num_input = rng.randint(*input_len_range)
        num_output = rng.randint(*output_len_range)
        cases.append(Case(prefix + prompt_of_length(num_input, count_tokens, rng), num_output))
    return cases


def dataset_workload(path: Path, num_requests: int, default_max_new_tokens: int) -> list[Case]:
    """The first `num_requests` lines of a JSON-lines file of {"prompt", "max_new_tokens"}
    (cycled when the file is shorter); a missing max_new_tokens takes the default."""
    cases = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            cases.append(
                Case(str(row["prompt"]), int(row.get("max_new_tokens", default_max_new_tokens)))
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: expected {{'prompt', 'max_new_tokens'}}") from exc
    if not cases:
        raise ValueError(f"{path}: no requests")
    return [cases[i % len(cases)] for i in range(num_requests)]


def tokenizer_counter(model_dir: Path) -> Callable[[str], int]:
    """Token count of a text with the model's tokenizer.json, as the gateway counts inputs
    (special tokens such as BOS included)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return lambda text: len(tokenizer.encode(text).ids)
