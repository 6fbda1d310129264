"""posttrainllm's library: TinyGPT on MLX and one KV cache whose policies compose
(StreamingLLM eviction x KIVI quantisation x tiered retrieval)."""

from .cache import KVCache, make_cache
from .config import CacheConfig, ModelConfig, SampleConfig

__all__ = ["KVCache", "make_cache", "CacheConfig", "ModelConfig", "SampleConfig"]
__version__ = "0.1.0"
