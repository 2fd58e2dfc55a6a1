"""`nibble serve`: the OpenAI API over the engine (api: the wire format, replies: bodies to engine
requests and events to deltas, app: the HTTP routes, server: uvicorn and Ctrl-C)."""

# Where `nibble serve` listens, and `nibble ps` asks, unless told otherwise
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
