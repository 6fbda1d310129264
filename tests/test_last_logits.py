"""`tinygpt_mlx.model.last_logits`: a prefill pass's logits with the output head at the last position only.

Checked against the model's whole call sliced to its last position (the path it replaces), for
the native model (tied and untied) and for every mlx-lm module in `BACKBONE_THEN_HEAD`, each as
a tiny checkpoint loaded through `loading.load` (our attention installed) and fed through our
caches (Gemma 2, whose soft-capped attention our caches refuse, through mlx-lm's own); and that
the head really sees one position, and that a model of another module is called whole. Under
MLX's own BLAS the two paths give the same bits (checked with `array_equal`); other BLAS libraries
may reorder the head's sums for a one-row product, hence the tolerance there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from conftest import build_mlx_lm_dir, build_native
from tinygpt_mlx import generate
from tinygpt_mlx.model import BACKBONE_THEN_HEAD, last_logits
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.loading import load

#: one config per mlx-lm module the engine knows (`BACKBONE_THEN_HEAD`); `tie` where the
#: module lets the config choose. Gemma 2's soft cap is small here so that it bends the logits.
CONFIGS = {
    "llama": dict(head_dim=16, tie=(True, False)),
    "qwen2": dict(tie=(True, False)),
    "qwen3": dict(head_dim=16, tie=(True, False)),
    "phi3": dict(original_max_position_embeddings=256, tie=(False,)),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                   final_logit_softcapping=0.5, tie=(True,)),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=2,
                        rope_local_base_freq=1000.0, tie=(True, False)),
}
CASES = [(name, tie) for name, c in CONFIGS.items() for tie in c["tie"]]
EXACT = not os.environ.get("LD_PRELOAD")     # MLX's own BLAS: the same bits both ways


def build_dir(path: Path, tokenizer_json: str, model_type: str, tie: bool, seed: int = 0) -> Path:
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    extra = {k: v for k, v in CONFIGS[model_type].items() if k != "tie"}
    config = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "vocab_size": len(vocab) + 1, "max_position_embeddings": 256, "rope_theta": 10000.0,
              "tie_word_embeddings": tie, **extra}
    return build_mlx_lm_dir(path, tokenizer_json, config, seed)


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{'tied' if t else 'untied'}" for n, t in CASES])
def mlx_lm_model(request, tmp_path_factory, tokenizer_json):
    name, tie = request.param
    path = build_dir(tmp_path_factory.mktemp(name) / f"tiny-{name}", tokenizer_json, name, tie)
    return load(path).model


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def native_model(request, tmp_path_factory, tokenizer_json):
    path = build_native(tmp_path_factory.mktemp("native") / "tiny.tinygpt", tokenizer_json,
                        tie_embeddings=request.param)
    return load(path).model


def new_cache(model, config: CacheConfig = CacheConfig()):
    """Our cache for `config`; mlx-lm's own for Gemma 2 (our caches refuse its attention)."""
    if type(model).__module__ == "mlx_lm.models.gemma2":
        from mlx_lm.models.cache import make_prompt_cache
        return make_prompt_cache(model)
    return make_cache(model, config)


def tokens(n: int, start: int = 5) -> mx.array:
    return mx.array([[(start + 7 * i) % 300 + 3 for i in range(n)]])


def passes_both_ways(model, sizes=(9, 1, 20), config=CacheConfig()) -> None:
    """Feed the same passes to two caches, one through `last_logits`, one through the whole call;
    every pass's last logits must agree (so must everything the caches then hold)."""
    a, b = new_cache(model, config), new_cache(model, config)
    start = 5
    for n in sizes:
        ids = tokens(n, start)
        start += n
        fast = last_logits(model, ids, a)
        whole = model(ids, cache=b)[:, -1:]
        assert fast.shape == whole.shape == (1, 1, whole.shape[-1])
        if EXACT:
            assert mx.array_equal(fast, whole).item(), f"pass of {n}: max diff {mx.abs(fast - whole).max().item()}"
        else:
            assert mx.allclose(fast, whole, rtol=1e-5, atol=1e-4).item()
        assert mx.abs(whole).max().item() > 0.1      # logits, not zeros


def test_mlx_lm_modules_match_their_whole_call(mlx_lm_model):
    assert type(mlx_lm_model).__module__ in BACKBONE_THEN_HEAD
    passes_both_ways(mlx_lm_model)


