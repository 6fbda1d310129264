"""`--prefill-tail N` (SampleConfig.prefill_tail, `generate.pass_end`): the prompt's last N tokens
prefilled as a pass of their own (docs/gguf.md, issue 55).

References: the plain chunking (`range(0, n, chunk)`) where N is 0 or covers the prompt; with the
full cache the logits and greedy tokens of any N equal one plain prefill's (chunking changes only
rounding); with retrieval a run equals its two parts fed by hand to a fresh cache (the prefix in
chunks, then the last N tokens as one pass), and differs from N = 0, since each pass picks one pool
of cold pages for all its queries. The model calls are counted by a spy on `generate.forward`,
through every path that prefills a prompt for generation (sample, chat, serve, needle, compare).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from tinygpt_mlx import generate
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.cli.main import app
from tinygpt_mlx.config import CacheConfig, SampleConfig
from tinygpt_mlx.evaluate import compare as cmp
from tinygpt_mlx.evaluate import needle as nd
from tinygpt_mlx.generate import greedy_tokens, pass_end, prefill
from test_needle_step_probe import needle_cell

RETRIEVAL = "sink4/hot32:absolute+fetch16"
CHUNK = 64


def passes(n: int, chunk: int, tail: int) -> list[int]:
    out, done = [], 0
    while done < n:
        end = pass_end(done, n, chunk, tail)
        out.append(end - done)
        done = end
    return out


def plain(n: int, chunk: int) -> list[int]:
    return [min(chunk, n - i) for i in range(0, n, chunk)]


@pytest.fixture(scope="module")
def ids(native):
    ids = needle_cell(native.tokenizer)[0]
    assert len(ids) > 3 * CHUNK
    return ids


@pytest.fixture
def spy(monkeypatch):
    """The token count of every model call the engine makes (prefill passes, then decode steps)."""
    sizes: list[int] = []
    real = generate.forward

    def forward(model, tokens, cache, **kw):
        sizes.append(int(tokens.shape[1]))
        return real(model, tokens, cache, **kw)

    monkeypatch.setattr(generate, "forward", forward)
    return sizes


def test_the_passes_are_the_plain_chunking_then_the_tail():
    for n in (1, 5, 64, 100, 513, 1000):
        for chunk in (1, 7, 64, 512):
            assert passes(n, chunk, 0) == plain(n, chunk)
            assert passes(n, chunk, n) == passes(n, chunk, n + 50) == plain(n, chunk)
            for tail in (1, 3, 64, 200):
                t = min(tail, n)
                assert passes(n, chunk, tail) == plain(n - t, chunk) + plain(t, chunk), (n, chunk, tail)
                if t <= chunk:
                    assert passes(n, chunk, tail)[-1] == t


@pytest.mark.parametrize("tail", [0, 1, 24, CHUNK, 100, 10_000])
def test_full_cache_any_tail_equals_one_plain_prefill(native, ids, tail):
    model = native.model
    with make_cache(model, CacheConfig()) as cache:
        one = prefill(model, ids, cache, len(ids))
    with make_cache(model, CacheConfig()) as cache:
        got = prefill(model, ids, cache, CHUNK, tail=tail)
        assert cache.current_length == len(ids)
    np.testing.assert_allclose(np.array(got), np.array(one), atol=1e-4)
    with make_cache(model, CacheConfig()) as a, make_cache(model, CacheConfig()) as b:
        assert greedy_tokens(model, ids, a, 8, CHUNK, prefill_tail=tail) == greedy_tokens(model, ids, b, 8, len(ids))


@pytest.mark.parametrize("tail", [8, 24])
def test_retrieval_last_pass_is_the_tail_and_equals_it_fed_by_hand(native, ids, spy, tail):
    model, config = native.model, CacheConfig.from_spec(RETRIEVAL)
    with make_cache(model, config) as cache:
        got = prefill(model, ids, cache, CHUNK, tail=tail)
    assert spy == plain(len(ids) - tail, CHUNK) + [tail]
    with make_cache(model, config) as cache:
        prefill(model, ids[:-tail], cache, CHUNK)
        by_hand = prefill(model, ids[-tail:], cache, tail)
    np.testing.assert_allclose(np.array(got), np.array(by_hand), atol=1e-6)
    with make_cache(model, config) as cache:
        off = prefill(model, ids, cache, CHUNK)
    # the last pass's queries now share a pool with `tail` tokens, not with the chunk's: other logits
    assert float(mx.abs(got - off).max()) > 1e-2


def test_retrieval_tail_off_or_past_the_prompt_is_the_plain_chunking(native, ids, spy):
    model, config = native.model, CacheConfig.from_spec(RETRIEVAL)
    runs = []
    for tail in (0, len(ids), len(ids) + 1000):
        spy.clear()
        with make_cache(model, config) as cache:
            runs.append(np.array(prefill(model, ids, cache, CHUNK, tail=tail)))
        assert spy == plain(len(ids), CHUNK), tail
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])
    with pytest.raises(ValueError, match="prefill_tail"):
        prefill(model, ids, make_cache(model, config), CHUNK, tail=-1)


# ----- every path that prefills a prompt for generation ---------------------------------------------
def _cli(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def _holds(sizes: list[int], run: list[int]) -> bool:
    """Whether `run` occurs in `sizes` as consecutive calls."""
    return any(sizes[i:i + len(run)] == run for i in range(len(sizes) - len(run) + 1))


def test_sample_honours_it(native, native_path, ids, spy):
    prompt = native.tokenizer.decode(ids)
    n = len(native.tokenizer.encode(prompt))
    r = _cli("sample", native_path, "-p", prompt, "-n", 3, "--temperature", 0, "--kiv-hot-budget", 32,
             "--prefill-chunk", CHUNK, "--prefill-tail", 8)
    assert r.exit_code == 0, r.output
    assert spy == plain(n - 8, CHUNK) + [8] + [1, 1], spy
    assert "the last 8 tokens apart" in r.stderr


def test_stream_generate_reads_it_from_the_sample_config(native, ids, spy):
    config = CacheConfig.from_spec(RETRIEVAL)
    chunks = list(generate.stream_generate(native, ids, config, SampleConfig(max_tokens=2, temperature=0,
                                                                             prefill_chunk=CHUNK, prefill_tail=8)))
    assert chunks[-1].done and spy == plain(len(ids) - 8, CHUNK) + [8, 1]


def test_chat_honours_it(native_path, spy):
    r = _cli("chat", native_path, "--no-chat-template", "-n", 2, "--temperature", 0, "--prefill-chunk", 16,
             "--prefill-tail", 5, input="And God said unto Moses, I am that I am: and he said, Thus shalt thou say\n")
    assert r.exit_code == 0, r.output
    prompt_passes = spy[:spy.index(1)] if 1 in spy else spy
    assert prompt_passes[-1] == 5 and all(s == 16 for s in prompt_passes[:-2]), spy


def test_serve_honours_it(native, ids, spy):
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from tinygpt_mlx.server.app import create_app, serve_in_thread

    config = CacheConfig.from_spec(RETRIEVAL)
    prompt = native.tokenizer.decode(ids)
    n = len(native.tokenizer.encode(prompt))
    srv, thread, url = serve_in_thread(create_app(native, config, prefill_chunk=CHUNK, prefill_tail=8))
    try:
        r = httpx.post(url + "/api/generate", json={"model": native.name, "prompt": prompt, "raw": True,
                                                    "stream": False, "options": {"temperature": 0, "num_predict": 3}},
                       timeout=60)
        assert r.status_code == 200, r.text
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
    assert _holds(spy, plain(n - 8, CHUNK) + [8]) and not _holds(spy, plain(n, CHUNK)), spy
    with make_cache(native.model, config) as cache:
        want = greedy_tokens(native.model, native.tokenizer.encode(prompt), cache, 3, CHUNK, prefill_tail=8)
    assert r.json()["response"] == native.tokenizer.decode(want)


def test_needle_honours_it(native_path, tmp_path, spy):
    filler = tmp_path / "filler.txt"
    filler.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    outs = {}
    for tail in (0, 8):
        out = tmp_path / f"n{tail}.json"
        spy.clear()
        r = _cli("needle", native_path, "--contexts", "160", "--depths", "0.5", "--seeds", "1",
                 "--policies", "full,retrieval", "--kiv-hot-budget", "24", "--kiv-page-size", "8", "--kiv-top-p", "8",
                 "--kiv-top-pages", "2", "--prefill-chunk", "16", "--prefill-tail", tail, "--filler", filler,
                 "--json", out)
        assert r.exit_code == 0, r.output
        outs[tail] = json.loads(out.read_text())
        n = outs[tail]["cells"][0]["prompt_tokens"]
        prompt_passes = plain(n - tail, 16) + ([tail] if tail else [])
        assert spy[:len(prompt_passes)] == prompt_passes, spy       # the full cell's prompt, then its decode
    assert outs[8]["prefill_tail"] == 8 and outs[0]["prefill_tail"] == 0
    full = [[c for c in outs[t]["cells"] if c["policy"] == "full"][0] for t in (0, 8)]
    assert full[0]["output"] == full[1]["output"]
    # the retrieval cell's telemetry is the last pass's and the decode's: the tail's 8 queries, not 16
    tel = [[c for c in outs[t]["cells"] if c["policy"] == "retrieval"][0]["telemetry"] for t in (0, 8)]
    assert tel[0] != tel[1]


def test_compare_honours_it(native, spy):
    prompt = "And God said unto Moses, I am that I am: and he said, Thus shalt thou say unto the children"
    n = len(native.tokenizer.encode(prompt))
    result = cmp.compare(native, [prompt], {"r": CacheConfig.from_spec("sink4/hot8:absolute+fetch4")}, tokens=2,
                         prefill_tail=5)
    assert result["prefill_tail"] == 5
    # the baseline's run and the mode's: each the plain chunking of all but 5 tokens, then 5, then a decode step
    assert spy == 2 * (plain(n - 5, cmp.PREFILL_CHUNK) + [5, 1]), spy


def test_compare_takes_a_prefill_chunk(native_path, tmp_path, spy):
    """`compare --prefill-chunk` (its --prefill-tail help spoke of --prefill-chunk pieces, and it had
    no such flag: every run prefilled in 512s): every run's passes, the baseline's and each mode's,
    are the plain chunking of all but the tail, then the tail, then the decode steps."""
    prompts = tmp_path / "p.txt"
    prompt = "And God said unto Moses, I am that I am: and he said, Thus shalt thou say unto the children"
    prompts.write_text(prompt + "\n")
    n = len(_native_tokens(native_path, prompt))
    r = _cli("compare", native_path, "--prompts", prompts, "--modes", "fp16", "-n", 2, "--prefill-chunk", 7,
             "--prefill-tail", 3, "--json", tmp_path / "c.json")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "c.json").read_text())["prefill_chunk"] == 7
    assert spy == 2 * (plain(n - 3, 7) + [3, 1]), spy
    r = _cli("compare", native_path, "--prefill-chunk", 0)
    assert r.exit_code == 2 and "Invalid value for '--prefill-chunk'" in r.stderr, r.output


def _native_tokens(path, text: str) -> list[int]:
    from tinygpt_mlx.loading import load
    return load(path).tokenizer.encode(text)


@pytest.mark.parametrize("command", ["sample", "chat", "serve", "needle", "compare"])
@pytest.mark.parametrize("value, said", [("-1", "must be an integer >= 0, got -1"), ("abc", "got 'abc'"),
                                         ("2.5", "got '2.5'")])
def test_bad_values_are_one_line_naming_what_was_typed(tmp_path, command, value, said):
    missing = tmp_path / "not-loaded.tinygpt"   # checked before the model is looked for
    r = _cli(command, missing, *(["-p", "hi"] if command == "sample" else []), "--prefill-tail", value)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Invalid value for '--prefill-tail'" in lines[0] and said in lines[0], r.stderr


@pytest.mark.parametrize("command", ["sample", "chat", "serve", "needle", "compare"])
def test_help_explains_it(command):
    r = _cli(command, "--help")
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "--prefill-tail" in text and "last N tokens as a forward pass of their own" in text
