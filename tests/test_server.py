"""`posttrainllm serve`: the real `ollama` and `openai` clients against a live server.

uvicorn runs in a thread on a free 127.0.0.1 port with the tiny native model; everything is
greedy (temperature 0) and short so the file stays fast on a shared CPU.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tinygpt_mlx.config import CacheConfig  # noqa: E402
from tinygpt_mlx.generate import prefill  # noqa: E402
from tinygpt_mlx.server.app import create_app, serve_in_thread  # noqa: E402
from tinygpt_mlx.server.prompt import plain_chat_text  # noqa: E402
from tinygpt_mlx.server.slots import SlotPool  # noqa: E402

GREEDY = {"temperature": 0, "num_predict": 8}
LONG = "The quick brown fox jumps over the lazy dog. In the beginning was the word. " * 3


def _serve(loaded, cache_config=None, prefill_chunk=64, **kw):
    """A live server on a free loopback port: (uvicorn server, its thread, base URL)."""
    return serve_in_thread(create_app(loaded, cache_config or CacheConfig(), prefill_chunk=prefill_chunk, **kw))


@pytest.fixture(scope="module")
def server(native):
    srv, thread, url = _serve(native, max_slots=2, small_tokens=64)
    yield url
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def name(native):
    return native.name


def test_metadata(server, client, oai, name):
    assert httpx.get(server + "/").text == "Ollama is running"
    assert httpx.get(server + "/api/version").json()["version"]
    tags = client.list().models
    assert [m.model for m in tags] == [f"{name}:latest"] and tags[0].details.family == "tinygpt"
    show = client.show(name)
    assert show.modelinfo["general.architecture"] == "tinygpt" and show.details.format == "tinygpt"
    ps = client.ps().models
    assert ps[0].name == f"{name}:latest" and ps[0].expires_at is not None
    assert [m.id for m in oai.models.list().data] == [f"{name}:latest"]


def test_generate_streamed_equals_unstreamed(client, native, name):
    prompt = native.tokenizer.encode("The quick brown")
    whole = client.generate(name, "The quick brown", options=GREEDY)
    parts = list(client.generate(name + ":latest", "The quick brown", stream=True, options=GREEDY))
    assert "".join(p.response for p in parts[:-1]) == whole.response
    final = parts[-1]
    assert final.done and not any(p.done for p in parts[:-1])
    for r in (whole, final):
        assert r.done_reason in ("stop", "length") and r.created_at.endswith("Z")
        assert all(isinstance(getattr(r, k), int) for k in (
            "total_duration", "load_duration", "prompt_eval_duration", "eval_duration",
            "prompt_eval_count", "eval_count"))
        assert r.context[:len(prompt)] == prompt and len(r.context) == len(prompt) + r.eval_count
    assert whole.eval_count <= 8
    # ollama's `context` round trip extends the warm slot: only the unfed last token + the new text
    more = native.tokenizer.encode(" over the lazy dog")
    nxt = client.generate(name, " over the lazy dog", context=whole.context, options=GREEDY)
    assert nxt.prompt_eval_count in (len(more), len(more) + 1)
    assert nxt.context[:len(whole.context)] == whole.context


def test_chat_streamed_equals_unstreamed(client, oai, name):
    msgs = [{"role": "user", "content": "Café, naïve, 東京"}]
    whole = client.chat(name, msgs, options=GREEDY)
    parts = list(client.chat(name, msgs, stream=True, options=GREEDY))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].message.role == "assistant"
    a = oai.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0)
    s = oai.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(s)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a.choices[0].message.content
    assert a.choices[0].message.content == whole.message.content
    assert chunks[-1].usage.completion_tokens == a.usage.completion_tokens
    # the same prompt again: served from the warm slot, rolled back to all but its last token
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == a.usage.prompt_tokens - 1
    c1 = oai.completions.create(model=name, prompt="The quick", max_tokens=6, temperature=0)
    c2 = "".join(c.choices[0].text for c in oai.completions.create(
        model=name, prompt="The quick", max_tokens=6, temperature=0, stream=True))
    assert c1.choices[0].text == c2 and c1.choices[0].finish_reason in ("stop", "length")


def test_seeded_sampling_is_reproducible(client, name):
    opts = {"temperature": 1.0, "top_k": 50, "top_p": 0.95, "seed": 7, "num_predict": 8}
    a, b = (client.generate(name, "The quick brown", options=opts).response for _ in range(2))
    assert a == b
    assert client.generate(name, "The quick brown", options=dict(opts, seed=-1)).done


def test_stop_string_never_sent(client, name):
    free = client.generate(name, "The quick brown", options=GREEDY).response
    assert len(free) > 2
    stop = free[1:3]
    parts = list(client.generate(name, "The quick brown", stream=True, options=dict(GREEDY, stop=[stop])))
    text = "".join(p.response for p in parts)
    assert text == free[:free.find(stop)] and parts[-1].done_reason == "stop"


def test_two_turn_chat_reuses_warm_slot(client, native, name):
    tok = native.tokenizer
    msgs = [{"role": "user", "content": LONG}]
    first = client.chat(name, msgs, options=GREEDY)
    msgs += [first.message.model_dump(include={"role", "content"}), {"role": "user", "content": "And the keeper?"}]
    second = client.chat(name, msgs, options=GREEDY)
    ids1 = tok.encode(plain_chat_text(msgs[:1]))
    ids2 = tok.encode(plain_chat_text(msgs))
    # only the new tail was prefilled: never the first turn's prompt again
    assert 0 < second.prompt_eval_count <= len(ids2) - len(ids1) + 1
    assert second.prompt_eval_count < len(ids2) / 2


def test_background_title_request_keeps_the_chat_warm(native, name):
    """One slot: a UI's short title request between two chat turns must not evict the chat."""
    srv, thread, url = _serve(native, max_slots=1, small_tokens=64)
    try:
        c = ollama.Client(host=url)
        msgs = [{"role": "user", "content": LONG}]
        first = c.chat(name, msgs, options=GREEDY)
        title = c.chat(name, [{"role": "user", "content": "Title for this chat?"}], options=GREEDY)
        msgs += [first.message.model_dump(include={"role", "content"}), {"role": "user", "content": "More?"}]
        second = c.chat(name, msgs, options=GREEDY)
        assert second.prompt_eval_count < len(native.tokenizer.encode(plain_chat_text(msgs))) / 2
        actions = [r["action"] for r in httpx.get(url + "/api/slots").json()["recent"]]
        assert actions == ["new", "scratch", "extend"] and title.done
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def test_truncation_to_num_ctx_is_reported(server, name):
    # context 32, num_predict 8: the prompt gets 32 - 8 = 24 tokens, its first num_keep 5 and newest 19
    r = httpx.post(server + "/api/generate", json={
        "model": name, "prompt": LONG, "stream": False, "options": dict(GREEDY, num_ctx=32, num_keep=5)},
        timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["truncated"]["kept_tokens"] == 24
    assert body["truncated"]["num_keep"] == 5 and body["truncated"]["reserved"] == 8
    assert body["prompt_tokens"] == 24 and "X-Prompt-Truncated" in r.headers
    assert body["prompt_tokens"] + body["eval_count"] <= 32


def test_errors(server, client, oai, name):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate("nope", "hi")
    assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"
    with pytest.raises(ollama.ResponseError) as e:
        list(client.chat("nope", [{"role": "user", "content": "hi"}], stream=True))
    assert e.value.status_code == 404
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    for body in (b"{not json", b"", b"[1, 2]"):
        r = httpx.post(server + "/api/chat", content=body)
        assert r.status_code == 400 and "error" in r.json()
    for opts in ({"temperature": "hot"}, {"top_p": 5}, {"num_ctx": -1}):
        r = httpx.post(server + "/api/generate", json={"model": name, "prompt": "x", "options": opts})
        assert r.status_code == 400 and isinstance(r.json()["error"], str)
    r = httpx.post(server + "/v1/chat/completions", content=b"{oops")
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert httpx.get(server + "/api/version").status_code == 200       # still alive


def _idle(server: str) -> dict:
    deadline = time.time() + 10
    while True:
        state = httpx.get(server + "/api/slots").json()
        if not state["busy"] and not state["queued"]:
            return state
        assert time.time() < deadline, "worker still busy after the client left"
        time.sleep(0.05)


def test_client_disconnect_cancels(server, client, name, monkeypatch):
    from tinygpt_mlx import generate as engine     # the one loop the worker drives

    real = engine.forward

    def slow(*a, **k):            # make decoding slow enough that the disconnect lands mid-stream
        time.sleep(0.01)
        return real(*a, **k)

    monkeypatch.setattr(engine, "forward", slow)
    body = {"model": name, "prompt": "Disconnect me", "options": {"temperature": 0, "num_predict": 200}}
    with httpx.stream("POST", server + "/api/generate", json=body, timeout=30) as r:
        first = json.loads(next(r.iter_lines()))
        assert first["done"] is False
    assert _idle(server)["recent"][-1]["done_reason"] == "cancel"
    with pytest.raises(httpx.TimeoutException):    # a non-streamed request whose client gives up
        httpx.post(server + "/api/generate", json=dict(body, stream=False), timeout=0.5)
    last = _idle(server)["recent"][-1]
    assert last["done_reason"] == "cancel" and last["generated"] < 100
    monkeypatch.setattr(engine, "forward", real)
    assert client.generate(name, "Still there?", options=GREEDY).done


@pytest.mark.slow
def test_a_silent_prefill_keeps_the_stream_alive(server, client, oai, name, monkeypatch):
    """While the worker is silent (here: each model call slowed to 0.3 s), a streamed response
    sends empty text chunks every KEEPALIVE_S; the text is unchanged, for ollama and OpenAI."""
    from tinygpt_mlx import generate as engine
    from tinygpt_mlx.server import streams

    messages = [{"role": "user", "content": "Keep me alive"}]
    want = client.chat(name, messages=messages, options=GREEDY).message.content
    want_oai = oai.chat.completions.create(model=name, messages=messages, temperature=0,
                                           max_tokens=8).choices[0].message.content
    real = engine.forward

    def slow(*a, **k):
        time.sleep(0.3)
        return real(*a, **k)

    monkeypatch.setattr(engine, "forward", slow)
    monkeypatch.setattr(streams, "KEEPALIVE_S", 0.05)
    body = {"model": name, "messages": messages, "stream": True, "options": GREEDY}
    with httpx.stream("POST", server + "/api/chat", json=body, timeout=60) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    parts = [d["message"]["content"] for d in lines if not d["done"]]
    first = next(i for i, p in enumerate(parts) if p)
    assert first >= 3 and not any(parts[:first])            # empty chunks while the prompt ran
    assert "".join(parts) == want and lines[-1]["done"]
    chunks = list(oai.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=8,
                                              stream=True))
    contents = [c.choices[0].delta.content for c in chunks if c.choices]
    assert contents.count("") >= 3 and "".join(x or "" for x in contents) == want_oai


