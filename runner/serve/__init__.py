"""`nibble serve`: the OpenAI API over the engine (api: the wire format, replies: bodies to engine
requests and events to deltas, app: the HTTP routes, server: uvicorn and Ctrl-C)."""
