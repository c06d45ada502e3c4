"""n-gram (prompt lookup) speculation: propose the tokens that followed the latest earlier
occurrence of the request's last few tokens. Repetitive text (code, extraction, quoting the
prompt) continues that way often, so one forward pass over the proposals can confirm several
tokens; the runner verifies them greedily (services.worker.runner), so output never changes."""

from __future__ import annotations

MAX_NGRAM = 3  # longest suffix looked up; longer matches are tried first
MIN_NGRAM = 1


def propose(token_ids: list[int], max_tokens: int) -> list[int]:
    """Up to `max_tokens` tokens that followed the most recent earlier occurrence of the
    longest matching suffix (MAX_NGRAM down to MIN_NGRAM tokens); [] when none matches."""
    if max_tokens <= 0:
        return []
    length = len(token_ids)
    for n in range(min(MAX_NGRAM, length - 1), MIN_NGRAM - 1, -1):
        suffix = token_ids[length - n :]
        # latest start first, never the suffix itself
        for start in range(length - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                follow = token_ids[start + n : start + n + max_tokens]
                if follow:
                    return follow
    return []


def accepted(drafts: list[int], verified: list[int]) -> list[int]:
    """The tokens a step emits: `verified[j]` is the greedy token after the request's last
    real token followed by drafts[:j]; each draft counts while it equals the greedy token
    before it, and the greedy token after the last counted draft comes too."""
    out = [verified[0]]
    for j, draft in enumerate(drafts):
        if draft != out[-1]:
            break
        out.append(verified[j + 1])
    return out
