"""TGI's dialect: /generate, /generate_stream, POST /, /tokenize, /chat_tokenize, /info,
/health and friends, SageMaker's /invocations and Vertex's /vertex; TGI's request bodies and
parameter validation (which every dialect's parameters go through) and TGI's answer shapes."""
