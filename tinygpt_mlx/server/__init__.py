"""`posttrainllm serve`: an ollama- and OpenAI-compatible HTTP server with warm KV-cache slots.

app.py (app factory and shared state), routes.py (endpoints), slots.py (warm slot pool),
worker.py (the generation thread: the scheduler, continuous batching), batch.py (one decode
step over several sequences' caches), prompt.py (templates, context fitting),
ollama.py / openai.py (schemas), streams.py (NDJSON / SSE bodies), config.py (defaults).
docs/server.md describes the behaviour and the measurements.

The app factory is `tinygpt_mlx.server.app.create_app`; this package imports nothing, so that
reading `server.config` (the CLI's defaults) does not load the web framework.
"""
