"""`workbench serve`: an OpenAI-compatible chat endpoint whose every conversation is a live trace.

- `server.Server`: load nothing itself; wires a model and tokenizer to the worker and the ASGI app
  and runs uvicorn (what the command line does); `Server.start_in_thread()` for tests and benchmarks.
- `app.create_app`: the Starlette application (routes, Host/Origin guard, API key, streaming).
- `worker.EngineWorker`: the one thread that runs the model, request after request.
- `prefix_cache`: exact prefix reuse across a conversation's turns (LRU within a memory budget).
- `protocol`: the OpenAI wire format (request checks, bodies, OpenAI-style errors).
"""
