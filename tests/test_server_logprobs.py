"""Token log-probabilities over HTTP: OpenAI chat (`logprobs`, `top_logprobs`), legacy
completions (`logprobs: N`) and ollama (`logprobs`, `top_logprobs`), checked against the model's
own uncached forward pass on the same tokens.

Mutations checked to fail here (one at a time, then reverted): the log-softmax left out (raw
logits reported); the logits of the step before taken (an offset by one); alternatives not sorted.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tinygpt_mlx.config import CacheConfig  # noqa: E402
from tinygpt_mlx.server.app import create_app, serve_in_thread  # noqa: E402

PROMPT = "In the beginning God created the heaven and the earth. And the earth was"
TOL = 2e-4            # fp32 cached vs uncached logits on the tiny model: ~1e-5 measured


@pytest.fixture(scope="module")
def url(native):
    srv, thread, base = serve_in_thread(create_app(native, CacheConfig(), prefill_chunk=16, max_slots=1))
    yield base
    srv.should_exit = True
    thread.join(timeout=10)


def _reference(loaded, ids: list[int], n_prompt: int) -> np.ndarray:
    """Log-softmax after each generated position, by one uncached forward pass over `ids`."""
    logits = loaded.model(mx.array(ids)[None]).astype(mx.float32)[0]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(lp[n_prompt - 1:len(ids) - 1])


def test_ollama_generate_logprobs_match_an_uncached_forward(url, native):
    r = httpx.post(url + "/api/generate", json={
        "model": native.name, "prompt": PROMPT, "raw": True, "stream": False, "logprobs": True,
        "top_logprobs": 3, "options": {"temperature": 0, "num_predict": 6}}, timeout=60).json()
    ids, entries = r["context"], r["logprobs"]
    n_prompt = len(ids) - r["eval_count"]
    assert len(entries) == r["eval_count"] == 6
    ref = _reference(native, ids, n_prompt)
    for i, e in enumerate(entries):
        token = ids[n_prompt + i]
        assert abs(e["logprob"] - ref[i, token]) < TOL
        assert len(e["top_logprobs"]) == 3
        best = np.sort(ref[i])[::-1][:3]
        np.testing.assert_allclose([a["logprob"] for a in e["top_logprobs"]], best, atol=TOL)
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"], abs=1e-6)   # greedy
        assert e["token"] == native.tokenizer.decode([token])
    assert "".join(e["token"] for e in entries) == r["response"]


def test_openai_chat_and_completion_shapes(url, native):
    body = {"model": native.name, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    assert all(bytes(c["bytes"]).decode() == c["token"] for c in content)
    # without logprobs there are none
    body.pop("logprobs"), body.pop("top_logprobs")
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["logprobs"] is None
    r = httpx.post(url + "/v1/completions", json={"model": native.name, "prompt": PROMPT, "temperature": 0,
                                                  "max_tokens": 4, "logprobs": 2}, timeout=60).json()
    got = r["choices"][0]["logprobs"]
    assert len(got["tokens"]) == len(got["token_logprobs"]) == len(got["top_logprobs"]) == 4
    assert "".join(got["tokens"]) == r["choices"][0]["text"]
    assert got["text_offset"] == list(np.cumsum([0] + [len(t) for t in got["tokens"]])[:-1])
    assert all(max(top.values()) == pytest.approx(v, abs=1e-6) for top, v in zip(got["top_logprobs"],
                                                                               got["token_logprobs"]))


@pytest.mark.parametrize("path,extra,words", [
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs must be true or false, got 'yes'"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 50}, "top_logprobs must be an integer in [0, 20], got 50"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {"logprobs": True, "stream": True}, "logprobs are given with stream: false only"),
    ("/v1/completions", {"logprobs": 9}, "logprobs must be an integer in [0, 5] here, got 9"),
    ("/api/chat", {"logprobs": True}, "logprobs are given with stream: false only"),   # ollama streams by default
])
def test_bad_logprobs_are_one_line(url, native, path, extra, words):
    body = {"model": native.name, "max_tokens": 2, **extra}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    message = err["message"] if isinstance(err, dict) else err
    assert message == words and "\n" not in message