@pytest.mark.slow
def test_twenty_concurrent_requests(server, name):
    def one(i):
        c = ollama.Client(host=server)
        opts = {"temperature": 0, "num_predict": 3}
        if i % 2:
            return "".join(p.response for p in c.generate(name, f"request {i}", stream=True, options=opts))
        return c.chat(name, [{"role": "user", "content": f"request {i}"}], options=opts).message.content

    sequential = [one(i) for i in range(20)]
    with concurrent.futures.ThreadPoolExecutor(20) as ex:
        results = list(ex.map(one, range(20)))
    assert results == sequential and len(set(sequential)) > 1     # greedy: the same answers


def test_mlx_lm_model(llama):
    srv, thread, url = _serve(llama, max_slots=1)
    try:
        c = ollama.Client(host=url)
        assert [m.model for m in c.list().models] == ["tiny-llama:latest"]
        a = c.chat("tiny-llama", [{"role": "user", "content": "hello"}], options=GREEDY)
        b = "".join(p.message.content for p in c.chat("tiny-llama", [{"role": "user", "content": "hello"}],
                                                       stream=True, options=GREEDY))
        assert a.message.content == b and a.done_reason in ("stop", "length")
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


# ----- the slot pool on its own ----------------------------------------------------------------
def _run(pool, model, ids):
    lease = pool.acquire(ids)
    logits = prefill(model, ids[lease.reused:], lease.slot.cache, 64)
    lease.slot.tokens = list(ids)
    return lease, logits


