"""Frozen configuration dataclasses: the one place where defaults and rules live.

`ModelConfig` describes the native TinyGPT, `CacheConfig` the KV-cache policy (precision x
eviction x retrieval, composed in one object) and `SampleConfig` the decoding settings. Each
validates itself in `__post_init__`, cross-field rules included, and raises `ConfigError` (a
`ValueError`) carrying the bad field's name, so a front end names its own spelling of it. A
`CacheConfig` comes from fields, CLI/HTTP names (`from_flags`) or a policy spec string
(`from_spec`: grammar and label in `policy_spec`); the last two share the precision table
`precision_fields`. Each field's flag, spec part, help and own check are declared once in
`knobs.KNOBS`; `__post_init__` runs those checks, then the rules across fields.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .knobs import (COLD_STORES, DEFAULT_ROPE_MODE, FETCH_FLOOR, GROUP_SIZES, INT4_NEAR_SHARE, INT8_LONG_RESIDUAL, KNOBS, KV_QUANTIZE_CHOICES,
                    LONG_RESIDUAL_SHARE, QUANT_BITS, RETRIEVE_UNITS, RETRIEVED_POSITIONS, ROPE_MODES, SIDE_BITS, STORAGE_DTYPES,
                    SUMMARY_KINDS, check_values)
from .policy_spec import describe, label, spec_flags

__all__ = ["COLD_STORES", "DEFAULT_ROPE_MODE", "RUN_CHOICES", "FETCH_FLOOR", "GROUP_SIZES", "KV_QUANTIZE_CHOICES", "QUANT_BITS", "RETRIEVE_UNITS",
           "RETRIEVED_POSITIONS", "ROPE_MODES", "STORAGE_DTYPES", "SUMMARY_KINDS", "CacheConfig", "ConfigError",
           "ModelConfig", "SampleConfig", "fetch_budget", "field_default", "precision_fields"]


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


def fetch_budget(hot_budget: Optional[int], retrieve_tokens: Optional[int] = None) -> tuple[int, int]:
    """Retrieval's default (tokens fetched per query, pages kept by the coarse pass): a quarter of the
    hot window and as many pages, each at least FETCH_FLOOR (docs/gguf.md: 256 at a 1,024 window)."""
    fetched = retrieve_tokens if retrieve_tokens is not None else max(FETCH_FLOOR, (hot_budget or 0) // 4)
    return fetched, max(FETCH_FLOOR, fetched)


def _positive(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(name, f"must be an integer >= {minimum}, got {value!r}")


def precision_fields(choice: str, keyword: str = "kv_quantize") -> dict[str, Any]:
    """The precision table: a `--kv-quantize` (or `keyword`'s: its knob's `levels`) value -> the
    `CacheConfig` fields it sets ("int4" -> key_bits=value_bits=4, "bf16" -> storage="bf16"). A
    bad value is a ConfigError on `keyword`."""
    table = next(knob.levels for knob in KNOBS if knob.keyword == keyword)
    if choice in table:
        return {"key_bits": table[choice], "value_bits": table[choice]}
    if choice in STORAGE_DTYPES:
        return {"storage": choice}
    raise ConfigError(keyword, f"must be one of {', '.join(STORAGE_DTYPES + tuple(table))}, got {choice!r}")


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
        if unknown := set(d) - {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)


#: fields a command chooses per run, set through another knob's value (`rope_auto`: the rope
#: knob's "auto"), not the policy a cache or its file keeps
RUN_CHOICES = ("rope_auto",)


@dataclass(frozen=True)
class CacheConfig:
    """The KV-cache policy: storage precision x StreamingLLM eviction x tiered retrieval.

    storage      precision of every exact segment (fp32, fp16, bf16)
    key_bits     KIVI bits for keys (quantised per channel), None = exact
    value_bits   KIVI bits for values (quantised per token), None = exact
    group_size   KIVI group G: tokens per key block / channels per value group
    value_group  KIVI: channels per value group where not G (None = G): a group of 64 halves the
                 values' scales and zeros (int2 values: 3 bits a value become 2.5), whose bytes
                 can go to the keys instead (docs/kivi.md)
    residual     KIVI residual R: newest tokens kept exact
    long_residual KIVI: R grows to this from 16x as many tokens stored (None: int8's 64; `exact_residual`)
    exact_topk   KIVI: per query head, the packed tokens with the K highest scores are re-scored
                 and re-valued from an exact shadow copy (0 = off; cache/kivi.py)
    shadow_store where that shadow lives: "disk" (memory-mapped, default) or "ram"
    kivi_sink    KIVI alone (no window, no retrieval): the first N tokens exact (attention sinks),
                 counted in `residual` (same bytes); under StreamingLLM and retrieval `sink` is exact
    rotate       KIVI: quantise keys and values in a randomized Hadamard basis of the head
                 dimension (queries turned alike, the output turned back; cache/kivi.py)
    near, near_bits  KIVI: the newest `near` frozen tokens held at `near_bits` (8, 6 or 4, above the
                 body's), packed again at the body's bits as they age (0 = off; packed.py: NearTier)
    near_share   KIVI: a near tier sized to the context instead, the newest 1/near_share of the
                 frozen tokens (whole groups; 0 = off; None: 8 for int4, else off: `tier_share`)
    sink, window StreamingLLM: keep the first `sink` and the last `window` tokens
    rope_mode    "shifted" (positions are cache slots, the paper) or "absolute"; only with a
                 window or a hot budget, where None means "shifted" (`DEFAULT_ROPE_MODE`, filled
                 in by `__post_init__`); None otherwise. "auto" is taken too: it is stored as
                 "shifted" with `rope_auto` set, and `for_run` decides
    rope_auto    the positions are the run's to choose (`for_run`): absolute for a run that fits
                 the model's trained context, shifted otherwise; a choice, not a policy (not
                 compared, not a prompt-cache file's mismatch)
    hot_budget   retrieval: exact hot window; evicted tokens go to a cold store
    retrieve_tokens, page_size, top_pages, summary, cold_store, cold_bits, cold_path:
                 the cold store (cache/cold.py, docs/retrieval.md); None: `fetch_budget`'s
    cold_ram     the ram store: MiB its cold rows hold in RAM over all layers, the oldest spilled
                 to disk past it (cold_device.py; placement, like cold_store: None = no limit)
    retrieved_position  shifted retrieval: where retrieved tokens sit, "fixed" (all at one
                 slot just before the hot window, InfLLM), "page" (token j of every page at
                 the j-th of `page_size` slots before the hot window: a span keeps its inner
                 distances) or "slots" (in order, in `retrieve_tokens` slots before the hot window)
    retrieve_unit  retrieval: what a query fetches, its `retrieve_tokens` best "tokens" or the
                 `retrieve_tokens // page_size` best pages whole ("spans", InfLLM's blocks);
                 None means "spans", or "tokens" with the `slots` rule (filled in by `__post_init__`)
    index_block  retrieval: pages per block of the two-level page index (block summaries
                 bound their pages'; 0 = always scan every page summary)
    index_expand retrieval: a decode step's two-level index expands index_expand x top_pages
                 blocks (their pages are ranked by their own summaries); a prefill chunk's
                 shared pool, top_pages blocks
    sticky       retrieval: each pass's pool also holds the pages the previous pass's last query
                 picked, so a page being copied stays in reach of the next step's query
    """

    storage: str = "fp32"
    key_bits: Optional[int] = None
    value_bits: Optional[int] = None
    group_size: int = 32
    value_group: Optional[int] = None
    residual: int = 32
    long_residual: Optional[int] = None
    exact_topk: int = 0
    shadow_store: str = "disk"
    kivi_sink: int = 4
    rotate: bool = True
    near: int = 0
    near_bits: int = 8
    near_share: Optional[int] = None
    sink: int = 0
    window: Optional[int] = None
    rope_mode: Optional[str] = None
    hot_budget: Optional[int] = None
    retrieve_tokens: Optional[int] = None
    page_size: int = 8
    top_pages: Optional[int] = None
    summary: str = "minmax"
    cold_store: str = "ram"
    cold_bits: Optional[int] = None
    cold_ram: Optional[int] = None
    cold_path: Optional[str] = None
    retrieved_position: str = "fixed"
    index_block: int = 8
    retrieve_unit: Optional[str] = None
    span_score: str = "max"
    sticky: bool = True
    index_expand: int = 4
    rope_auto: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        # the precision (set through --kv-quantize*), then each field's own values (choices,
        # least value: declared with its flag in knobs.KNOBS), then the rules across fields
        if self.storage not in STORAGE_DTYPES:
            raise ConfigError("storage", f"must be one of {', '.join(STORAGE_DTYPES)}, got {self.storage!r}")
        for name in ("key_bits", "value_bits"):
            bits = getattr(self, name)
            if bits is not None and bits not in SIDE_BITS.values():
                raise ConfigError(name, f"must be one of {', '.join(map(str, SIDE_BITS.values()))}, got {bits!r}")
        check_values({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, ConfigError)
        if self.quantised and self.residual % self.group_size:
            raise ConfigError("residual", f"must be a multiple of {{group_size}} ({self.group_size}), "
                              f"got {self.residual}", ("group_size",))
        if self.value_group is not None and self.value_bits is None:
            raise ConfigError("value_group", "groups quantised values: it needs int* values ({kv_quantize} or "
                              "{kv_quantize_values})", ("kv_quantize", "kv_quantize_values"))
        if self.exact_topk and not self.quantised:
            raise ConfigError("exact_topk", "refines a KIVI cache: it needs int8/int4/int2 keys or values "
                              "({kv_quantize})", ("kv_quantize",))
        if self.shadow_store != "disk" and not self.exact_topk:
            raise ConfigError("shadow_store", "only applies with {exact_topk}", ("exact_topk",))
        if self.near and self.near_share:
            raise ConfigError("near_share", "sizes the near tier to the context: it replaces {near}, not both",
                              ("near",))
        for name in ("near", "near_share"):
            if getattr(self, name) and not self.quantised:
                raise ConfigError(name, "is a KIVI tier: it needs int8/int4/int2 keys or values ({kv_quantize})",
                                  ("kv_quantize",))
            if getattr(self, name) and self.exact_topk:
                raise ConfigError(name, "cannot be combined with {exact_topk} (its shadow refines the packed "
                                  "body alone)", ("exact_topk",))
        if self.long_residual and not self.quantised:
            raise ConfigError("long_residual", "grows KIVI's residual: it needs int8/int4/int2 keys or values "
                              f"({{kv_quantize}}), got {self.long_residual}", ("kv_quantize",))
        for name in ("near", "long_residual"):
            if (getattr(self, name) or 0) % self.group_size:
                raise ConfigError(name, f"must be a multiple of {{group_size}} ({self.group_size}), got "
                                  f"{getattr(self, name)}", ("group_size",))
        if self.long_residual and not self.residual_grows:   # a value that would change nothing
            why = (f"above {{residual}} ({self.residual})" if self.long_residual <= self.residual else
                   f"at most 1/{LONG_RESIDUAL_SHARE} of what the cache holds (sink + {{window}}/{{hot_budget}}: "
                   f"{self.most_held})")
            raise ConfigError("long_residual", f"must be {why} to grow the residual, got {self.long_residual}",
                              ("residual", "window", "hot_budget"))
        if self.near_tier and any(b is not None and b >= self.near_bits for b in (self.key_bits, self.value_bits)):
            own = " for int4's own near tier ({near_share} 0 turns it off)" if self.near_share is None else ""
            raise ConfigError("near_bits", f"must be above the body's bits ({self.key_bits}/{self.value_bits}), "
                              f"got {self.near_bits}{own}", ("near_share",) if own else ())
        if self.window is None and self.sink and self.hot_budget is None:
            raise ConfigError("sink", "needs {window} (a StreamingLLM window) or {hot_budget} (retrieval)",
                              ("window", "hot_budget"))
        if self.cold_ram is not None and (self.hot_budget is None or self.cold_store != "ram"):
            raise ConfigError("cold_ram", "bounds the RAM of retrieval's ram cold store: it needs {hot_budget} "
                              "and {cold_store} ram (the disk store keeps its rows on disk already)",
                              ("hot_budget", "cold_store"))
        if self.hot_budget is not None and self.window is not None:
            raise ConfigError("hot_budget", "cannot be combined with {window}: retrieval and StreamingLLM "
                              "eviction are alternatives", ("window",))
        if self.window is None and self.hot_budget is None:
            if self.rope_mode is not None:
                raise ConfigError("rope_mode", "needs {window} (a StreamingLLM window) or {hot_budget} "
                                  "(retrieval): positions only move under eviction", ("window", "hot_budget"))
        elif self.rope_mode in (None, "auto"):   # frozen: set once, here
            if self.rope_mode == "auto":
                object.__setattr__(self, "rope_auto", True)
            object.__setattr__(self, "rope_mode", DEFAULT_ROPE_MODE)
        if self.rope_auto and self.rope_mode != DEFAULT_ROPE_MODE:
            raise ConfigError("rope_auto", "chooses the positions of {window} or {hot_budget} per run: it needs "
                              "one" if self.rope_mode is None else f"chooses between shifted and absolute per run; "
                              f"rope_mode {self.rope_mode!r} is already chosen", ("window", "hot_budget"))
        if self.exact_topk and self.retrieval and self.rope_mode == "shifted":
            raise ConfigError("rope_mode", "must be absolute for KIVI's exact top-k ({exact_topk}) with retrieval "
                              "({hot_budget}): its shadow keeps keys before RoPE, where the retrieval slots "
                              "move the frozen body's slots (shifted is retrieval's default: set it to absolute)",
                              ("exact_topk", "hot_budget"))
        fetched, pool = fetch_budget(self.hot_budget, self.retrieve_tokens)
        if self.retrieve_tokens is None:   # frozen: set once, here
            object.__setattr__(self, "retrieve_tokens", fetched)
        if self.top_pages is None:
            object.__setattr__(self, "top_pages", pool)
        if self.retrieve_unit is None:   # frozen: set once, here
            object.__setattr__(self, "retrieve_unit", "tokens" if self.retrieved_position == "slots" else "spans")
        if self.retrieve_unit == "spans" and self.retrieved_position == "slots":
            raise ConfigError("retrieve_unit", "spans need {retrieved_position} fixed or page (slots numbers "
                              "single tokens)", ("retrieved_position",))
        for name in _DERIVED:   # worked out before a field above was set: forgotten, worked out anew
            self.__dict__.pop(name, None)

    @functools.cached_property
    def quantised(self) -> bool:
        return self.key_bits is not None or self.value_bits is not None

    @functools.cached_property
    def value_group_size(self) -> int:
        """Channels per value group: `value_group`, or G."""
        return self.value_group or self.group_size

    @functools.cached_property
    def tier_share(self) -> int:   # the near tier's share S in effect: `near_share`, or the precision's
        return self.near_share if self.near_share is not None else self.default_near_share()

    def default_near_share(self) -> int:
        """int4 (4-bit keys and values, no fixed tier or exact top-k) holds its newest 1/8 frozen
        tokens at `near_bits` unless told otherwise (knobs.INT4_NEAR_SHARE, docs/kivi.md); 0 else."""
        plain_int4 = self.key_bits == 4 and self.value_bits == 4 and not self.near and not self.exact_topk
        return INT4_NEAR_SHARE if plain_int4 else 0

    @functools.cached_property
    def grown_residual(self) -> int:   # R on a long context: `long_residual`, or int8's (INT8_LONG_RESIDUAL, up to G)
        int8 = -(-INT8_LONG_RESIDUAL // self.group_size) * self.group_size if self.key_bits == self.value_bits == 8 else 0
        return int8 if self.long_residual is None else self.long_residual

    @functools.cached_property
    def most_held(self) -> Optional[int]:   # tokens the cache can hold: sink + window or hot budget (None: no bound)
        return self.capacity or (self.sink + self.hot_budget if self.retrieval else None)

    @functools.cached_property
    def residual_grows(self) -> bool:   # R can grow: `grown_residual` above it, a cache able to hold 16x that
        return self.residual < self.grown_residual <= (self.most_held or 1 << 62) // LONG_RESIDUAL_SHARE

    def exact_residual(self, stored: int) -> int:
        """KIVI's R once the cache has stored `stored` tokens (its sink counted): `residual`, or
        `grown_residual` from LONG_RESIDUAL_SHARE x that many on (at most 1/16 of them exact)."""
        grows = self.residual_grows and stored >= LONG_RESIDUAL_SHARE * self.grown_residual
        return self.grown_residual if grows else self.residual

    def in_effect(self, name: str) -> Any:   # a field as the cache uses it (`near_share`: `tier_share`...)
        return {"near_share": self.tier_share, "long_residual": self.grown_residual * self.residual_grows}.get(name, getattr(self, name))

    @functools.cached_property
    def near_tier(self) -> bool:   # a KIVI near tier, of `near` tokens or of 1/`tier_share` of the frozen
        return bool(self.near or self.tier_share)

    @functools.cached_property
    def exact_prefix(self) -> int:
        """A full KIVI cache's exact first tokens: `kivi_sink`, 0 under StreamingLLM or retrieval
        (their `sink` plays that part) and for an exact cache."""
        return 0 if self.streaming or self.retrieval or not self.quantised else self.kivi_sink

    @functools.cached_property
    def held_sink(self) -> int:
        """Tokens at the front kept exact in the cache's sink store: StreamingLLM's or
        retrieval's `sink`, or a full KIVI cache's `exact_prefix`."""
        return self.sink if self.streaming or self.retrieval else self.exact_prefix

    @functools.cached_property
    def streaming(self) -> bool:
        return self.window is not None

    @functools.cached_property
    def retrieval(self) -> bool:
        return self.hot_budget is not None

    @functools.cached_property
    def retrieves_per_query(self) -> bool:
        """Shifted retrieval under the `slots` rule: every query numbers its own retrieved tokens,
        so each gets a pool of its own (`ColdStore._retrieve_per_query`) and no pass shares one."""
        return self.retrieval and self.rope_mode == "shifted" and self.retrieved_position == "slots"

    @functools.cached_property
    def retrieved_slots(self) -> int:
        """Shifted retrieval: the most cache slots retrieved tokens take between the sink and
        the hot window (positions.py): 1 (`fixed`), `page_size` (`page`), `retrieve_tokens`
        (`slots`)."""
        return {"fixed": 1, "page": self.page_size}.get(self.retrieved_position, self.retrieve_tokens)

    def prefill_fit(self, context: Optional[int], tokens: int) -> Optional[int]:
        """The widest prefill chunk whose queries stay inside the trained `context` under a
        shifted window or retrieval, once the cache has seen `tokens` in all (None: no limit
        applies). Before a chunk the cache keeps sink (+ retrieved slots) + window - 1 tokens,
        so the chunk's queries sit up to that + the chunk slots from the oldest key they see.
        None too where the policy alone is too wide for the context."""
        if not context or self.rope_mode != "shifted" or tokens <= context:
            return None
        held = self.slot_span - 1
        return context - held if held < context else None

    def for_run(self, context: Optional[int], tokens: int) -> "CacheConfig":
        """The policy for a run of `tokens` in all (prompt + the most it may generate) on a model
        trained on `context`: where the positions are the run's choice (`rope_auto`), original
        positions if the whole run fits the context, none of it ever reaching an untrained
        position (the distances a query sees are the full cache's: docs/gguf.md, the 8K needle
        grid), else shifted; itself otherwise (and where the context is not known)."""
        if self.rope_auto and context and tokens <= context:
            return dataclasses.replace(self, rope_mode="absolute", rope_auto=False)
        return self

    def fitted_chunk(self, chunk: int, context: Optional[int], tokens: int) -> int:
        """`chunk`, or `prefill_fit` where that is narrower (chat, serve and cache-prompt)."""
        fit = self.prefill_fit(context, tokens)
        return chunk if fit is None else min(chunk, fit)

    @functools.cached_property
    def slot_span(self) -> Optional[int]:
        """Shifted positions the stored tokens occupy at most between steps: sink + window
        (StreamingLLM), sink + retrieved slots + hot budget (retrieval); None without eviction."""
        if self.streaming:
            return self.sink + self.window
        if self.retrieval:
            return self.sink + self.retrieved_slots + self.hot_budget
        return None

    @functools.cached_property
    def capacity(self) -> Optional[int]:
        """Stored tokens the StreamingLLM policy allows per layer (None = unbounded)."""
        return None if self.window is None else self.sink + self.window

    def sliding_layer(self, window: int, rope: bool = True) -> "CacheConfig":
        """The cache of a sliding-window layer (Gemma 2/3's local layers) under this policy: an
        exact ring of the layer's own `window` (no sink, no KIVI, no retrieval) in this policy's
        storage, whatever the policy's own window. On frame positions with no sink, query-key
        distances are the positions' (cache/ring.py), so it is the model's absolute sliding
        window; `rope` False (a layer without a RoPE module): absolute positions."""
        return CacheConfig(storage=self.storage, window=window, rope_mode=None if rope else "absolute")

    @classmethod
    def from_flags(cls, kv_quantize: Optional[str] = None, kv_quantize_keys: Optional[str] = None,
                   kv_quantize_values: Optional[str] = None, **kwargs: Any) -> "CacheConfig":
        """Build from CLI/HTTP style names; None means "use the default" for every field.
        `kv_quantize` sets both sides (`precision_fields`); `kv_quantize_keys` /
        `kv_quantize_values` override one side (an exact dtype there means exact)."""
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        for name, value in precision_fields(kv_quantize or "fp32").items():
            kwargs.setdefault(name, value)
        for name, keyword, flag in (("key_bits", "kv_quantize_keys", kv_quantize_keys),
                                    ("value_bits", "kv_quantize_values", kv_quantize_values)):
            if flag is not None:
                kwargs[name] = precision_fields(flag, keyword).get("key_bits")
        return cls(**kwargs)

    @classmethod
    def from_spec(cls, spec: str) -> "CacheConfig":
        """The one policy spec parser (`--modes`, `--policies`, `--baseline`, needle's grid): the
        spec's parts (`policy_spec.spec_flags`, grammar and examples there) through `from_flags`.
        A bad part or config is a ValueError naming the spec."""
        flags = spec_flags(spec)
        try:
            return cls.from_flags(**flags)
        except ValueError as e:
            raise ValueError(f"policy {spec!r}: {e}") from None

    def describe(self) -> dict:
        """The active settings, as shown in banners and JSON reports (`policy_spec.describe`)."""
        return describe(self)

    def label(self) -> str:
        """A short human name for the policy, e.g. 'int4 + sink4/window256 (shifted)'
        (`policy_spec.label`)."""
        return label(self, lambda name: field_default(CacheConfig, name))


#: CacheConfig's derived facts (`streaming`, `retrieval`, `quantised`, `held_sink`...): each worked
#: out once per config on its first read and a plain attribute after (`functools.cached_property`;
#: the config is frozen), so the per-token code that reads them does not re-run them per layer
_DERIVED = tuple(n for n, v in vars(CacheConfig).items() if isinstance(v, functools.cached_property))


def random_seed() -> int:
    """A seed for a run that names none (31 bits, from the OS): drawn once, so that it can be
    printed and given back with --seed (`sample`), or shared by every rank (`distributed`)."""
    return int.from_bytes(os.urandom(4), "little") >> 1


@dataclass(frozen=True)
class SampleConfig:
    """Decoding settings. temperature 0 means greedy."""

    max_tokens: int = 200
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    prefill_chunk: int = 512
    #: the prompt's last tokens prefilled as a pass of their own (`generate.pass_end`); 0 = off
    prefill_tail: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks, long-run memory checks)

    def __post_init__(self) -> None:
        _positive("max_tokens", self.max_tokens, 0)
        if not (self.temperature >= 0):
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        _positive("top_k", self.top_k, 0)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**64):   # what mx.random.key takes
            raise ConfigError("seed", f"must be an integer in [0, 2**64), got {self.seed!r}")
        _positive("prefill_chunk", self.prefill_chunk)
        _positive("prefill_tail", self.prefill_tail, 0)


def field_default(cls: type, name: str) -> Any:
    """The dataclass default of a field, for help texts (one source of truth)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.default
    raise KeyError(name)
