"""The needle scorer behind the docs' pass counts (evaluate/needle.py): the verdict `passed`
on hand-made outputs, the ground-truth `needle_positions`, a cell's verdict end to end from
scripted greedy tokens (`run_cell`), and the grid's summary counts.

Mutations these tests were checked to catch (one at a time, then reverted): `passed` without
`strip()`, without the extra-digit check, with `in` instead of `startswith`; `needle_positions`
without the -1/+1 margin or searching the last occurrence; `run_cell` decoding one token
fewer; the summary counting cells instead of passes.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate import needle
from tinygpt_mlx.evaluate.needle import needle_positions, passed

ANSWER = "48213"


@pytest.mark.parametrize("text, verdict", [
    ("48213", True),                      # the answer, nothing else
    (" 48213", True),                     # after the prompt's "is" the answer comes with a space
    ("\n48213", True),                    # ... or on a new line
    (" \n 48213.", True),                 # any leading whitespace; punctuation after it
    (" 48213. Remember it", True),        # the model going on after the answer
    (" 48213\n", True),
    (" 48214", False),                    # wrong last digit
    (" 58213", False),                    # wrong first digit
    (" 482130", False),                   # an extra digit: a longer number is not the answer
    (" 4821", False),                     # a digit short
    (" 4821 3", False),                   # split by a space
    ("", False),                          # nothing
    (" ", False),
    (" The pass key is 48213", False),    # the answer later in the text does not count
    (" 148213", False),                   # a digit in front
    (" 48,213", False),
])
def test_passed_on_hand_made_outputs(text, verdict):
    assert passed(text, ANSWER) is verdict


def test_passed_other_answers():
    assert passed(" 7", "7") and not passed(" 70", "7") and passed(" 7 apples", "7")
    assert passed(" 100", "100") and not passed(" 1000", "100")


def test_needle_positions_char_level():
    """With one token per character the value's tokens are exact: the margin is one each side."""
    encode = list                                     # one token per character
    prompt = "abc 48213 xyz 48213"
    assert needle_positions(encode, prompt, ANSWER) == list(range(3, 10))   # chars 4..8, +-1
    assert needle_positions(encode, ANSWER + " tail", ANSWER) == list(range(0, 6))  # no -1 at 0
    assert needle_positions(encode, prompt, "999") == []


def test_needle_positions_cover_the_value_in_real_tokens(native):
    """With the BPE tokenizer: the span covers every token that holds a digit of the value and
    at most one token more on each side."""
    tok = native.tokenizer
    prompt = ("The quick brown fox jumps over the lazy dog. The pass key is 48213. Remember it. "
              "The quick brown fox. What is the pass key? The pass key is")
    ids = tok.encode(prompt)
    pos = needle_positions(tok.encode, prompt, ANSWER)
    assert pos == list(range(pos[0], pos[-1] + 1)) and pos[-1] < len(ids)
    # the tokens strictly inside the margin decode to text that contains the value ...
    assert ANSWER in tok.decode(ids[pos[0]:pos[-1] + 1])
    # ... and dropping the margin on both sides loses at most the value's edges, never more
    inner = tok.decode(ids[pos[0] + 1:pos[-1]])
    assert inner.strip(" .") and set(inner.strip(" .")) <= set(ANSWER + ". ")
    # the first occurrence (the needle), not the question's later text
    assert pos[0] < len(tok.encode(prompt[:prompt.find("Remember")]))


class Scripted:
    """Stands in for `generate.forward`: each call's logits put all mass on the next scripted
    token, so `run_cell` decodes exactly the given tokens."""

    def __init__(self, tokens: list[int], vocab: int):
        self.tokens, self.vocab, self.calls = list(tokens), vocab, 0

    def __call__(self, model, x, cache, last=False):
        L = 1 if last else x.shape[1]
        self.calls += 1
        t = self.tokens.pop(0) if self.tokens else 0
        row = mx.where(mx.arange(self.vocab) == t, 10.0, -10.0)
        return mx.broadcast_to(row, (1, L, self.vocab))