def test_mlx_lm_modules_under_a_window_and_retrieval(mlx_lm_model):
    """The policies that evict as a pass is taken: the backbone updates the cache as before."""
    if type(mlx_lm_model).__module__ == "mlx_lm.models.gemma2":
        pytest.skip("our caches refuse Gemma 2's soft-capped attention (docs/gguf.md)")
    passes_both_ways(mlx_lm_model, (12, 12, 1, 12), CacheConfig(sink=2, window=8))
    passes_both_ways(mlx_lm_model, (12, 12, 1, 12), CacheConfig(sink=2, hot_budget=8, retrieve_tokens=4, page_size=2))


def test_native_model_matches_its_whole_call(native_model):
    passes_both_ways(native_model)


def test_gemma2_soft_cap_is_applied(tmp_path, tokenizer_json):
    """A head that skipped the soft cap would give logits past it: here every one is inside +-0.5."""
    model = load(build_dir(tmp_path / "g2", tokenizer_json, "gemma2", True)).model
    out = last_logits(model, tokens(6), new_cache(model))
    assert mx.abs(out).max().item() <= 0.5
    raw = model.model.embed_tokens.as_linear(model.model(tokens(6), new_cache(model)))
    assert mx.abs(raw).max().item() > 0.5        # the cap binds: without it the test could not fail


def test_the_head_sees_one_position(mlx_lm_model, monkeypatch):
    """The point of it: a 20-token pass projects one hidden state onto the vocabulary, not 20."""
    seen = []
    model = mlx_lm_model
    if "lm_head" in model:
        real_linear = nn.Linear.__call__
        monkeypatch.setattr(nn.Linear, "__call__",
                            lambda self, x: (seen.append(x.shape[1]) if self is model.lm_head else None)
                            or real_linear(self, x))
    else:
        embed = model.model.embed_tokens
        real_as_linear = embed.as_linear
        monkeypatch.setattr(embed, "as_linear", lambda x: seen.append(x.shape[1]) or real_as_linear(x))
    last_logits(model, tokens(20), new_cache(model))
    assert seen == [1], seen


def test_the_native_head_sees_one_position(native_model, monkeypatch):
    seen = []
    real = type(native_model).head
    monkeypatch.setattr(type(native_model), "head", lambda self, h: seen.append(h.shape[1]) or real(self, h))
    last_logits(native_model, tokens(20), new_cache(native_model))
    assert seen == [1], seen


def test_a_module_not_listed_is_called_whole():
    """A model the engine does not know: its own call, sliced, whatever its head does."""
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Embedding(50, 8)

        def __call__(self, x, cache=None):
            h = self.model(x)
            return mx.cumsum(h, axis=1)        # a "head" that mixes positions: slicing first would be wrong

    m = Odd()
    ids = tokens(7, 1) % 50
    assert mx.array_equal(last_logits(m, ids, None), m(ids)[:, -1:]).item()


def test_generate_call_takes_the_last_position_path(native, monkeypatch):
    """`generate.call` (every prefill pass of sample, chat, needle, compare and the server) goes
    through `last_logits` for a pass of several tokens, and gives what the whole call gives."""
    calls = []
    real = generate.last_logits
    monkeypatch.setattr(generate, "last_logits", lambda *a: calls.append(a[1].shape[1]) or real(*a))
    model = native.model
    ids = [int(t) for t in tokens(11)[0].tolist()]
    got = generate.call(model, ids, make_cache(model, CacheConfig()))
    want = model(mx.array([ids]), cache=make_cache(model, CacheConfig()))[0, -1]
    assert calls == [11]
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    generate.call(model, ids[:1], make_cache(model, CacheConfig()))
    assert calls == [11]                 # a one-token call is the whole call (its head is one row anyway)


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_a_packed_tied_head(tmp_path, tokenizer_json, name):
    """A packed model (a GGUF's Q4_0/Q4_1/Q8_0 under `--weights packed`, mlx-lm's quantised
    checkpoints): the tied head is `QuantizedEmbedding.as_linear`, reached through the proxy."""
    model = load(build_dir(tmp_path / name, tokenizer_json, name, True)).model
    nn.quantize(model, group_size=32, bits=4)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) and "lm_head" not in model
    passes_both_ways(model)
