"""posttrainllm's library: TinyGPT on MLX and one KV cache whose policies compose
(StreamingLLM eviction x KIVI quantisation x tiered retrieval).

    load(model=None, weights="auto")        a .tinygpt file, a GGUF file, an mlx-lm model directory,
                                            an ollama name or a Hugging Face repo id
                                            (None: the shipped model) -> LoadedModel
    generate_text(loaded, prompt, ...)      the generated text, for either model kind
    stream_text(loaded, prompt, ...)        the same, piece by piece
    make_cache(loaded.model, CacheConfig(...))
                                            a KV cache to pass as `cache=` and inspect after
    save_prompt_cache(path, cache, loaded, tokens, logits) / load_prompt_cache(path, loaded)
                                            prefill once, continue many times (prompt-cache files)

The names above are imported on first use (PEP 562): `import tinygpt_mlx.config` (the CLI's
option help) must not pull in MLX's model code, whose mlx-lm import costs seconds.
"""

import importlib
from typing import Any

_EXPORTS = {"load": "loading", "LoadedModel": "loading", "generate_text": "api", "stream_text": "api",
            "KVCache": "cache", "make_cache": "cache",
            "save_prompt_cache": "cache", "load_prompt_cache": "cache",
            "CacheConfig": "config", "ModelConfig": "config", "SampleConfig": "config"}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tinygpt_mlx' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
