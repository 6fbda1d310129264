"""`posttrainllm serve`: an ollama- and OpenAI-compatible HTTP server with warm KV-cache slots.

app.py (app factory and shared state), routes.py (endpoints), slots.py (warm slot pool),
worker.py (the single generation thread), prompt.py (templates, context fitting),
ollama.py / openai.py (schemas), streams.py (NDJSON / SSE bodies), config.py (defaults).
docs/server.md describes the behaviour and the measurements.
"""

from .app import create_app

__all__ = ["create_app"]
