"""Shared fixtures: a seeded tiny native TinyGPT and a tiny mlx-lm Llama, built in tmp dirs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import pytest

TEXT = (
    "The quick brown fox jumps over the lazy dog. In the beginning was the word, and the word "
    "was with the keeper of numbers 0123456789. Café, naïve, 東京 and emoji 🙂 round-trip. "
) * 20


def train_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return tok


@pytest.fixture(autouse=True)
def no_trace_failure():
    """A compiled decode step whose trace fails falls back to eager in production (counted and
    logged, cache/compiled.py); in the tests it is an error."""
    from tinygpt_mlx.cache import compiled

    before = len(compiled.trace_failures)
    yield
    assert compiled.trace_failures[before:] == [], "a compiled decode step's trace failed"


@pytest.fixture(scope="session")
def tokenizer_json() -> str:
    return train_tokenizer().to_str()


def build_native(path: Path, tokenizer_json: str, seed: int = 0, **overrides) -> Path:
    from tinygpt_mlx import format as fmt
    from tinygpt_mlx.config import ModelConfig
    from tinygpt_mlx.model import Model

    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    cfg = dict(vocab_size=len(vocab) + 1, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
               context_length=256)
    cfg.update(overrides)
    mx.random.seed(seed)
    model = Model(ModelConfig(**cfg))
    mx.eval(model.parameters())
    return fmt.save(path, model, tokenizer_json)


@pytest.fixture(scope="session")
def native_path(tmp_path_factory, tokenizer_json) -> Path:
    return build_native(tmp_path_factory.mktemp("native") / "tiny.tinygpt", tokenizer_json)


@pytest.fixture(scope="session")
def native(native_path):
    from tinygpt_mlx.loading import load
    return load(native_path)


@pytest.fixture(scope="session")
def wide_path(tmp_path_factory, tokenizer_json) -> Path:
    """A tiny native model with head_dim 32, so KIVI and mlx-lm's quantised cache apply."""
    return build_native(tmp_path_factory.mktemp("wide") / "wide.tinygpt", tokenizer_json, d_model=128)


@pytest.fixture(scope="session")
def wide(wide_path):
    from tinygpt_mlx.loading import load
    return load(wide_path)


@pytest.fixture(scope="session")
def native32_path(tmp_path_factory, tokenizer_json) -> Path:
    """Head dim 32: KIVI's value groups run along the head dimension and MLX's smallest group is 32."""
    return build_native(tmp_path_factory.mktemp("native32") / "tiny32.tinygpt", tokenizer_json,
                        d_model=128, n_heads=4, n_kv_heads=2, context_length=512)


@pytest.fixture(scope="session")
def native32(native32_path):
    from tinygpt_mlx.loading import load
    return load(native32_path)


def build_mlx_lm_dir(path: Path, tokenizer_json: str, config: dict, seed: int = 0) -> Path:
    """A tiny mlx-lm checkpoint (safetensors + config + tokenizer) of `config["model_type"]`, its
    random weights seeded and widened; a tied config's file has no `lm_head.weight`."""
    import importlib

    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # random init is small; widen it so the tiny model's greedy paths are not all one token
    params = {k: v * 3.0 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
    if config.get("tie_word_embeddings"):
        params.pop("lm_head.weight", None)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(tokenizer_json)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "model_max_length": config["max_position_embeddings"]}))
    return path


def build_llama_dir(path: Path, tokenizer_json: str, seed: int = 0, hidden_size: int = 64, n_layers: int = 2,
                    intermediate_size: int = 128, max_positions: int = 256) -> Path:
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    config = {"model_type": "llama", "hidden_size": hidden_size, "num_hidden_layers": n_layers,
              "intermediate_size": intermediate_size, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "vocab_size": len(vocab) + 1, "max_position_embeddings": max_positions,
              "rope_theta": 10000.0, "tie_word_embeddings": True}
    return build_mlx_lm_dir(path, tokenizer_json, config, seed)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, tokenizer_json) -> Path:
    return build_llama_dir(tmp_path_factory.mktemp("llama") / "tiny-llama", tokenizer_json)


@pytest.fixture(scope="session")
def llama(llama_dir):
    from tinygpt_mlx.loading import load
    return load(llama_dir)


class _MaskOnly:
    """A stand-in cache for one uncached forward: stores nothing, positions from 0, and hands
    the model the given attention mask (as mlx-lm's and our models ask a cache for it)."""
    offset = 0

    def __init__(self, mask):
        self.mask = mask

    def make_mask(self, N, return_array=False, window_size=None):
        return self.mask

    def update_and_fetch(self, keys, values):
        return keys, values


def streaming_reference_logits(model, ids, sink: int, window: int) -> mx.array:
    """StreamingLLM from scratch, no cache: one forward over all of `ids` at their true
    positions where each query i sees the sink (positions < sink) and its last `window`
    positions (i - window < j <= i). fp32 logits [len(ids), V]."""
    n = len(ids)
    q, k = mx.arange(n)[:, None], mx.arange(n)[None]
    mask = (k <= q) & ((k < sink) | (q - k < window))
    return model(mx.array([ids]), cache=[_MaskOnly(mask) for _ in model.layers])[0].astype(mx.float32)


def script_module(name: str):
    """A repository tool in scripts/ (not a package) imported by path, e.g. "structure"."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recorded_bench_caches(loaded, monkeypatch) -> tuple[list, list]:
    """Three of `bench`'s policies' caches (fp32, sink2/window8, int8) over one 20-token prompt,
    and the list `bench.forward` appends each stepped cache's id to."""
    import mlx.core as mx
    from tinygpt_mlx.evaluate import bench
    calls: list = []
    real = bench.forward
    monkeypatch.setattr(bench, "forward", lambda m, t, c: calls.append(id(c)) or real(m, t, c))
    caches = [bench.make_policy(s, loaded.model).make() for s in ("fp32", "sink2/window8", "int8")]
    for cache in caches:
        mx.eval(loaded.model(mx.array([list(range(1, 21))]), cache=cache))
    return calls, caches