@pytest.mark.parametrize("output, verdict", [
    (" 48213. Remember it.", True),
    ("\n48213\n", True),
    (" 48214. Remember it.", False),
    (" 482135 Remember it.", False),   # the extra digit lies inside the decoded tokens
    (" The pass key is 48213.", False),
])
def test_run_cell_verdict_from_scripted_greedy_tokens(native, monkeypatch, output, verdict):
    tok = native.tokenizer
    vocab = native.model.config.vocab_size
    script = tok.encode(output)
    fake = Scripted(script, vocab)    # one prefill chunk: its logits give the first answer token
    monkeypatch.setattr("tinygpt_mlx.generate.forward", fake)   # the engine's one model call
    ids = tok.encode("What is the pass key? The pass key is")
    cell = needle.run_cell(native.model, tok, CacheConfig(), ids, ANSWER, [], chunk=len(ids))
    n_new = len(tok.encode(" " + ANSWER)) + 1      # the answer's tokens and one more
    assert fake.calls == 1 + (n_new - 1)           # one prefill chunk, then n_new - 1 decode steps
    assert cell["output"] == tok.decode(script[:n_new])
    assert cell["passed"] is verdict, cell["output"]


class Graded:
    """Stands in for `generate.forward` with given logits per call: {token: logit}, -10 elsewhere."""

    def __init__(self, rows: list[dict], vocab: int):
        self.rows, self.vocab = list(rows), vocab

    def __call__(self, model, x, cache, last=False):
        row = np.full(self.vocab, -10.0, dtype=np.float32)
        for t, v in (self.rows.pop(0) if self.rows else {}).items():
            row[t] = v
        return mx.broadcast_to(mx.array(row), (1, 1 if last else x.shape[1], self.vocab))


def test_first_miss_names_the_step_the_answer_leaves_and_the_wanted_tokens_odds(native, monkeypatch):
    """The greedy answer's first step off the answer's own tokens: which, the wanted token's
    probability and rank there, the token taken; none when the answer is read right."""
    tok = native.tokenizer
    vocab = native.model.config.vocab_size
    want = tok.encode(" " + ANSWER)
    ids = tok.encode("What is the pass key? The pass key is")
    right = [{t: 10.0} for t in want] + [{0: 10.0}]
    monkeypatch.setattr("tinygpt_mlx.generate.forward", Graded(right, vocab))
    assert needle.run_cell(native.model, tok, CacheConfig(), ids, ANSWER, [], chunk=len(ids))["first_miss"] is None

    at = len(want) - 1                                   # the last answer token is misread
    wrong, other = [t for t in range(1, vocab) if t != want[at]][:2]
    rows = [{t: 10.0} for t in want[:at]] + [{wrong: 10.0, other: 9.0, want[at]: 8.0}, {0: 10.0}]
    monkeypatch.setattr("tinygpt_mlx.generate.forward", Graded(rows, vocab))
    miss = needle.run_cell(native.model, tok, CacheConfig(), ids, ANSWER, [], chunk=len(ids))["first_miss"]
    z = np.exp(10.0) + np.exp(9.0) + np.exp(8.0) + (vocab - 3) * np.exp(-10.0)
    assert miss["step"] == at and miss["rank"] == 2
    assert miss["want"] == tok.decode([want[at]]) and miss["got"] == tok.decode([wrong])
    assert abs(miss["p"] - np.exp(8.0) / z) < 1e-4


def test_grid_summary_counts_passes(native, monkeypatch):
    """needle_grid's summary: cells and passes per policy, as the docs' 75/75 are read."""
    calls = []

    def fake_run_cell(model, tokenizer, config, ids, answer, truth, chunk, on_chunk=None, context=None, tail=0):
        calls.append((config, answer, truth))
        ok = not config.retrieval and config.window is None       # only "full" passes
        return {"passed": ok, "answer": answer, "output": answer if ok else "0", "values": 1,
                "values_right": int(ok)}

    monkeypatch.setattr(needle, "run_cell", fake_run_cell)
    retrieval = CacheConfig(hot_budget=24, page_size=8, top_pages=2, retrieve_tokens=8)
    filler = "The quick brown fox jumps over the lazy dog. " * 100
    r = needle.needle_grid(native, retrieval, [60, 120], [0.25, 0.75], 3,
                           ["full", "streaming", "retrieval"], filler)
    assert len(calls) == 2 * 2 * 3 * 3
    assert r["summary"] == {"full": {"cells": 12, "passed": 12, "pass_rate": 1.0, "values_right": 12, "values": 12},
                            "streaming": {"cells": 12, "passed": 0, "pass_rate": 0.0, "values_right": 0, "values": 12},
                            "retrieval": {"cells": 12, "passed": 0, "pass_rate": 0.0, "values_right": 0, "values": 12}}
    # the ground truth handed to the retrieval cells locates the answer in the prompt
    for config, answer, truth in calls:
        assert truth and len(answer) == 5 and answer.isdigit()