def test_pool_extend_rollback_and_protection(native):
    import mlx.core as mx

    ids = native.tokenizer.encode(LONG)[:60]
    other = native.tokenizer.encode("Café, naïve, 東京 and emoji round-trip " * 4)[:40]
    pool = SlotPool(native.model, CacheConfig(), max_slots=2, small_tokens=32)
    assert _run(pool, native.model, ids)[0].action == "new"
    lease, _ = _run(pool, native.model, ids + other[:10])
    assert (lease.action, lease.reused, lease.slot.index) == ("extend", 60, 0)
    lease, logits = _run(pool, native.model, ids[:50])          # regenerate: a prefix of the slot
    assert (lease.action, lease.reused) == ("rollback", 49)
    cold = SlotPool(native.model, CacheConfig(), max_slots=1)
    _, fresh = _run(cold, native.model, ids[:50])
    assert mx.allclose(logits, fresh, atol=1e-4)
    assert _run(pool, native.model, other)[0].action == "new"   # slot 1
    small = _run(pool, native.model, native.tokenizer.encode("Title?"))[0]
    assert small.action == "scratch"                            # both conversations stay warm
    assert [len(s.tokens) for s in pool.slots] == [50, 40]
    lease = _run(pool, native.model, native.tokenizer.encode(" word 0123456789" * 10)[:45])[0]
    assert lease.action == "evict" and lease.slot.index == 1    # the longest (slot 0) is protected


