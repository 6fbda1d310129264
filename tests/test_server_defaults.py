"""`serve`'s server-wide defaults through the HTTP API, with the request shapes real clients send
(LangChain's ChatOllama and ChatOpenAI send no length; Open WebUI reads /api/ps): a bounded
reply by default, a default context, the context /api/ps reports, and --name."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from typer.testing import CliRunner

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tinygpt_mlx.config import CacheConfig  # noqa: E402
from tinygpt_mlx.server.app import create_app, serve_in_thread  # noqa: E402

MSGS = [{"role": "user", "content": "In the beginning"}]


class Live:
    def __init__(self, loaded, cache_config=None, **kw):
        self.srv, self.thread, self.url = serve_in_thread(
            create_app(loaded, cache_config or CacheConfig(), prefill_chunk=64, **kw))
        self.ollama = ollama.Client(host=self.url)
        self.oai = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.srv.should_exit = True
        self.thread.join(timeout=10)


def test_requests_without_a_length_are_bounded(native):
    name = native.name
    with Live(native, default_max_tokens=5) as s:
        r = s.ollama.chat(name, MSGS, options={"temperature": 0})          # ChatOllama's default shape
        assert r.eval_count == 5 and r.done_reason == "length"
        r = s.ollama.generate(name, "In the beginning", options={"temperature": 0, "num_predict": -1})
        assert r.eval_count == 5
        c = s.oai.chat.completions.create(model=name, messages=MSGS, temperature=0)   # no max_tokens
        assert c.usage.completion_tokens == 5 and c.choices[0].finish_reason == "length"
        asked = s.ollama.chat(name, MSGS, options={"temperature": 0, "num_predict": 9})
        assert asked.eval_count == 9 or asked.done_reason == "stop"       # an asked length is kept
    with Live(native, default_max_tokens=0) as s:                          # 0: up to the context
        r = s.ollama.chat(name, MSGS, options={"temperature": 0, "num_ctx": 96})
        assert r.eval_count > 5


def test_default_num_ctx_and_what_ps_reports(native):
    name = native.name
    long = "In the beginning God created the heaven and the earth. " * 40
    with Live(native, default_num_ctx=64, default_max_tokens=4) as s:
        assert s.ollama.ps().models[0].context_length == 64
        r = s.ollama.generate(name, long, options={"temperature": 0})
        assert r.prompt_eval_count <= 64                                   # truncated to the default
        r = s.ollama.generate(name, long, options={"temperature": 0, "num_ctx": 128})
        assert 64 < r.prompt_eval_count <= 128                             # a request's own num_ctx wins
    with Live(native) as s:
        assert s.ollama.ps().models[0].context_length == native.context_length
    with Live(native, CacheConfig(sink=4, window=60)) as s:
        from tinygpt_mlx.server.ollama import UNBOUNDED_ACCEPTS
        assert s.ollama.ps().models[0].context_length == UNBOUNDED_ACCEPTS  # not 0


def test_name_serves_under_another_name(native_path):
    from tinygpt_mlx.loading import load

    with load(native_path) as loaded, Live(loaded, names=["gpt-4o-mini"], default_max_tokens=3) as s:
        assert [m.model for m in s.ollama.list().models] == ["gpt-4o-mini:latest"]
        c = s.oai.chat.completions.create(model="gpt-4o-mini", messages=MSGS, temperature=0)
        assert c.usage.completion_tokens == 3
        with pytest.raises(ollama.ResponseError, match="not found"):
            s.ollama.chat(native_path.stem, MSGS)


@pytest.mark.parametrize("args, named", [
    (["--default-max-tokens", "-1"], "--default-max-tokens"),
    (["--default-num-ctx", "1"], "--default-num-ctx"),
    (["--stop-loops", "-1"], "--stop-loops"),
    (["--name", "two words"], "--name 'two words'"),
    (["--name", "a", "--name", "b"], "--name given 2 times for 1 model"),
])
def test_bad_server_defaults_are_one_line(args, named):
    from tinygpt_mlx.cli.main import app

    r = CliRunner().invoke(app, ["serve", "--port", "1", *args])
    assert r.exit_code != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and named in lines[0], r.stderr


def test_long_prefill_is_logged(native, caplog, monkeypatch):
    import logging

    from tinygpt_mlx.server import worker

    monkeypatch.setattr(worker.PrefillLog, "every", 0.0)
    long = "In the beginning God created the heaven and the earth. " * 20   # several 64-token chunks
    with caplog.at_level(logging.INFO, logger="posttrainllm.server"), Live(native, default_max_tokens=2) as s:
        r = s.ollama.generate(native.name, long, options={"temperature": 0})
    lines = [rec.getMessage() for rec in caplog.records if "prefill:" in rec.getMessage()]
    assert len(lines) >= 3, lines
    total = r.prompt_eval_count
    assert lines[-1].startswith("slot ") and f"{total}/{total} tokens" in lines[-1]
    assert all("tok/s, ETA" in ln for ln in lines)


@pytest.mark.parametrize("cold_store", ["ram", "disk"])
def test_ps_and_log_show_the_cold_store(native, caplog, cold_store, tmp_path):
    """Under retrieval /api/ps breaks the slots' caches down (the cold store's share included) and
    counts a memory-mapped cold store in `size` but not in `size_vram`; the slot's log line says
    what the cold store holds."""
    import logging

    cfg = CacheConfig(sink=4, hot_budget=32, cold_store=cold_store, cold_path=str(tmp_path))
    long = "In the beginning God created the heaven and the earth. " * 12
    with caplog.at_level(logging.INFO, logger="posttrainllm.server"), Live(native, cfg, default_max_tokens=2) as s:
        s.ollama.generate(native.name, long, options={"temperature": 0})
        ps = httpx.get(s.url + "/api/ps").json()["models"][0]
    mem = ps["posttrainllm"]
    cold = sum(v for k, v in mem["cache_bytes_breakdown"].items() if k.startswith("cold"))
    assert cold > 0 and mem["cache_bytes"] == sum(mem["cache_bytes_breakdown"].values())
    assert ps["size"] - ps["size_vram"] == mem["cache_disk_bytes"]
    assert (mem["cache_disk_bytes"] > 0) == (cold_store == "disk")
    line = next(r.getMessage() for r in caplog.records if "generated" in r.getMessage())
    assert "cold store" in line and ("on disk" in line)


def test_looping():
    from tinygpt_mlx.server.worker import looping

    assert looping([1, 2, 3] + [7, 8] * 8, 16)
    assert looping([5] * 16, 16)
    assert not looping([7, 8] * 7 + [7, 9], 16)
    assert not looping([7, 8] * 4, 16)                  # shorter than the span
    assert looping(list(range(40)) * 3, 100)            # a 40-token sentence said again and again
    assert not looping(list(range(40)) * 3, 100, max_period=32)


def test_stop_loops_stops_where_the_loop_is_found(native):
    """--stop-loops N stops a greedy reply at the first multiple of 8 tokens whose last N loop;
    without it the same reply runs on (the model's output is left alone by default)."""
    from tinygpt_mlx.server.worker import looping

    name, opts = native.name, {"temperature": 0, "num_predict": 160}
    with Live(native) as s:
        r = s.ollama.generate(name, "the the the", options=opts)
    answer = r.context[-r.eval_count:]
    first = next((k for k in range(8, len(answer) + 1, 8) if looping(answer[:k], 24)), None)
    assert first is not None and first < r.eval_count, "the tiny model should fall into a loop here"
    with Live(native, stop_loops=24) as s:
        stopped = s.ollama.generate(name, "the the the", options=opts)
    assert stopped.eval_count == first and stopped.done_reason == "stop"
    assert stopped.context[-first:] == answer[:first]


@pytest.mark.slow
def test_serve_writes_nothing_on_stdout_its_access_log_on_stderr(native_path):
    """`posttrainllm serve` as a process: a request's access line goes to stderr with the rest of
    the server's diagnostics; stdout stays empty (uvicorn's own logging sent it to stdout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "tinygpt_mlx.cli.main", "serve", str(native_path), "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, POSTTRAINLLM_NO_BLAS_PRELOAD="1"))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert p.poll() is None, p.communicate()[1][-2000:]
            try:
                body = json.dumps({"model": native_path.stem, "prompt": "ab", "stream": False,
                                   "options": {"num_predict": 2}}).encode()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/generate", data=body, timeout=60) as r:
                    assert r.status == 200
                break
            except OSError:
                assert time.monotonic() < deadline, "no answer in 120 s"
                time.sleep(0.3)
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    assert out == "", out
    assert "POST /api/generate" in err, err