def test_needle_positions_mark_every_value_of_a_keyed_all_answer():
    """--task keyed-all: the answer states several values; the truth marks each of them."""
    encode = list
    prompt = "x 4821 y 7731 z. What are the numbers? A is"
    pos = needle_positions(encode, prompt, "4821. B is 7731.")
    assert pos == list(range(1, 7)) + list(range(8, 14))


@pytest.mark.parametrize("task", ["keyed", "keyed-all", "phonebook"])
def test_grid_runs_each_task_and_hands_retrieval_the_values(native, monkeypatch, task):
    calls = []

    def fake_run_cell(model, tokenizer, config, ids, answer, truth, chunk, on_chunk=None, context=None, tail=0):
        calls.append((tokenizer.decode(ids), answer, truth))
        return {"passed": False, "answer": answer, "output": "", "values": len(re.findall(r"\d+", answer)),
                "values_right": 0}

    monkeypatch.setattr(needle, "run_cell", fake_run_cell)
    retrieval = CacheConfig(hot_budget=24, page_size=8, top_pages=2, retrieve_tokens=8)
    filler = "The quick brown fox jumps over the lazy dog. " * 100
    r = needle.needle_grid(native, retrieval, [200], [0.5], 2, ["retrieval"], filler, task=task, facts=3)
    assert r["task"] == task and len(calls) == 2
    for prompt, answer, truth in calls:
        values = re.findall(r"\d+", answer)
        assert len(values) == (3 if task == "keyed-all" else 1) and len(values[0]) == 5
        assert all(v in prompt for v in values) and len(truth) >= 3 * len(values)
        if task == "phonebook":
            assert "fox" not in prompt                    # dense: no prose filler
    assert r["summary"]["retrieval"]["values"] == 2 * (3 if task == "keyed-all" else 1)


def test_as_chat_puts_the_question_in_a_user_turn(native):
    from tinygpt_mlx.evaluate.needle import as_chat, cell_document, needle_positions

    tok = native.tokenizer
    prompt, answer = cell_document(tok, "In the beginning God created the heaven. " * 80, 300, 0.5, 0)
    q = prompt.rfind("?")
    chat = as_chat(tok, prompt)
    assert chat == tok.chat_prompt([{"role": "user", "content": prompt[:q + 1]}]) + prompt[q + 1:].strip()
    assert chat.endswith("The pass key is") and prompt[:q + 1] in chat
    assert needle_positions(tok.encode, chat, answer)     # the needle is still in the document


def test_lead_in_replaces_the_answer_s_lead_in(native):
    """--lead-in ends every prompt, raw or in the chat template, with the given words instead of
    the question's own, and the document before it is untouched."""
    from tinygpt_mlx.evaluate.needle import as_chat, cell_document, with_lead_in

    tok = native.tokenizer
    prompt, _ = cell_document(tok, "In the beginning God created the heaven. " * 80, 300, 0.5, 0)
    q = prompt.rfind("?")
    assert with_lead_in(prompt, None) == prompt
    assert with_lead_in(prompt, "The pass key is number") == prompt[:q + 1] + " The pass key is number"
    chat = as_chat(tok, prompt, "The pass key is number")
    assert chat == as_chat(tok, prompt)[:-len("The pass key is")] + "The pass key is number"


def test_lead_in_reaches_the_grid_and_blank_is_refused(native, native_path, tmp_path):
    import json

    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app
    from tinygpt_mlx.evaluate.inputs import read_text
    from tinygpt_mlx.evaluate.needle import DEFAULT_FILLER, cell_document, with_lead_in

    out = tmp_path / "grid.json"
    args = ["needle", str(native_path), "--contexts", "128", "--depths", "0.5", "--seeds", "1",
            "--policies", "full", "--kiv-hot-budget", "64"]
    r = CliRunner().invoke(app, args + ["--lead-in", "The number is", "--json", str(out)])
    assert r.exit_code == 0, r.output
    cell, = json.loads(out.read_text())["cells"]
    prompt, _ = cell_document(native.tokenizer, read_text(DEFAULT_FILLER), 128, 0.5, 0)
    assert cell["prompt_tokens"] == len(native.tokenizer.encode(with_lead_in(prompt, "The number is")))
    assert cell["prompt_tokens"] != len(native.tokenizer.encode(prompt))
    bad = CliRunner().invoke(app, args + ["--lead-in", "  "])
    assert bad.exit_code != 0 and "--lead-in" in bad.output


