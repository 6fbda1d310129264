"""TinyGPT: the native decoder-only transformer (RoPE, RMSNorm, grouped-query attention,
gated SiLU MLP), written in mlx-lm's style so the two read alike.

The model knows no tokenizer, no CLI and no cache policy: each attention layer applies RoPE at
`cache.offset`, hands its keys and values to `cache.update_and_fetch`, and attends through the
module-level name `scaled_dot_product_attention`, bound here to `tinygpt_mlx.attention`'s
function: the same protocol as mlx-lm model modules, whose name `attention.install` rebinds. With `ModelConfig.yoco`, layers above the middle one hold no K/V of their own:
they attend to the K/V computed once by the middle layer (YOCO, Sun et al. 2024).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
from mlx.utils import tree_flatten

from .attention import scaled_dot_product_attention
from .config import ModelConfig
from .lazy import lazy

mlx_caches = lazy("mlx_lm.models.cache")   # mlx-lm's own caches (`make_cache`): only when asked for


def count_parameters(model: Any) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, owns_kv: bool = True):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.owns_kv = owns_kv
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        if owns_kv:
            self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
            self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.rope = nn.RoPE(self.head_dim, traditional=False, base=cfg.rope_theta)

    def __call__(self, x: mx.array, mask: Any, cache: Any, offset: int,
                 shared_kv: Optional[tuple] = None) -> tuple[mx.array, tuple]:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=offset)
        if shared_kv is None:
            keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            keys = self.rope(keys, offset=offset)
            if cache is not None:
                keys, values = cache.update_and_fetch(keys, values)
        else:
            keys, values = shared_kv
        out = scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out), (keys, values)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, owns_kv: bool = True):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, owns_kv)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def __call__(self, x, mask, cache, offset, shared_kv=None):
        r, kv = self.attn(self.attn_norm(x), mask, cache, offset, shared_kv)
        h = x + r
        return h + self.mlp(self.mlp_norm(h)), kv


def _mask(cache: Any, L: int) -> Any:
    if cache is not None and hasattr(cache, "make_mask"):
        # keywords as mlx-lm's create_attention_mask passes them: its caches take no defaults
        return cache.make_mask(L, return_array=False, window_size=None)
    return None if L == 1 else "causal"


class Model(nn.Module):
    """The native TinyGPT. `model(tokens, cache)` returns logits [B, L, vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model_type = "tinygpt"
        owner = cfg.kv_owner
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = [TransformerBlock(cfg, owns_kv=owner[i] == i) for i in range(cfg.n_layers)]
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @property
    def kv_owner(self) -> list[int]:
        return self.config.kv_owner

    def __call__(self, inputs: mx.array, cache: Optional[list] = None) -> mx.array:
        return self.head(self.hidden(inputs, cache))

    def hidden(self, inputs: mx.array, cache: Optional[list] = None) -> mx.array:
        """The final norm's output [B, L, d_model]: every layer run, each cache updated; `head`
        gives the logits (`last_logits` applies it at the last position only)."""
        h = self.embed(inputs)
        L = inputs.shape[1]
        owner = self.config.kv_owner
        if cache is None:
            cache = [None] * len(self.layers)
        # All layers see the same positions: read the offset before any layer appends.
        offset = cache[0].offset if cache[0] is not None else 0
        mask = _mask(cache[0], L)
        fetched: dict[int, tuple] = {}
        for i, layer in enumerate(self.layers):
            shared = fetched[owner[i]] if owner[i] != i else None
            # A shared layer holds exactly its owner's tokens, so the owner's mask serves it too.
            h, kv = layer(h, mask, cache[owner[i]], offset, shared)
            fetched.setdefault(i, kv)
        return self.norm(h)

    def head(self, h: mx.array) -> mx.array:
        """The output projection of hidden states [B, L, d_model]: logits [B, L, vocab]."""
        if self.config.tie_embeddings:
            return self.embed.as_linear(h)
        return self.lm_head(h)

    def shard(self, group: Optional[Any] = None) -> None:
        """Tensor parallelism over `group` (mlx.distributed), built as mlx-lm's Llama `shard`:
        q/k/v and the MLP's gate/up projections all-to-sharded (each rank computes its slice of
        the heads / hidden units), o_proj and down_proj sharded-to-all (their outputs are
        all-summed, so every rank holds the full residual stream and the same logits). The
        embedding, the norms and the head stay whole on every rank.

        The split is contiguous: rank r holds query heads [r*H/N, (r+1)*H/N) and KV heads
        [r*Hkv/N, (r+1)*Hkv/N), which is exactly the GQA group of its query heads (query head
        h reads KV head h // (H/Hkv)), so attention needs no communication and each rank's
        cache holds 1/N of the K/V (tinygpt_mlx/distributed.py). A YOCO layer that shares its
        owner's K/V gets the owner's local heads, which match its own local query heads.
        `tinygpt_mlx.distributed.check_shardable` refuses a head count N does not divide."""
        group = group or mx.distributed.init()
        N = group.size()
        cfg = self.config
        for name, n in (("n_kv_heads", cfg.n_kv_heads), ("n_heads", cfg.n_heads), ("d_ff", cfg.d_ff)):
            if n % N:
                raise ValueError(f"cannot shard over {N} ranks: {name} {n} is not a multiple of {N}")
        for layer in self.layers:
            a = layer.attn
            a.q_proj = shard_linear(a.q_proj, "all-to-sharded", group=group)
            if a.owns_kv:
                a.k_proj = shard_linear(a.k_proj, "all-to-sharded", group=group)
                a.v_proj = shard_linear(a.v_proj, "all-to-sharded", group=group)
            a.o_proj = shard_linear(a.o_proj, "sharded-to-all", group=group)
            a.n_heads //= N
            a.n_kv_heads //= N
            m = layer.mlp
            m.gate_proj = shard_linear(m.gate_proj, "all-to-sharded", group=group)
            m.up_proj = shard_linear(m.up_proj, "all-to-sharded", group=group)
            m.down_proj = shard_linear(m.down_proj, "sharded-to-all", group=group)

    def make_cache(self, layer_cache: Optional[Any] = None) -> list:
        """Plain full-precision caches, mlx-lm's own (its convention: one per layer, a shared
        layer holding its owner's); `tinygpt_mlx.make_cache` gives our policies, from this layout
        with `layer_cache()` (a class or function) making each owning layer's in place of mlx-lm's
        `KVCache`."""
        make = layer_cache or mlx_caches.KVCache
        caches: list = []
        for i, owner in enumerate(self.config.kv_owner):
            caches.append(caches[owner] if owner != i else make())
        return caches

    def num_parameters(self) -> int:
        return count_parameters(self)


#: mlx-lm model modules whose `Model.__call__` is its backbone (`self.model(...)`, which ends in
#: the final norm) and then an output head that works position by position (tied or not; Gemma 2's
#: soft cap): `last_logits` applies their head at the last position only. Each is checked against
#: its full call in tests/test_last_logits.py; a module not listed is called whole.
BACKBONE_THEN_HEAD = frozenset(f"mlx_lm.models.{name}" for name in
                               ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"))


class _HeadOnly:
    """An mlx-lm `Model` whose backbone gives `hidden` (already computed) whatever it is called
    with: mlx-lm's own `Model.__call__` run on it applies the output head alone."""

    def __init__(self, model: Any, hidden: mx.array):
        self._model, self._hidden = model, hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    @property
    def model(self) -> Any:
        return _Computed(self._model.model, self._hidden)


class _Computed:
    """A backbone that returns `hidden` when called; every attribute (the tied embedding the
    head reads) is the real backbone's."""

    def __init__(self, backbone: Any, hidden: mx.array):
        self._backbone, self._hidden = backbone, hidden

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backbone, name)


def last_logits(model: Any, tokens: mx.array, cache: Any) -> mx.array:
    """`model(tokens, cache=cache)[:, -1:]`, the logits [B, 1, V] after the last token, with the
    output head computed at that position only: every layer still runs on every token (the
    cache takes them all), but a prefill pass needs no other position's logits, and the head over
    a whole pass is a large part of it (Gemma 3's 262,144-token vocabulary: a 4,096-token prompt
    in 512-token passes prefills in 0.60x the time, docs/gguf.md "Prefill: the output head at the
    last position only"). The native model splits `hidden`/`head`; mlx-lm's
    models in `BACKBONE_THEN_HEAD` run their own head on the last hidden state; any other model
    is called whole and sliced (the same logits, the head's cost kept)."""
    if isinstance(model, Model):
        return model.head(model.hidden(tokens, cache)[:, -1:])
    if type(model).__module__ in BACKBONE_THEN_HEAD:
        hidden = model.model(tokens, cache)[:, -1:]
        return type(model).__call__(_HeadOnly(model, hidden), tokens[:, -1:])
    return model(tokens, cache=cache)[:, -1:]