def test_pool_untrimmable_policy_extends_but_never_rolls_back(native):
    ids = native.tokenizer.encode(LONG)[:60]
    pool = SlotPool(native.model, CacheConfig(sink=4, window=32), max_slots=2, small_tokens=8)
    _run(pool, native.model, ids[:40])
    lease = _run(pool, native.model, ids)[0]
    assert (lease.action, lease.reused) == ("extend", 40)
    lease = _run(pool, native.model, ids[:50])[0]               # a StreamingLLM cache cannot trim
    assert (lease.action, lease.slot.index) == ("new", 1) and len(pool.slots[0].tokens) == 60


def test_text_splice_extends_an_untrimmable_slot(native):
    """A prompt whose text continues a slot's text extends it even where re-encoding the text
    would merge tokens across the boundary (here "wo" + "rd" -> "word")."""
    from tinygpt_mlx.server.worker import Job, Worker

    tok = native.tokenizer
    first = "The quick brown fox jumps over the lazy dog. In the beginning was the wo"
    full = first + "rd, and the word was with the keeper"
    assert tok.encode(full)[:len(tok.encode(first))] != tok.encode(first)
    w = Worker(native, SlotPool(native.model, CacheConfig(sink=4, window=64), max_slots=1), 64)
    try:
        for text in (first, full):
            w.submit(Job(tok.encode(text), 1, temperature=0, text=text))
        deadline = time.time() + 20
        while w.completed < 2:
            assert time.time() < deadline
            time.sleep(0.02)
    finally:
        w.stop()
    second = w.recent[-1]
    assert second["action"] == "extend" and second["prefilled"] == len(tok.encode(full[len(first):]))


# ----- the command ------------------------------------------------------------------------------
def test_serve_command(native_path, monkeypatch):
    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    r = CliRunner().invoke(app, ["serve", str(native_path), "--port", "12345", "--max-slots", "3",
                                 "--streaming-llm-sink", "4", "--streaming-llm-window", "64"])
    assert r.exit_code == 0, r.output
    served, kw = calls[0]
    log_config = kw.pop("log_config")
    assert kw == {"host": "127.0.0.1", "port": 12345, "log_level": "info"}
    assert {h["stream"] for h in log_config["handlers"].values()} == {"ext://sys.stderr"}   # access log too
    srv = served.state.server
    assert len(srv.pool.slots) == 3 and srv.cache_config.window == 64
    srv.worker.stop()
    bad = CliRunner().invoke(app, ["serve", str(native_path), "--max-slots", "0"])
    assert bad.exit_code != 0


def test_shutdown_removes_the_disk_stores_of_the_slots(native, tmp_path):
    """Slot caches live until shutdown, and uvicorn re-raises SIGTERM after it (so exit-time
    finalizers never run): the lifespan removes the KIVI shadow files itself."""
    cfg = CacheConfig(key_bits=4, exact_topk=8, cold_path=str(tmp_path))
    srv, thread, url = _serve(native, cfg, max_slots=1)
    try:
        r = ollama.Client(host=url).generate(model=native.name, prompt=LONG * 3, options=GREEDY)
        assert r["prompt_eval_count"] > 64           # enough tokens to freeze KIVI blocks
        assert any(tmp_path.rglob("*.bin"))      # the slot's shadow, kept for prefix reuse
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
    assert not any(tmp_path.iterdir())