def test_first_seed_runs_the_later_documents_and_a_negative_one_is_refused(native_path, tmp_path):
    import json

    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app

    args = ["needle", str(native_path), "--contexts", "128", "--depths", "0.5", "--policies", "full",
            "--kiv-hot-budget", "64"]
    whole, later = tmp_path / "whole.json", tmp_path / "later.json"
    assert CliRunner().invoke(app, args + ["--seeds", "3", "--json", str(whole)]).exit_code == 0
    r = CliRunner().invoke(app, args + ["--seeds", "2", "--first-seed", "1", "--json", str(later)])
    assert r.exit_code == 0, r.output
    cells = json.loads(whole.read_text())["cells"]
    got = json.loads(later.read_text())
    assert got["first_seed"] == 1 and [c["seed"] for c in got["cells"]] == [1, 2]
    same = ("seed", "answer", "output", "prompt_tokens", "passed")   # not timings or RSS
    assert [[c[k] for k in same] for c in got["cells"]] == [[c[k] for k in same] for c in cells[1:]]
    bad = CliRunner().invoke(app, args + ["--first-seed", "-1"])
    assert bad.exit_code != 0 and "--first-seed -1" in bad.output


def test_the_oracle_offers_the_needle_s_pages_to_every_pass(native):
    """`run_cell(oracle=True)` (`needle --probe`): the needle's pages are in every pass's pool, so
    with a fetch budget larger than any pool every needle token is fetched at every pass, where
    the coarse pass alone (top 1 page) misses them; the cell's pages are pinned, not its answer."""
    tok = native.tokenizer
    prompt, answer = needle.cell_document(tok, "The quick brown fox jumps over the lazy dog. " * 100, 240, 0.1, 0)
    ids, truth = list(tok.encode(prompt)), needle_positions(tok.encode, prompt, answer)
    config = CacheConfig(hot_budget=32, page_size=8, top_pages=1, retrieve_tokens=256, sticky=False)
    plain = needle.run_cell(native.model, tok, config, ids, answer, truth, chunk=32)
    oracle = needle.run_cell(native.model, tok, config, ids, answer, truth, chunk=32, oracle=True)
    assert plain["telemetry"]["token_recall"] < 0.5
    assert oracle["telemetry"]["token_recall"] == 1.0
    assert oracle["prompt_tokens"] == plain["prompt_tokens"] == len(ids)


def test_pin_is_refused_where_retrieval_has_no_pool(native):
    from tinygpt_mlx.cache import make_cache

    with make_cache(native.model, CacheConfig(hot_budget=32, page_size=8, retrieved_position="slots")) as cache:
        with pytest.raises(ValueError, match="slots"):
            cache.pin([3, 4])


def test_probe_reruns_only_failed_retrieval_cells_and_counts_the_verdicts(native, monkeypatch):
    """--probe: a failed retrieval cell runs again with the oracle, and keeps its verdict:
    "ranking" where the oracle answers, "reading" where it does not; the summary counts them."""
    calls = []

    def fake_run_cell(model, tokenizer, config, ids, answer, truth, chunk, on_chunk=None, oracle=False, context=None,
                      tail=0):
        calls.append((config.retrieval, oracle))
        depth_low = truth[0] < len(ids) / 2
        ok = (not config.retrieval) or (oracle and depth_low)   # the oracle rescues the shallow needle only
        return {"passed": ok, "answer": answer, "output": answer if ok else "0", "values": 1,
                "values_right": int(ok), "first_miss": None,
                "telemetry": {"token_recall": 0.75 if oracle else 0.05, "token_any": 1.0 if oracle else 0.1}}

    monkeypatch.setattr(needle, "run_cell", fake_run_cell)
    retrieval = CacheConfig(hot_budget=24, page_size=8, top_pages=2, retrieve_tokens=8)
    filler = "The quick brown fox jumps over the lazy dog. " * 100
    r = needle.needle_grid(native, retrieval, [120], [0.1, 0.9], 2, ["full", "retrieval"], filler, probe=True)
    assert calls.count((True, True)) == 4 and calls.count((False, False)) == 4    # 4 failed, 4 full cells
    cells = {(c["policy"], c["depth"]): c for c in r["cells"]}
    assert all("probe" not in c for c in r["cells"] if c["policy"] == "full")
    assert cells["retrieval", 0.1]["probe"]["verdict"] == "ranking"
    assert cells["retrieval", 0.9]["probe"]["verdict"] == "reading"
    # the recall is the telemetry's token_recall (the needle's tokens fetched), not token_any
    assert cells["retrieval", 0.9]["probe"]["oracle_token_recall"] == 0.75
    assert cells["retrieval", 0.9]["probe"]["oracle_token_any"] == 1.0
    assert r["summary"]["retrieval"]["probed"] == 4 and r["summary"]["retrieval"]["ranking_misses"] == 2
    assert "probed" not in r["summary"]["full"]


