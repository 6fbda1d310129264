"""Prompt-cache files that keep the chat template (issue #57).

`cache-prompt` on a model with a chat template saves the document as the opening of the user's
message; `sample --prompt-cache FILE --prompt Q` completes it (a blank line, Q), closes the turn
and opens the assistant's. The answer is the one-shot `sample --prompt "DOC\\n\\nQ"`'s, token for
token: the tokens fed (cached + continuation) are the one-shot prompt's, for tokenizers that
join a document's end to what follows differently (GPT-2's pre-tokenizer: "\\n\\n" before a letter
is two pieces, at the end one; Llama 3's: ".\\n\\n" is one piece), on a tiny mlx-lm Llama directory
and on a GGUF written from it; `serve --prompt-cache` extends the file's slot with such a request
and answers as a cold server. Every contradiction (a templated file continued raw, a raw file
given a system prompt, another template, a file ending inside a reply given a question, no
question) is one line; a raw file (--no-chat-template, or a file before format 6 with no record)
continued on a templated model says so on stderr.

Mutations checked to fail here (one at a time, then reverted): `open_turn` keeping the tokens of
the document and the blank line as encoded alone (no probes); `PromptTurn.message` without the
blank line; `continuation` feeding the question encoded alone; the template check skipped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import TEXT, build_llama_dir
from tests.gguf_writer import write_gguf
from tests.test_chat import CHATML
from tinygpt_mlx import chat_template as ch
from tinygpt_mlx.cli.main import app

runner = CliRunner()

DOC = ("The keeper of the lighthouse was born on 29 June 2007. Every evening the quick brown fox climbs "
       "the stairs, winds the clock and lights the lamp for the lazy dog.\n")
QUESTION = "When was the keeper born?"
# Llama 3's pre-tokenizer (tokenizer.json's Split regex): punctuation takes the line breaks after it.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def tokenizer_json(split: bool) -> str:
    """A byte-level BPE with ChatML's specials, trained on text with paragraphs (so "\n\n" and
    ".\n\n" are tokens), with GPT-2's pre-tokenizer or (`split`) Llama 3's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = (pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if split else pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT, (DOC + "\n") * 5 + "A paragraph.\n\nAnother one.\n\n Indented.\n\n" * 20], trainer)
    return tok.to_str()


def chat_model(path: Path, split: bool, seed: int) -> Path:
    build_llama_dir(path, tokenizer_json(split), seed=seed)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "model_max_length": 256, "chat_template": CHATML}))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """name -> a tiny mlx-lm Llama with a ChatML template: a directory with GPT-2's pre-tokenizer,
    the same as a GGUF, and a directory with Llama 3's pre-tokenizer."""
    root = tmp_path_factory.mktemp("pcache-chat")
    gpt2 = chat_model(root / "gpt2", False, 1)
    return {"dir": gpt2, "gguf": write_gguf(gpt2, root / "gpt2.gguf", "llama"),
            "llama3": chat_model(root / "llama3", True, 2)}


@pytest.fixture(scope="module")
def tokenizers(models) -> dict:
    from tinygpt_mlx.loading import load
    return {k: load(models[k]).tokenizer for k in ("dir", "llama3")}


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(r, *named):
    assert r.exit_code != 0, r.output
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.stderr
    for name in named:
        assert name in r.stderr, (name, r.stderr)


# ----- the tokens: the file's, then the question's, are the one-shot prompt's ---------------------
DOCS = [DOC, DOC.rstrip() + "  \n\n", "Ends with a word", "Ends with digits 2007", 'Ends with a quote "x".',
        "Ends with a colon:", "Zeile mit Umlaut: \u00e4\u00f6\u00fc."]
QUESTIONS = [QUESTION, " When?", "\nWhen?", "\n\nQ: when?", "1. When?", "? when", "(a) when", '"When"',
             "\u00e9t\u00e9?", "\u6771\u4eac?", "- when", "When was the keeper born?\n"]


