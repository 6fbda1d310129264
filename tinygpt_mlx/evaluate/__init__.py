"""Evaluation: what a cache policy costs (bench) and what it changes (compare, perplexity).

compare.py     greedy prefix match against the fp32 full cache
perplexity.py  teacher-forced perplexity through the cached path, KL and top-1 to a baseline
bench.py       prefill/decode speed and cache bytes per context, beside mlx-lm's caches
modes.py       policy spec strings ("int4", "int8+sink4/window256", ...) -> CacheConfig
"""

from . import bench, compare, modes, perplexity
from .compare import prefix_match
from .modes import parse_policies, parse_policy
from .perplexity import PerplexityResult

__all__ = ["bench", "compare", "modes", "perplexity", "prefix_match", "parse_policy",
           "parse_policies", "PerplexityResult"]