def test_probe_needs_a_pooled_retrieval_policy(native_path):
    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app

    args = ["needle", str(native_path), "--contexts", "128", "--depths", "0.5", "--seeds", "1",
            "--kiv-hot-budget", "64", "--probe"]
    r = CliRunner().invoke(app, args + ["--policies", "full,streaming"])
    assert r.exit_code != 0 and "--probe" in r.output and "'full,streaming'" in r.output
    r = CliRunner().invoke(app, args + ["--policies", "retrieval", "--kiv-positions", "slots"])
    assert r.exit_code != 0 and "--kiv-positions slots" in r.output


def test_retrieval_cells_take_original_positions_only_inside_the_context(native_path, tmp_path):
    """The retrieval policy's default positions are the run's (`CacheConfig.for_run`): a cell whose
    prompt and answer fit the model's context (256) reads at original positions, as naming
    absolute does, a longer one at cache slots; the grid's StreamingLLM keeps its slots."""
    import json

    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app

    args = ["needle", str(native_path), "--contexts", "128,400", "--depths", "0.5", "--seeds", "1",
            "--policies", "streaming,retrieval", "--kiv-hot-budget", "32"]

    def cells(*extra):
        out = tmp_path / "grid.json"
        r = CliRunner().invoke(app, args + ["--json", str(out), *extra])
        assert r.exit_code == 0, r.output
        return {(c["policy"], c["context"]): c for c in json.loads(out.read_text())["cells"]}

    auto = cells()
    said = CliRunner().invoke(app, args + ["--contexts", "128", "--policies", "retrieval"])
    assert "original RoPE positions where a cell fits the context" in said.stderr
    assert {k: c["rope_mode"] for k, c in auto.items()} == {
        ("streaming", 128): "shifted", ("retrieval", 128): "absolute",
        ("streaming", 400): "shifted", ("retrieval", 400): "shifted"}
    named = {"absolute": cells("--streaming-llm-rope", "absolute"), "shifted": cells("--streaming-llm-rope", "shifted")}
    for key, cell in auto.items():
        if key[0] == "retrieval":
            assert cell["output"] == named[cell["rope_mode"]][key]["output"]
            assert cell["telemetry"] == named[cell["rope_mode"]][key]["telemetry"]
    assert all(c["rope_mode"] == "shifted" for c in named["shifted"].values())


def test_past_context_runs_the_full_cache_past_the_model_s_context(native_path, tmp_path):
    """The full cache skips the cells longer than the model's context (256) unless --past-context;
    with it, a 400-token cell runs, and as a StreamingLLM window larger than its prompt (nothing
    evicted, the same positions) answers it, the same output and token count."""
    import json

    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app

    args = ["needle", str(native_path), "--contexts", "128,400", "--depths", "0.5", "--seeds", "1",
            "--policies", "full,streaming", "--streaming-llm-sink", "4", "--kiv-hot-budget", "1024"]

    def cells(*extra):
        out = tmp_path / "grid.json"
        r = CliRunner().invoke(app, args + ["--json", str(out), *extra])
        assert r.exit_code == 0, r.output
        got = json.loads(out.read_text())
        return got, {(c["policy"], c["context"]): c for c in got["cells"]}

    plain, skipped = cells()
    assert plain["past_context"] is False and sorted(skipped) == [("full", 128), ("streaming", 128), ("streaming", 400)]
    assert plain["summary"]["full"]["cells"] == 1
    past, ran = cells("--past-context")
    assert past["past_context"] is True and sorted(ran) == sorted([*skipped, ("full", 400)])
    full, window = ran[("full", 400)], ran[("streaming", 400)]
    assert full["prompt_tokens"] > 256 and full["prompt_tokens"] == window["prompt_tokens"]
    assert full["output"] == window["output"] and full["passed"] == window["passed"]
    assert ran[("full", 128)]["output"] == skipped[("full", 128)]["output"]
    bad = CliRunner().invoke(app, args[:-6] + ["--policies", "streaming", "--past-context"])
    assert bad.exit_code != 0 and "--past-context" in bad.output and "has no full" in bad.output
