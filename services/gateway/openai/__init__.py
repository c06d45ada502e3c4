"""OpenAI's dialect: /v1/chat/completions, /v1/completions, /v1/models; its request bodies and
rules, its answer and chunk shapes, its streams and its error object."""
