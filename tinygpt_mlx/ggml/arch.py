"""GGUF metadata -> mlx-lm config, one table row per architecture.

llama.cpp's converter (`convert_hf_to_gguf.py`) writes a model's Hugging Face config as
`{arch}.*` metadata keys and changes a few tensors on the way; each row below names the
mlx-lm module that runs the architecture, the config keys it needs, and the conventions to undo:

- `permute_qk`: llama-family Q/K rows are permuted so that llama.cpp's interleaved RoPE computes
  what Hugging Face's half-split RoPE does; undoing it gives mlx-lm's own layout back.
- `norm_offset`: Gemma stores every RMSNorm weight as 1 + w (its norm multiplies by 1 + w).

What a GGUF does not store (Gemma's query scale, Gemma 3's local RoPE base and window pattern)
is filled by llama.cpp's own rules for that architecture, so both runtimes compute the same model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..errors import ModelFormatError

# GGUF key suffix (after "{arch}.") -> mlx-lm / Hugging Face config key, shared by every row.
COMMON_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}


@dataclass(frozen=True)
class Arch:
    gguf: str                       # general.architecture
    model_type: str                 # the mlx-lm module (mlx_lm.models.<model_type>)
    keys: dict = field(default_factory=dict)       # extra GGUF suffix -> config key
    defaults: dict = field(default_factory=dict)   # config values a GGUF does not store
    permute_qk: bool = False
    norm_offset: float = 0.0
    finish: Optional[Callable[[dict, dict], None]] = None   # (config, metadata) -> fills the rest


def _gemma_query_scale(config: dict, md: dict) -> None:
    # llama.cpp: the 27B models scale queries by 1/sqrt(hidden / heads), the others by
    # 1/sqrt(head_dim); Hugging Face calls the denominator query_pre_attn_scalar.
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    config["head_dim"] = head_dim
    big = config["num_hidden_layers"] in (46, 62)   # Gemma 2 27B, Gemma 3 27B
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                       if big else head_dim)


def _phi3(config: dict, md: dict) -> None:
    config.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))


ARCHES: dict[str, Arch] = {a.gguf: a for a in [
    Arch("llama", "llama", permute_qk=True),
    Arch("mistral", "llama", permute_qk=True),
    Arch("qwen2", "qwen2"),
    Arch("qwen3", "qwen3"),
    Arch("phi3", "phi3", finish=_phi3),
    Arch("gemma2", "gemma2", norm_offset=1.0, finish=_gemma_query_scale,
         keys={"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"}),
    Arch("gemma3", "gemma3_text", norm_offset=1.0, finish=_gemma_query_scale,
         keys={"attention.sliding_window": "sliding_window"},
         defaults={"rope_local_base_freq": 10000.0, "sliding_window_pattern": 6}),
]}


def arch_for(md: dict, source: str) -> Arch:
    name = md.get("general.architecture")
    if name not in ARCHES:
        raise ModelFormatError(f"{source}: GGUF architecture {name!r} is not supported "
                               f"(supported: {', '.join(sorted(ARCHES))})")
    return ARCHES[name]


def scalar(v: Any) -> Any:
    """A metadata value as plain Python: MLX's reader gives 0-d arrays for numbers and arrays
    for lists, ggml's reader numpy values; strings and lists pass through."""
    return v.tolist() if hasattr(v, "tolist") else v


def config_from_metadata(md: dict, arch: Arch, tensor_names: set, source: str) -> dict:
    """The mlx-lm config for this file: the table's keys, the rope scaling, tied embeddings."""
    prefix = arch.gguf + "."
    config: dict[str, Any] = {"model_type": arch.model_type, **arch.defaults}
    for suffix, key in {**COMMON_KEYS, **arch.keys}.items():
        if prefix + suffix in md:
            config[key] = scalar(md[prefix + suffix])
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in md:
        config["vocab_size"] = len(md["tokenizer.ggml.tokens"])
    for needed in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if needed not in config:
            raise ModelFormatError(f"{source}: GGUF metadata lacks {prefix}{COMMON_KEYS_INV.get(needed, needed)}")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("rms_norm_eps", 1e-6)
    if "head_dim" not in config and arch.model_type in ("qwen3",):
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    scaling = rope_scaling(md, prefix)
    if scaling:
        config["rope_scaling"] = scaling
    if arch.finish:
        arch.finish(config, md)
    return config


COMMON_KEYS_INV = {v: k for k, v in COMMON_KEYS.items()}


def rope_scaling(md: dict, prefix: str) -> Optional[dict]:
    kind = scalar(md.get(prefix + "rope.scaling.type", "none"))
    if kind in ("none", None):
        return None
    factor = float(scalar(md.get(prefix + "rope.scaling.factor", 1.0)))
    out: dict[str, Any] = {"type": kind, "rope_type": kind, "factor": factor}
    orig = md.get(prefix + "rope.scaling.original_context_length")
    if orig is not None:
        out["original_max_position_embeddings"] = int(scalar(orig))
    return out


def llama3_rope_scaling(freq_factors: np.ndarray, head_dim: int, theta: float,
                        source: str) -> dict:
    """Llama 3's rope scaling, recovered from the `rope_freqs` tensor llama.cpp stores in its place.

    The tensor holds one divisor per frequency: `factor` for long wavelengths, 1 for short ones and
    a smooth ramp between. The standard parameters (low 1, high 4, original context 8192) are
    checked against it, so a file with other parameters is refused rather than run wrongly.
    """
    factor = float(freq_factors.max())
    for orig in (8192, 4096, 16384, 32768):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
            cand = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig}
            if np.allclose(_llama3_divisors(cand, head_dim, theta), freq_factors, rtol=1e-4):
                return cand
    raise ModelFormatError(f"{source}: rope_freqs does not match Llama 3's rope scaling for any "
                           "standard parameters; this file's rope is not supported")


def _llama3_divisors(p: dict, head_dim: int, theta: float) -> np.ndarray:
    freqs = theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)   # wavelength / 2pi
    wavelen = 2 * np.pi * freqs
    low_wl = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wl = p["original_max_position_embeddings"] / p["high_freq_factor"]
    smooth = ((p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"])
              / (p["high_freq_factor"] - p["low_freq_factor"]))
    mid = 1.0 / ((1 - smooth) / p["factor"] + smooth)
    return np.where(wavelen > low_wl, p["factor"], np.where(wavelen < high_wl, 1.0, mid))