# ----- pre-warmed slots from prompt-cache files (serve --prompt-cache) ----------------------------
DOC = ("Alice keeps the lighthouse on the northern cape. Every evening she climbs the stairs, "
       "winds the clock and lights the lamp. ") * 2
QUESTION = " Who keeps the lighthouse?"


def _ptc(loaded, cfg, path, text=DOC):
    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.cache.persist import save_prompt_cache
    ids = loaded.tokenizer.encode(text)
    with make_cache(loaded.model, cfg) as cache:
        logits = prefill(loaded.model, ids, cache, 64)
        save_prompt_cache(path, cache, loaded, ids, logits)
    return ids


def _ask(url, name, prompt):
    return httpx.post(url + "/api/generate", json={"model": name, "prompt": prompt, "stream": False,
                                                   "options": GREEDY}, timeout=60).json()


def _stop(srv, thread):
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("cfg", [CacheConfig(), CacheConfig(key_bits=4, sink=4, window=64)],
                         ids=["full", "int4keys+streaming"])
@pytest.mark.slow
def test_prewarmed_slot_answers_without_prefilling_the_document(native, tmp_path, cfg):
    doc_ids = _ptc(native, cfg, tmp_path / "doc.ptc")
    q_ids = native.tokenizer.encode(DOC + QUESTION)[len(doc_ids):]
    srv, thread, url = _serve(native, cfg, max_slots=2, small_tokens=8, prompt_caches=[tmp_path / "doc.ptc"])
    try:
        slots = httpx.get(url + "/api/slots").json()["slots"]
        assert [s["tokens"] for s in slots] == [len(doc_ids), 0] and slots[0]["prompt_cache"].endswith("doc.ptc")
        # a small unrelated request (title) runs elsewhere; the document's slot stays reserved
        _ask(url, native.name, "Title?")
        warm = _ask(url, native.name, DOC + QUESTION)
        # another question: the slot has moved on (doc + question + answer): a trimmable cache is
        # rolled back to the shared prefix, an untrimmable one (KIVI) reloaded from the file
        again = _ask(url, native.name, DOC + " Where is the lighthouse?")
        recent = httpx.get(url + "/api/slots").json()["recent"]
    finally:
        _stop(srv, thread)
    assert [r["action"] for r in recent] == ["new", "extend", "rollback" if cfg.key_bits is None else "reload"]
    assert recent[1]["slot"] == recent[2]["slot"] == 0 and recent[0]["slot"] == 1
    assert warm["prompt_eval_count"] == len(q_ids)                  # only the question was prefilled
    assert again["prompt_eval_count"] < len(doc_ids) / 4
    srv, thread, url = _serve(native, cfg, max_slots=2)             # a cold server: same answers
    try:
        cold = _ask(url, native.name, DOC + QUESTION)
        cold2 = _ask(url, native.name, DOC + " Where is the lighthouse?")
    finally:
        _stop(srv, thread)
    assert cold["prompt_eval_count"] == len(doc_ids) + len(q_ids)
    assert warm["response"] == cold["response"] and warm["eval_count"] == cold["eval_count"] > 0
    assert again["response"] == cold2["response"]


@pytest.mark.parametrize("cfg", [CacheConfig(), CacheConfig(key_bits=4, sink=4, window=64)],
                         ids=["full", "int4keys+streaming"])
def test_slot_dir_keeps_a_conversation_across_a_restart(native, tmp_path, cfg):
    """serve --slot-dir: a conversation continues after a restart without its prefill, exactly
    as on a server that never restarted (same prefilled count, same answer)."""
    slots = tmp_path / "slots"
    srv, thread, url = _serve(native, cfg, max_slots=2, slot_dir=slots)
    try:
        first = _ask(url, native.name, DOC)
    finally:
        _stop(srv, thread)
    assert [f.name for f in slots.glob("slot-*.ptc")] == ["slot-0.ptc"]
    follow_up = DOC + first["response"] + QUESTION
    srv, thread, url = _serve(native, cfg, max_slots=2, slot_dir=slots)
    try:
        assert [s["tokens"] for s in httpx.get(url + "/api/slots").json()["slots"]][0] > 0
        after = _ask(url, native.name, follow_up)
        recent = httpx.get(url + "/api/slots").json()["recent"]
    finally:
        _stop(srv, thread)
    srv, thread, url = _serve(native, cfg, max_slots=2)             # never restarted
    try:
        _ask(url, native.name, DOC)
        ref = _ask(url, native.name, follow_up)
    finally:
        _stop(srv, thread)
    assert recent[-1]["action"] == "extend" and recent[-1]["slot"] == 0
    assert after["prompt_eval_count"] == ref["prompt_eval_count"] < len(native.tokenizer.encode(DOC)) / 4
    assert after["response"] == ref["response"] and after["eval_count"] == ref["eval_count"] > 0
    # the second run saved the extended conversation over the first one's file
    from tinygpt_mlx.cache.persist import read_prompt_cache_info
    assert read_prompt_cache_info(slots / "slot-0.ptc").token_count > len(native.tokenizer.encode(follow_up)) - 2