@pytest.mark.parametrize("which", ["dir", "llama3"])
@pytest.mark.parametrize("system", [None, "Be brief."])
def test_file_tokens_then_question_tokens_are_the_one_shot_prompt(tokenizers, which, system):
    tok = tokenizers[which]
    breaks = {"before": 0, "after": 0}
    for doc in DOCS:
        cached, turn = ch.open_turn(tok, doc, system)
        assert turn.document == doc.rstrip() and turn.system == system and turn.template == ch.template_id(tok)
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "\ue001"}]
        rendered = ch.render(tok, msgs)
        head = ch.encode_fragment(tok, rendered[:rendered.index("\ue001")] + doc.rstrip())
        # the file holds the template's head and the document, but at most its last piece or two
        assert len(cached) >= len(head) - 2, (doc, len(head), len(cached))
        for q in QUESTIONS:
            one_shot = ch.user_prompt_ids(tok, doc.rstrip() + "\n\n" + q, system)
            assert turn.prompt_ids(tok, q) == one_shot
            assert one_shot[:len(cached)] == cached, (doc, q)
            # the document given again, with the question: the same message
            assert turn.prompt_ids(tok, doc.rstrip() + "\n\n" + q) == one_shot
        # no fixed cut serves both tokenizers: the text up to the document's end, or up to the
        # blank line, tokenized alone, is not the start of every one-shot prompt (GPT-2: "\n\n"
        # before a letter is two pieces, at the end one; Llama 3: "." takes the line breaks)
        sep = ch.encode_fragment(tok, rendered[:rendered.index("\ue001")] + doc.rstrip() + "\n\n")
        for cut, ids in (("before", head), ("after", sep)):
            breaks[cut] += sum(ch.user_prompt_ids(tok, doc.rstrip() + "\n\n" + q, system)[:len(ids)] != ids
                               for q in QUESTIONS)
    assert breaks["after" if which == "dir" else "before"] > 0, breaks


def test_the_record_round_trips_and_bad_records_are_refused():
    turn = ch.PromptTurn("ab" * 32, "user", "Be brief.", "doc")
    assert ch.PromptTurn.from_dict(turn.as_dict()) == turn and ch.PromptTurn.from_dict({}) == ch.PromptTurn()
    for bad in ([], {"turn": "user"}, {"turn": "later", "template": "x"}, {"template": "x"},
                {"turn": "user", "template": "x"}, {"turn": "text", "document": 3}, {"extra": 1}):
        with pytest.raises(ValueError):
            ch.PromptTurn.from_dict(bad)
    # a question that is the document, or starts with it and a line break, is the whole message
    assert turn.message("doc") == "doc" and turn.message("doc\nQ") == "doc\nQ"
    assert turn.message("docs?") == "doc\n\ndocs?" and turn.message("Q") == "doc\n\nQ"


# ----- the CLI: cache-prompt, then sample --prompt-cache, equals one-shot sample ---------------------
def _answer(args, tmp_path, name):
    out = tmp_path / f"{name}.json"
    r = cli("sample", *args, "-n", "12", "--temperature", "0", "--ignore-eos", "--report-json", out)
    assert r.exit_code == 0, r.output
    return r, json.loads(out.read_text())


@pytest.mark.parametrize("which,system", [("dir", "Be brief."), ("gguf", None), ("llama3", None)])
def test_answer_through_the_file_is_the_one_shot_answer(models, tokenizers, tmp_path, which, system):
    from tinygpt_mlx.cache.persist import read_prompt_cache_info

    model = models[which]
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    ptc = tmp_path / "doc.ptc"
    sys_flag = ["--system", system] if system else []
    r = cli("cache-prompt", model, "--prompt-file", doc, "--out", ptc, *sys_flag, "--report-json", tmp_path / "c.json")
    assert r.exit_code == 0, r.output
    assert "opens the user's message" in r.stderr
    made = json.loads((tmp_path / "c.json").read_text())
    assert made["chat"]["turn"] == "user" and made["chat"]["system"] == system
    info = read_prompt_cache_info(ptc)
    assert info.chat["document"] == DOC.rstrip() and info.chat["template"] == made["chat"]["template"]

    via, rv = _answer([model, "--prompt-cache", ptc, "--prompt", QUESTION], tmp_path, "via")
    once, ro = _answer([model, "--prompt", DOC.rstrip() + "\n\n" + QUESTION, *sys_flag], tmp_path, "once")
    assert via.stdout == once.stdout and via.stdout.strip()
    assert "completes the user's message" in via.stderr
    assert rv["prompt_cache"]["cached_tokens"] + rv["prompt_tokens"] == ro["prompt_tokens"]
    assert rv["current_length"] == ro["current_length"] and rv["generated_tokens"] == ro["generated_tokens"] == 12
    # the tokens fed: the file's then the continuation's are the one-shot prompt's
    if which != "gguf":
        tok = tokenizers[which]
        assert info.tokens + ch.PromptTurn.from_dict(info.chat).prompt_ids(tok, QUESTION)[len(info.tokens):] \
            == ch.user_prompt_ids(tok, DOC.rstrip() + "\n\n" + QUESTION, system)
    # the whole message given again through the file: the same answer
    again, _ = _answer([model, "--prompt-cache", ptc, "--prompt", DOC + "\n" + QUESTION], tmp_path, "again")
    assert again.stdout == once.stdout


