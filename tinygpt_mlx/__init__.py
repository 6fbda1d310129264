"""posttrainllm's library: TinyGPT on MLX and one KV cache whose policies compose
(StreamingLLM eviction x KIVI quantisation x tiered retrieval).

    load(path=None)                         a .tinygpt file or an mlx-lm model directory
                                            (None: the shipped model) -> LoadedModel
    generate_text(loaded, prompt, ...)      the generated text, for either model kind
    stream_text(loaded, prompt, ...)        the same, piece by piece
    make_cache(loaded.model, CacheConfig(...))
                                            a KV cache to pass as `cache=` and inspect after
"""

from .api import generate_text, stream_text
from .cache import KVCache, make_cache
from .config import CacheConfig, ModelConfig, SampleConfig
from .loading import LoadedModel, load

__all__ = ["load", "LoadedModel", "generate_text", "stream_text", "KVCache", "make_cache",
           "CacheConfig", "ModelConfig", "SampleConfig"]
__version__ = "0.1.0"