def test_slot_dir_file_of_another_policy_is_skipped(native, tmp_path):
    slots = tmp_path / "slots"
    slots.mkdir()
    _ptc(native, CacheConfig(key_bits=4), slots / "slot-0.ptc")
    srv, thread, url = _serve(native, CacheConfig(), max_slots=2, slot_dir=slots)
    try:
        assert [s["tokens"] for s in httpx.get(url + "/api/slots").json()["slots"]] == [0, 0]
        _ask(url, native.name, "Hello")
    finally:
        _stop(srv, thread)
    assert [f.name for f in slots.glob("slot-*.ptc")] == ["slot-0.ptc"]   # this run's conversation


def test_serve_command_slot_dir(native_path, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app
    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append(app))
    r = CliRunner().invoke(app, ["serve", str(native_path), "--slot-dir", str(tmp_path / "new")])
    assert r.exit_code == 0, r.output
    srv = calls[0].state.server
    assert srv.slot_dir == tmp_path / "new" and srv.restored == []
    srv.worker.stop()
    srv.pool.close()
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    for bad, why in ((a_file, "not a folder"), (tmp_path / "no" / "such", "does not exist")):
        r = CliRunner().invoke(app, ["serve", str(native_path), "--slot-dir", str(bad)])
        lines = [x for x in r.output.strip().splitlines() if x.strip()]
        assert r.exit_code != 0 and len(lines) == 1 and "--slot-dir" in lines[0] and why in lines[0], r.output


def test_prewarmed_file_of_another_policy_or_model_fails_at_startup(native, native_path, tmp_path, tokenizer_json,
                                                                    monkeypatch):
    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app
    from conftest import build_native

    _ptc(native, CacheConfig(key_bits=4), tmp_path / "int4.ptc")
    other = build_native(tmp_path / "other.tinygpt", tokenizer_json, seed=1)
    r = CliRunner().invoke(app, ["cache-prompt", str(other), "--prompt-file", str(_doc(tmp_path)),
                                 "--out", str(tmp_path / "other.ptc")])
    assert r.exit_code == 0, r.output
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: (app.state.server.worker.stop(), app.state.server.pool.close()))
    for f, flags, named in ((tmp_path / "int4.ptc", [], "key_bits"),
                            (tmp_path / "other.ptc", [], "another model")):
        r = CliRunner().invoke(app, ["serve", str(native_path), "--prompt-cache", str(f), *flags])
        lines = [x for x in r.output.strip().splitlines() if x.strip()]
        assert r.exit_code == 1 and len(lines) == 1, r.output
        assert lines[0].startswith("error:") and f.name in lines[0] and named in lines[0], r.output


def _doc(tmp_path):
    p = tmp_path / "doc.txt"
    p.write_text(DOC)
    return p


def test_serve_command_prewarms(native_path, native, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app

    r = CliRunner().invoke(app, ["cache-prompt", str(native_path), "--prompt-file", str(_doc(tmp_path)),
                                 "--out", str(tmp_path / "doc.ptc"), "--kv-quantize-keys", "int4"])
    assert r.exit_code == 0, r.output
    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append(app))
    r = CliRunner().invoke(app, ["serve", str(native_path), "--prompt-cache", str(tmp_path / "doc.ptc"),
                                 "--kv-quantize-keys", "int4"])
    assert r.exit_code == 0, r.output
    srv = calls[0].state.server
    assert srv.pool.slots[0].tokens == native.tokenizer.encode(DOC) and srv.pool.slots[0].source is not None
    srv.worker.stop()
    srv.pool.close()
