"""Frozen configuration dataclasses: the one place where defaults live.

`ModelConfig` describes the native TinyGPT, `CacheConfig` the KV-cache policy (precision x
eviction x retrieval, composed in one object) and `SampleConfig` the decoding settings. Each
validates itself in `__post_init__` and raises `ConfigError` (a `ValueError`) that carries the
bad field's name, so that a front end can name its own spelling of it (the CLI names the flag).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

STORAGE_DTYPES = ("fp32", "fp16", "bf16")
QUANT_BITS = {"int8": 8, "int4": 4, "int2": 2}
KV_QUANTIZE_CHOICES = STORAGE_DTYPES + tuple(QUANT_BITS)
ROPE_MODES = ("shifted", "absolute")
SUMMARY_KINDS = ("minmax", "mean", "hybrid")
COLD_STORES = ("ram", "disk")
RETRIEVED_POSITIONS = ("fixed", "slots")


class ConfigError(ValueError):
    """A bad configuration value. `field` is the field (or `CacheConfig.from_flags` keyword) at
    fault; `problem` is the message without it, where `{other}` stands for another field the
    message refers to (listed in `related`). `str(e)` names fields as they are spelt here;
    `describe(name)` spells them with `name(field)` instead, e.g. as command-line flags."""

    def __init__(self, field: str, problem: str, related: tuple[str, ...] = ()):
        self.field, self.problem, self.related = field, problem, tuple(related)
        super().__init__(f"{field} {self.describe()}")

    def describe(self, name=lambda field: field) -> str:
        text = self.problem
        for other in self.related:
            text = text.replace("{" + other + "}", name(other))
        return text


def _positive(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(name, f"must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a native TinyGPT (decoder-only, RoPE, RMSNorm, GQA, gated MLP)."""

    vocab_size: int
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    d_ff: int = 768
    context_length: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    # YOCO-style sharing: layers above `n_layers // 2` reuse the K/V of layer n_layers // 2.
    yoco: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "context_length"):
            _positive(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dimension must be even for RoPE")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("rope_theta and norm_eps must be positive")
        if self.yoco and self.n_layers < 2:
            raise ValueError("yoco needs at least 2 layers")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_owner(self) -> list[int]:
        """For each layer, the index of the layer whose K/V it attends to."""
        if not self.yoco:
            return list(range(self.n_layers))
        mid = self.n_layers // 2
        return [i if i <= mid else mid for i in range(self.n_layers)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)


@dataclass(frozen=True)
class CacheConfig:
    """The KV-cache policy: storage precision x StreamingLLM eviction x tiered retrieval.

    storage      precision of every exact segment (fp32, fp16, bf16)
    key_bits     KIVI bits for keys (quantised per channel), None = exact
    value_bits   KIVI bits for values (quantised per token), None = exact
    group_size   KIVI group G: tokens per key block / channels per value group
    residual     KIVI residual R: newest tokens kept exact
    exact_topk   KIVI: per query head, the packed tokens with the K highest scores are re-scored
                 and re-valued from an exact shadow copy (0 = off; cache/kivi.py)
    shadow_store where that shadow lives: "disk" (memory-mapped, default) or "ram"
    sink, window StreamingLLM: keep the first `sink` and the last `window` tokens
    rope_mode    "shifted" (positions are cache slots, the paper) or "absolute"
    hot_budget   retrieval: exact hot window; evicted tokens go to a cold store
    retrieve_tokens, page_size, top_pages, summary, cold_store, cold_bits, cold_path:
                 the cold store (tinygpt_mlx/cache/retrieval.py, docs/retrieval.md)
    retrieved_position  shifted retrieval: where retrieved tokens sit, "fixed" (all at one
                 slot just before the hot window, InfLLM) or "slots" (in order, in
                 `retrieve_tokens` slots before the hot window)
    index_block  retrieval: pages per block of the two-level page index (block summaries
                 bound their pages'; 0 = always scan every page summary)
    """

    storage: str = "fp32"
    key_bits: Optional[int] = None
    value_bits: Optional[int] = None
    group_size: int = 32
    residual: int = 32
    exact_topk: int = 0
    shadow_store: str = "disk"
    sink: int = 0
    window: Optional[int] = None
    rope_mode: str = "shifted"
    hot_budget: Optional[int] = None
    retrieve_tokens: int = 64
    page_size: int = 8
    top_pages: int = 64
    summary: str = "hybrid"
    cold_store: str = "ram"
    cold_bits: Optional[int] = None
    cold_path: Optional[str] = None
    retrieved_position: str = "fixed"
    index_block: int = 32

    def __post_init__(self) -> None:
        if self.storage not in STORAGE_DTYPES:
            raise ConfigError("storage", f"must be one of {', '.join(STORAGE_DTYPES)}, got {self.storage!r}")
        for name in ("key_bits", "value_bits"):
            bits = getattr(self, name)
            if bits is not None and bits not in QUANT_BITS.values():
                raise ConfigError(name, f"must be 8, 4 or 2, got {bits!r}")
        _positive("group_size", self.group_size)
        _positive("residual", self.residual, 0)
        if self.quantised and self.residual % self.group_size:
            raise ConfigError("residual", f"must be a multiple of {{group_size}} ({self.group_size}), "
                              f"got {self.residual}", ("group_size",))
        _positive("exact_topk", self.exact_topk, 0)
        if self.exact_topk and not self.quantised:
            raise ConfigError("exact_topk", "refines a KIVI cache: it needs int8/int4/int2 keys or values "
                              "({kv_quantize})", ("kv_quantize",))
        if self.shadow_store not in COLD_STORES:
            raise ConfigError("shadow_store", f"must be one of {', '.join(COLD_STORES)}, got {self.shadow_store!r}")
        if self.shadow_store != "disk" and not self.exact_topk:
            raise ConfigError("shadow_store", "only applies with {exact_topk}", ("exact_topk",))
        _positive("sink", self.sink, 0)
        if self.window is not None:
            _positive("window", self.window)
        elif self.sink and self.hot_budget is None:
            raise ConfigError("sink", "needs {window} (a StreamingLLM window) or {hot_budget} (retrieval)",
                              ("window", "hot_budget"))
        if self.rope_mode not in ROPE_MODES:
            raise ConfigError("rope_mode", f"must be one of {', '.join(ROPE_MODES)}, got {self.rope_mode!r}")
        if self.hot_budget is not None:
            _positive("hot_budget", self.hot_budget)
            if self.window is not None:
                raise ConfigError("hot_budget", "cannot be combined with {window}: retrieval and StreamingLLM "
                                  "eviction are alternatives", ("window",))
        for name in ("retrieve_tokens", "page_size", "top_pages"):
            _positive(name, getattr(self, name))
        _positive("index_block", self.index_block, 0)
        if self.summary not in SUMMARY_KINDS:
            raise ConfigError("summary", f"must be one of {', '.join(SUMMARY_KINDS)}, got {self.summary!r}")
        if self.cold_store not in COLD_STORES:
            raise ConfigError("cold_store", f"must be one of {', '.join(COLD_STORES)}, got {self.cold_store!r}")
        if self.retrieved_position not in RETRIEVED_POSITIONS:
            raise ConfigError("retrieved_position", f"must be one of {', '.join(RETRIEVED_POSITIONS)}, "
                              f"got {self.retrieved_position!r}")
        if self.cold_bits is not None and self.cold_bits not in (8, 4):
            raise ConfigError("cold_bits", f"must be 8 or 4, got {self.cold_bits!r}")

    @property
    def quantised(self) -> bool:
        return self.key_bits is not None or self.value_bits is not None

    @property
    def streaming(self) -> bool:
        return self.window is not None

    @property
    def retrieval(self) -> bool:
        return self.hot_budget is not None

    @property
    def capacity(self) -> Optional[int]:
        """Stored tokens the StreamingLLM policy allows per layer (None = unbounded)."""
        return None if self.window is None else self.sink + self.window

    @classmethod
    def from_flags(cls, kv_quantize: Optional[str] = None, kv_quantize_keys: Optional[str] = None,
                   kv_quantize_values: Optional[str] = None, **kwargs: Any) -> "CacheConfig":
        """Build from CLI/HTTP style names; None means "use the default" for every field."""
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        choice = kv_quantize or "fp32"
        if choice not in KV_QUANTIZE_CHOICES:
            raise ConfigError("kv_quantize", f"must be one of {', '.join(KV_QUANTIZE_CHOICES)}, got {choice!r}")
        if choice in QUANT_BITS:
            kwargs.setdefault("key_bits", QUANT_BITS[choice])
            kwargs.setdefault("value_bits", QUANT_BITS[choice])
        else:
            kwargs.setdefault("storage", choice)
        for name, keyword, flag in (("key_bits", "kv_quantize_keys", kv_quantize_keys),
                                    ("value_bits", "kv_quantize_values", kv_quantize_values)):
            if flag is None:
                continue
            if flag in QUANT_BITS:
                kwargs[name] = QUANT_BITS[flag]
            elif flag in STORAGE_DTYPES:
                kwargs[name] = None
            else:
                raise ConfigError(keyword, f"must be one of {', '.join(KV_QUANTIZE_CHOICES)}, got {flag!r}")
        return cls(**kwargs)

    def describe(self) -> dict:
        """The active settings, as shown in banners and JSON reports."""
        d: dict[str, Any] = {"storage": self.storage}
        if self.quantised:
            d.update(kivi={"key_bits": self.key_bits, "value_bits": self.value_bits,
                           "group_size": self.group_size, "residual": self.residual})
            if self.exact_topk:
                d["kivi"].update(exact_topk=self.exact_topk, shadow_store=self.shadow_store)
        if self.streaming:
            d.update(streaming_llm={"sink": self.sink, "window": self.window,
                                    "rope_mode": self.rope_mode})
        if self.retrieval:
            d.update(retrieval={"hot_budget": self.hot_budget, "sink": self.sink,
                                "retrieve_tokens": self.retrieve_tokens,
                                "page_size": self.page_size, "top_pages": self.top_pages,
                                "summary": self.summary, "cold_store": self.cold_store,
                                "cold_bits": self.cold_bits, "rope_mode": self.rope_mode,
                                "retrieved_position": self.retrieved_position,
                                "index_block": self.index_block})
        return d

    def label(self) -> str:
        """A short human name for the policy, e.g. 'int4 + sink4/window256 (shifted)'."""
        if self.quantised:
            kb = f"int{self.key_bits}" if self.key_bits else self.storage
            vb = f"int{self.value_bits}" if self.value_bits else self.storage
            prec = kb if kb == vb else f"K {kb} / V {vb}"
            if self.exact_topk:
                where = "" if self.shadow_store == "disk" else f", {self.shadow_store} shadow"
                prec += f" (exact top-{self.exact_topk}{where})"
        else:
            prec = self.storage
        parts = [prec]
        if self.streaming:
            parts.append(f"StreamingLLM sink {self.sink} + window {self.window} ({self.rope_mode} RoPE)")
        if self.retrieval:
            parts.append(f"retrieval hot {self.hot_budget} + top {self.retrieve_tokens} tokens")
        return " + ".join(parts)


@dataclass(frozen=True)
class SampleConfig:
    """Decoding settings. temperature 0 means greedy."""

    max_tokens: int = 200
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    prefill_chunk: int = 512
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks, long-run memory checks)

    def __post_init__(self) -> None:
        _positive("max_tokens", self.max_tokens, 0)
        if not (self.temperature >= 0):
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        _positive("top_k", self.top_k, 0)
        _positive("prefill_chunk", self.prefill_chunk)


def field_default(cls: type, name: str) -> Any:
    """The dataclass default of a field, for help texts (one source of truth)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.default
    raise KeyError(name)