def test_mismatches_are_one_line_errors_or_notes(models, tmp_path, monkeypatch):
    from tinygpt_mlx.cache import persist

    model = models["dir"]
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    ptc, raw = tmp_path / "doc.ptc", tmp_path / "raw.ptc"
    assert cli("cache-prompt", model, "--prompt-file", doc, "--out", ptc, "--system", "Be brief.").exit_code == 0
    r = cli("cache-prompt", model, "--prompt-file", doc, "--out", raw, "--no-chat-template")
    assert r.exit_code == 0 and "saved as raw text" in r.stderr
    assert persist.read_prompt_cache_info(raw).chat == ch.PromptTurn().as_dict()
    # a templated file: continued raw, without a question, with another system prompt
    one_line_error(cli("sample", model, "--prompt-cache", ptc, "-p", "x", "--no-chat-template"),
                   "--no-chat-template", str(ptc))
    one_line_error(cli("sample", model, "--prompt-cache", ptc), "--prompt", "user's message")
    one_line_error(cli("sample", model, "--prompt-cache", ptc, "-p", "x", "--system", "Be long."), "--system",
                   "'Be brief.'")
    # a raw file cannot take a system prompt; continued with the template's default it says so
    one_line_error(cli("sample", model, "--prompt-cache", raw, "-p", "x", "--system", "S"), "--system", "raw text")
    r = cli("sample", model, "--prompt-cache", raw, "-p", " x", "-n", "2", "--temperature", "0")
    assert r.exit_code == 0 and "holds raw text (made with --no-chat-template)" in r.stderr, r.output
    r = cli("sample", model, "--prompt-cache", raw, "-p", " x", "-n", "2", "--no-chat-template")
    assert r.exit_code == 0 and "raw text" not in r.stderr, r.output
    # a whitespace-only document; a file whose tokens a question's start would re-tokenize
    (tmp_path / "blank.txt").write_text(" \n\n")
    one_line_error(cli("cache-prompt", model, "--prompt-file", tmp_path / "blank.txt", "--out", tmp_path / "b.ptc"),
                   "only whitespace")
    monkeypatch.setattr(ch, "PROBES", ("What",))        # the cut after the blank line, as for "What"
    assert cli("cache-prompt", model, "--prompt-file", doc, "--out", tmp_path / "what.ptc").exit_code == 0
    monkeypatch.undo()
    one_line_error(cli("sample", model, "--prompt-cache", tmp_path / "what.ptc", "-p", " Which?"),
                   "tokenize together", "what.ptc")
    # the extended file ends inside the reply: continued without a question only
    ext = tmp_path / "ext.ptc"
    r = cli("sample", model, "--prompt-cache", ptc, "-p", QUESTION, "-n", "3", "--temperature", "0",
            "--save-prompt-cache", ext)
    assert r.exit_code == 0, r.output
    assert persist.read_prompt_cache_info(ext).chat["turn"] == "reply"
    one_line_error(cli("sample", model, "--prompt-cache", ext, "-p", "more"), "--prompt", "assistant's reply")
    assert cli("sample", model, "--prompt-cache", ext, "-n", "2").exit_code == 0
    # another chat template on the same weights (same fingerprint): refused
    other = tmp_path / "other-template"
    shutil.copytree(model, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n\n")
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    one_line_error(cli("sample", other, "--prompt-cache", ptc, "-p", "x"), "another chat template", str(ptc))


def test_a_file_before_format_6_is_raw_and_says_so(models, tmp_path, monkeypatch):
    """A version-5 file (no chat record) loads; on a templated model sample continues it as raw
    text with a note naming why."""
    from tinygpt_mlx.cache import make_cache, persist
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.generate import prefill
    from tinygpt_mlx.loading import load

    loaded = load(models["dir"])
    ids = loaded.tokenizer.encode(DOC)
    monkeypatch.setattr(persist, "FORMAT_VERSION", 5)
    with make_cache(loaded.model, CacheConfig()) as cache:
        logits = prefill(loaded.model, ids, cache, 64)
        persist.save_prompt_cache(tmp_path / "v5.ptc", cache, loaded, ids, logits)
    monkeypatch.undo()
    info = persist.read_prompt_cache_info(tmp_path / "v5.ptc")
    assert info.chat is None and persist.tinygpt_format.read_header(info.path)[1]["format_version"] == "5"
    r = cli("sample", models["dir"], "--prompt-cache", tmp_path / "v5.ptc", "-p", " x", "-n", "2")
    assert r.exit_code == 0 and "holds raw text (no chat-template record" in r.stderr, r.output


# ----- serve --prompt-cache ----------------------------------------------------------------------
def test_server_extends_a_templated_file_like_a_cold_server(models, tmp_path):
    httpx = pytest.importorskip("httpx")
    from tinygpt_mlx.cache.persist import PromptCacheError, read_prompt_cache_info
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.loading import load
    from tinygpt_mlx.server.app import create_app, serve_in_thread

    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    ptc, raw = tmp_path / "doc.ptc", tmp_path / "raw.ptc"
    assert cli("cache-prompt", models["dir"], "--prompt-file", doc, "--out", ptc).exit_code == 0
    assert cli("cache-prompt", models["dir"], "--prompt-file", doc, "--out", raw, "--no-chat-template").exit_code == 0
    loaded = load(models["dir"])
    cached = read_prompt_cache_info(ptc).tokens
    one_shot = ch.user_prompt_ids(loaded.tokenizer, DOC.rstrip() + "\n\n" + QUESTION)
    body = {"model": loaded.name, "prompt": DOC.rstrip() + "\n\n" + QUESTION, "stream": False,
            "options": {"temperature": 0, "num_predict": 8}}
    chat = {"model": loaded.name, "messages": [{"role": "user", "content": body["prompt"]}], "stream": False,
            "options": body["options"]}
    answers = {}
    for run, files in (("generate", [ptc, raw]), ("chat", [ptc, raw]), ("cold", [])):
        app = create_app(loaded, CacheConfig(), max_slots=3, prefill_chunk=64, prompt_caches=files)
        notes = app.state.server.prewarm_notes
        srv, thread, url = serve_in_thread(app)
        try:
            got = httpx.post(url + ("/api/chat" if run == "chat" else "/api/generate"),
                             json=chat if run == "chat" else body, timeout=60).json()
            recent = httpx.get(url + "/api/slots").json()["recent"]
        finally:
            srv.should_exit = True
            thread.join(timeout=10)
        answers[run] = (got["message"]["content"] if run == "chat" else got["response"], got["eval_count"])
        if files:
            assert [n.split(":")[0].split(" ")[0] for n in notes] == [str(ptc), str(raw)]
            assert "opens a user message" in notes[0] and "holds raw text" in notes[1]
            assert recent[-1]["action"] == "extend" and recent[-1]["slot"] == 0
            assert got["prompt_eval_count"] == len(one_shot) - len(cached)
        else:
            assert got["prompt_eval_count"] == len(one_shot)
    assert answers["generate"] == answers["chat"] == answers["cold"] and answers["cold"][1] > 0
    # a file made with another chat template does not start
    other = tmp_path / "other-template"
    shutil.copytree(models["dir"], other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0]['content'] }}"
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(PromptCacheError, match="another chat template"):
        create_app(load(other), CacheConfig(), max_slots=1, prompt_caches=[ptc])
