"""The server's context policy: reserve room for the reply, drop the oldest whole turns.

Unit tests of the fitting functions on the tiny test model, then the real `ollama` client
against a live server with the shipped model (context 512): a conversation longer than the
context where every turn gets a real reply, and unbounded requests that stop at the context.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
ollama = pytest.importorskip("ollama")
httpx = pytest.importorskip("httpx")

from tinygpt_mlx.config import CacheConfig  # noqa: E402
from tinygpt_mlx.server import prompt as pr  # noqa: E402

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "tinygpt-base.tinygpt"
LOGGER = "posttrainllm.server"
WORDS = "the keeper of numbers walked over the lazy dog and counted again "


def _msg(role: str, i: int, n: int = 1) -> dict:
    return {"role": role, "content": f"[{role[0]}{i}] " + WORDS * n}


def _chat(turns: int) -> list[dict]:
    """system, first question, then (answer, question) pairs: the newest message is a question."""
    msgs = [{"role": "system", "content": "You are terse."}, _msg("user", 0)]
    for i in range(turns):
        msgs += [_msg("assistant", i), _msg("user", i + 1)]
    return msgs


# ----- the rules on their own ------------------------------------------------------------------
def test_reserve_rule():
    assert pr.reserve_for(512, None) == 256 and pr.reserve_for(512, -1) == 256 and pr.reserve_for(512, -2) == 256
    assert pr.reserve_for(512, 32) == 32 and pr.reserve_for(512, 4000) == 256
    assert pr.reserve_for(512, 0) == 1 and pr.reserve_for(2, None) == 1 and pr.reserve_for(3, 5) == 1


def test_context_is_unbounded_where_the_cache_can_go_past_it(native):
    assert pr.context_limit(native, CacheConfig(), None) == native.context_length == 256
    assert pr.context_limit(native, CacheConfig(), 4096) == 256 and pr.context_limit(native, CacheConfig(), 64) == 64
    assert pr.context_limit(native, CacheConfig(sink=4, window=64), None) is None      # StreamingLLM: no cut
    assert pr.context_limit(native, CacheConfig(sink=4, window=64), 1000) == 1000      # unless asked


def test_fit_chat_keeps_what_fits_unchanged(native):
    msgs = _chat(1)
    p, stops = pr.fit_chat(native, msgs, 512, 32)
    assert p.truncated is None and p.text == pr.plain_chat_text(msgs) and stops == (pr.PLAIN_TEMPLATE_STOP,)
    assert pr.fit_chat(native, msgs, None, 32)[0].truncated is None      # StreamingLLM / retrieval: no cut


def test_fit_chat_drops_the_oldest_whole_turns(native, caplog):
    tok = native.tokenizer
    msgs = _chat(6)
    full = len(tok.encode(pr.plain_chat_text(msgs)))
    limit, reserve = 400, 40
    assert full > limit                                   # longer than the whole context
    with caplog.at_level(logging.INFO, logger=LOGGER):
        p, _ = pr.fit_chat(native, msgs, limit, reserve)
    budget = limit - reserve
    assert len(p.ids) <= budget and p.budget == budget and p.ids == tok.encode(p.text)
    # the kept prompt is system + first question + the newest k whole turns, for the largest k that fits
    head, rest = msgs[:2], msgs[2:]
    turns = [rest[:1]] + [rest[i:i + 2] for i in range(1, len(rest), 2)]   # [a0], [u1, a1], ..., [u6]
    ks = [k for k in range(1, len(turns) + 1)
          if p.text == pr.plain_chat_text(head + [m for t in turns[len(turns) - k:] for m in t])]
    assert ks, "the kept prompt is not system + first message + whole newest turns"
    k = ks[0]
    assert 1 <= k < len(turns)
    bigger = head + [m for t in turns[len(turns) - k - 1:] for m in t]
    assert len(tok.encode(pr.plain_chat_text(bigger))) > budget        # one more turn would not fit
    r = p.truncated
    assert r["prompt_tokens"] == full and r["kept_tokens"] == len(p.ids) and r["reserved"] >= reserve
    assert r["dropped_messages"] == len(msgs) - 2 - sum(len(t) for t in turns[len(turns) - k:])
    line = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER][-1]
    assert re.fullmatch(rf"context {limit}: dropped {len(turns) - k} oldest turns \({full - len(p.ids)} tokens\), "
                        rf"kept system \+ first message \(\d+ tokens\) and the last {k} turns \(\d+ tokens\); "
                        rf"{limit - len(p.ids)} tokens left for the reply", line), line


def test_fit_chat_gives_up_the_first_message_before_the_system_prompt(native, caplog):
    msgs = _chat(2)
    msgs[1] = _msg("user", 0, n=5)                        # a first message that cannot stay
    with caplog.at_level(logging.INFO, logger=LOGGER):
        p, _ = pr.fit_chat(native, msgs, 256, 64)
    assert p.text == pr.plain_chat_text([msgs[0]] + msgs[3:])       # and its answer, the oldest turn
    assert "dropped 1 oldest turn and the first message" in caplog.text and "kept system (" in caplog.text


def test_fit_chat_cuts_a_newest_message_that_alone_does_not_fit(native, caplog):
    tok = native.tokenizer
    msgs = _chat(1)
    msgs[-1] = {"role": "user", "content": "Title for this chat: " + WORDS * 10 + "THE END"}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        p, _ = pr.fit_chat(native, msgs, 256, 32)
    assert 200 < len(p.ids) <= 256 - 32 and p.text is None and p.truncated["cut_message"]
    text = tok.decode(p.ids)
    assert text.startswith("User: ") and text.endswith("THE END\nAssistant:") and "System" not in text
    assert "the newest message alone" in caplog.text and "kept its newest" in caplog.text and ", dropped 3 earlier messages (" in caplog.text


def test_fit_tokens_keeps_num_keep_and_the_newest():
    ids = list(range(100))
    p = pr.fit_tokens(ids, "text", 64, 16, num_keep=5)           # budget 48
    assert p.ids == ids[:5] + ids[-43:] and p.text is None and p.truncated["num_keep"] == 5
    assert pr.fit_tokens(ids, None, 64, 16).ids == ids[-48:]
    assert pr.fit_tokens(ids, None, 64, 16, num_keep=-1).ids == ids[:24] + ids[-24:]
    assert pr.fit_tokens(ids, None, 64, 16, num_keep=1000).ids == ids[:24] + ids[-24:]
    assert pr.fit_tokens(ids, None, 64, None).ids == ids[-32:]    # unbounded: half the context
    same = pr.fit_tokens(ids[:48], "text", 64, 16)
    assert same.truncated is None and same.text == "text"


# ----- the real ollama client against the shipped model ---------------------------------------
@pytest.fixture(scope="module")
def shipped():
    if not SHIPPED.exists():
        pytest.skip("the shipped model is not in models/")
    from tinygpt_mlx.loading import load
    return load(SHIPPED)


@pytest.fixture(scope="module")
def live(shipped):
    from test_server import _serve

    srv, thread, url = _serve(shipped, max_slots=2, prefill_chunk=256)
    yield url
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.mark.slow
def test_conversation_longer_than_the_context_gets_real_replies(live, shipped, caplog):
    """Open WebUI's case: every turn after the context filled, and a background title request
    holding the whole chat in one message, still get real replies (not 1 token)."""
    c = ollama.Client(host=live)
    opts = {"temperature": 0, "num_predict": 32}
    msgs = [{"role": "system", "content": "You are a storyteller."},
            {"role": "user", "content": "Tell me a long story about a king and his three sons."}]
    total, replies = 0, []
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for turn in range(10):
            r = c.chat(shipped.name, msgs, options=opts)
            replies.append(r.eval_count)
            total = len(shipped.tokenizer.encode(pr.plain_chat_text(msgs)))
            msgs += [{"role": "assistant", "content": r.message.content},
                     {"role": "user", "content": f"What happened next, in part {turn + 2}? Tell me about the "
                                                 "youngest son, the old queen and the river."}]
        history = "\n".join(f"{m['role']}: {m['content']}" for m in msgs)
        title = c.chat(shipped.name, [{"role": "user", "content": "Generate a title for this chat:\n" + history}],
                       options=opts)
    assert total > 512                                        # the conversation outgrew the context
    assert all(n >= 16 for n in replies), replies
    assert title.eval_count >= 16, title.eval_count
    lines = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER]
    drops = [s for s in lines if re.match(r"context 512: dropped \d+ oldest turns? \(\d+ tokens\), kept system "
                                          r"\+ first message", s)]
    assert drops and all(int(re.search(r"(\d+) tokens left", s).group(1)) >= 32 for s in drops), lines
    assert any(s.startswith("context 512: the newest message alone") for s in lines), lines


@pytest.mark.slow
def test_unbounded_request_stops_at_the_context(live, shipped):
    """No num_predict: the reply runs until prompt + reply fill the context (512), not to a cap;
    a bounded request asking for more than fits also stops there ("length")."""
    long, short = "The king had three sons. " * 40, "The king had three sons. " * 4
    for prompt, opts in ((long, {"temperature": 0}), (short, {"temperature": 0, "num_predict": -1, "num_ctx": 64}),
                         (short, {"temperature": 0, "num_predict": 5000, "num_ctx": 72})):
        n, ctx = len(shipped.tokenizer.encode(prompt)), opts.get("num_ctx", 512)
        assert ctx // 2 - 30 < n <= ctx // 2               # fits the half left by the reserve, barely
        r = httpx.post(live + "/api/generate", json={"model": shipped.name, "prompt": prompt, "raw": True,
                                                     "stream": False, "options": opts}, timeout=120).json()
        assert r["done_reason"] == "length" and "truncated" not in r, r
        assert r["prompt_tokens"] == n and len(r["context"]) == ctx and r["eval_count"] == ctx - n


def test_context_option_errors_name_the_field(live, shipped):
    for opts, field in (({"num_keep": -2}, "num_keep"), ({"num_predict": "all"}, "num_predict"),
                        ({"num_ctx": 1}, "num_ctx"), ({"num_keep": 1.5}, "num_keep")):
        r = httpx.post(live + "/api/chat", json={"model": shipped.name, "options": opts,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        err = r.json()["error"]
        assert r.status_code == 400 and field in err and "\n" not in err, err
    r = httpx.post(live + "/v1/chat/completions", json={"model": shipped.name, "max_tokens": -3,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
