"""--api-key: which requests carry the key (pure).

A request is authorized when no key is set, or when its `Authorization` header is `Bearer
<key>`: the scheme word in any case (RFC 9110), the key byte for byte and compared in
constant time, so neither its case nor the time a comparison takes gives it away.

The routes that run the model or read the chat template check it (POST /, /generate,
/generate_stream, /tokenize, /chat_tokenize, /v1/chat/completions, /v1/completions,
/invocations, /vertex); the probes, /info, /metrics, /v1/models and the API documents stay
open, as in TGI, for load balancers and dashboards: they show no prompt and run nothing.
"""

from __future__ import annotations

import hmac


def is_authorized(api_key: str | None, authorization: str | None) -> bool:
    if not api_key:
        return True
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    # starlette decodes header bytes as latin-1: encoding back gives the bytes sent
    given = token.strip().encode("latin-1", errors="replace")
    return hmac.compare_digest(given, api_key.encode("utf-8"))
