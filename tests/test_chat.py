"""`posttrainllm chat` and the chat-template helper (`tinygpt_mlx.chat`), issue #19.

A scripted chat through stdin on the shipped model (plain turn format) and on a tiny mlx-lm
Llama with a ChatML template: each turn's prefill (the cache's currentLength counter) is only
its new tokens; every reply equals `sample` (greedy) run on the concatenated transcript before
it; the transcript is the template applied exactly as mlx-lm's tokenizer applies it. A template
that re-renders earlier turns takes the documented fallback. Ctrl-C (SIGINT) mid-answer keeps
the session; 200 turns under a window stay at sink + window stored tokens."""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tinygpt_mlx.cli.main import app
from tests.conftest import TEXT, build_llama_dir
from tinygpt_mlx import chat_template as ch
from tinygpt_mlx.config import CacheConfig, SampleConfig

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "models" / "tinygpt-base.tinygpt"
runner = CliRunner()

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Re-renders its header every turn (a message count), so the conversation so far is not a prefix
# of the longer one: the fallback rule.
COUNTING = ("<|im_start|>system\nmessages: {{ messages | length }}<|im_end|>\n"
            "{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = ["Tell me about the quick brown fox.", "And the lazy dog?", "What was the word with?"]
# The shipped model's first answer ends at the stop string "\nUser:" (it writes "\nUser" itself):
# the cache already holds that text, and the next turn must not add it again.
SHIPPED_MESSAGES = ["Say amen.\nAssistant: Amen.\nUser: Say amen.\nAssistant: Amen.\nUser: Say amen.",
                    "Tell me about the quick brown fox.", "What was the word with?"]


def chat_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return tok.to_str()


def templated_llama(path: Path, template: str) -> Path:
    build_llama_dir(path, chat_tokenizer_json(), seed=1)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "model_max_length": 256, "chat_template": template}))
    return path


@pytest.fixture(scope="module")
def chat_llama_dir(tmp_path_factory) -> Path:
    return templated_llama(tmp_path_factory.mktemp("chatml") / "chat-llama", CHATML)


def run(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def report(path: Path) -> dict:
    return json.loads(path.read_text())


# ----- the template, exactly as mlx-lm applies it ---------------------------------------------------
def test_template_ids_are_mlx_lm_s(chat_llama_dir, tmp_path):
    from tinygpt_mlx.loading import load
    loaded = load(chat_llama_dir)
    w = loaded.tokenizer._wrapper
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ids = ch.prompt_ids(loaded.tokenizer, msgs)
    assert ids == list(w.apply_chat_template(msgs, add_generation_prompt=True))
    # mlx_lm.generate: the template's text, encoded without added special tokens
    text = w.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert ids == w.encode(text, add_special_tokens=False)
    assert ids[0] == w.convert_tokens_to_ids("<|im_start|>")

    # sample applies it (and --system); --no-chat-template sends the prompt raw
    out = tmp_path / "r.json"
    r = run("sample", chat_llama_dir, "-p", "Hello there", "--system", "Be brief.", "-n", "8",
            "--temperature", "0", "--report-json", out)
    assert r.exit_code == 0, r.output
    assert report(out)["prompt_tokens"] == len(ids)
    from tinygpt_mlx.generate import stream_generate
    chunks = list(stream_generate(loaded, ids, CacheConfig(), SampleConfig(max_tokens=8, temperature=0.0)))
    assert r.stdout == "".join(x.text for x in chunks) + ("\n" if "".join(x.text for x in chunks) else "")
    r = run("sample", chat_llama_dir, "-p", "Hello there", "-n", "1", "--no-chat-template", "--report-json", out)
    assert r.exit_code == 0, r.output
    assert report(out)["prompt_tokens"] == len(loaded.tokenizer.encode("Hello there"))


def sample_ids(loaded, ids, n, capsys) -> str:
    """`posttrainllm sample`'s streaming (tinygpt_mlx.cli.sample.run) on token ids, greedy: its stdout."""
    from tinygpt_mlx.cli.sample import run as sample_run
    capsys.readouterr()
    sample_run(loaded, ids, CacheConfig(), SampleConfig(max_tokens=n, temperature=0.0), None, None)
    return capsys.readouterr().out


# ----- a scripted three-turn chat -------------------------------------------------------------------
@pytest.mark.parametrize("which", ["shipped", "chatml"])
def test_three_turn_chat_feeds_only_new_tokens_and_equals_sample(which, chat_llama_dir, tmp_path, capsys):
    from tinygpt_mlx.loading import load
    model = SHIPPED if which == "shipped" else chat_llama_dir
    loaded = load(model)
    tok = loaded.tokenizer
    out = tmp_path / "chat.json"
    messages = MESSAGES
    r = run("chat", model, "--temperature", "0", "--tokens", "24", "--report-json", out,
            input="\n".join(messages) + "\n")
    assert r.exit_code == 0, r.output
    rep = report(out)
    turns, transcript = rep["turns"], rep["transcript_tokens"]
    assert len(turns) == 3 and [t["rule"] for t in turns] == ["first", "prefix", "prefix"]
    # stdout: the replies, each on its own line end
    assert r.stdout == "".join(t["reply"] + ("" if t["reply"].endswith("\n") else "\n") for t in turns)

    # 1. each turn's prefill is its new tokens only, by the cache's own counter (currentLength)
    for k, t in enumerate(turns):
        assert t["prefilled"] == t["new_tokens"] > 0
        if k:
            assert t["new_tokens"] < t["reply_offset"] / 2       # far less than the whole history
            # the previous reply's unfed last token + the template's text, nothing more
            prev = turns[k - 1]
            assert t["reply_offset"] - t["new_tokens"] == prev["current_length"]
    # the cache holds exactly the transcript, minus the last reply's unfed token (if any)
    last = turns[-1]
    assert len(transcript) == last["reply_offset"] + last["generated"]
    assert len(transcript) - last["current_length"] in (0, 1)

    # 2. each reply equals `sample` (greedy, no template) run on the concatenated transcript before it:
    # through the command as text where the transcript's text re-encodes to its tokens; where it
    # does not (the random tiny Llama's replies, which its BPE would merge differently; a reply cut
    # at a stop string), through `sample`'s own streaming function as the token ids.
    as_text = 0
    for t in turns:
        before = transcript[:t["reply_offset"]]
        got = tok.decode(transcript[t["reply_offset"]:t["reply_offset"] + t["generated"]])
        text = tok.decode(before)
        if ch.encode_fragment(tok, text) == before:
            as_text += 1
            (tmp_path / "p.txt").write_text(text, encoding="utf-8")
            s = run("sample", model, "--prompt-file", tmp_path / "p.txt", "--no-chat-template", "--temperature", "0",
                    "-n", str(t["generated"]), "--report-json", tmp_path / "s.json")
            assert s.exit_code == 0, s.output
            assert report(tmp_path / "s.json")["prompt_tokens"] == len(before)
            sampled = s.stdout
        else:
            sampled = sample_ids(loaded, before, t["generated"], capsys)
        # sample has no stop strings: its text is the reply's tokens, the chat's reply a prefix of it
        assert sampled == got + ("" if got.endswith("\n") or not got else "\n")
        assert got.startswith(t["reply"])
    assert as_text == 3 if which == "shipped" else as_text >= 1

    # 3. the transcript is the template applied to the conversation (exactly, as text)
    msgs = []
    for m, t in zip(messages, turns):
        msgs += [{"role": "user", "content": m}]
        before = transcript[:t["reply_offset"]]
        if which == "chatml":
            w = tok._wrapper
            assert tok.decode(before) == w.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            assert tok.decode(before) == ch.plain_text(msgs)
        msgs += [{"role": "assistant", "content": t["reply"]}]


def test_a_reply_cut_at_the_stop_string_is_not_fed_twice(capsys):
    from tinygpt_mlx.chat import ChatSession
    from tinygpt_mlx.loading import load
    loaded = load(SHIPPED)
    tok = loaded.tokenizer
    s = ChatSession(loaded, CacheConfig(), SampleConfig(temperature=0.0, max_tokens=24))
    reply = "".join(s.say(SHIPPED_MESSAGES[0]))
    conv = s.conversation
    assert s.turns[0].finish_reason == "stop" and reply == " Amen."
    assert conv.extra == "\nUser:" and tok.decode(conv.pending) == ":"           # "\nUser" fed, ":" not yet
    ids, rule = conv.next_ids(SHIPPED_MESSAGES[1])
    assert ids == conv.pending + tok.encode(" " + SHIPPED_MESSAGES[1] + "\nAssistant:")
    second = "".join(s.say(SHIPPED_MESSAGES[1]))
    t = s.turns[1]
    transcript = conv.transcript_ids()
    before = transcript[:t.reply_offset]
    msgs = [{"role": "user", "content": SHIPPED_MESSAGES[0]}, {"role": "assistant", "content": reply},
            {"role": "user", "content": SHIPPED_MESSAGES[1]}]
    assert tok.decode(before) == ch.plain_text(msgs)
    got = tok.decode(transcript[t.reply_offset:])
    assert got.startswith(second) and sample_ids(loaded, before, t.generated, capsys) == got + "\n"


def test_prefix_and_fallback_rules(tmp_path):
    from tinygpt_mlx.chat import ChatSession
    from tinygpt_mlx.loading import load
    loaded = load(templated_llama(tmp_path / "counting", COUNTING))
    tok = loaded.tokenizer
    s = ChatSession(loaded, CacheConfig(), SampleConfig(temperature=0.0, max_tokens=6), system="Be brief.")
    "".join(s.say(MESSAGES[0]))
    conv = s.conversation
    pending = list(conv.pending)
    ids, rule = conv.next_ids(MESSAGES[1])
    assert rule == "alone"
    # the documented rule: end of turn after the reply, then system + the new message rendered alone
    alone = tok._wrapper.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": MESSAGES[1]}],
                                             tokenize=False, add_generation_prompt=True)
    assert ids == pending + ch.encode_fragment(tok, "<|im_end|>\n" + alone)
    "".join(s.say(MESSAGES[1]))
    assert s.turns[-1].prefilled == len(ids)
    # the plain format has the prefix property whatever the reply starts with
    for reply in (" yes", "yes", "\nyes", ""):
        text, rule = ch.turn_text(tok, [{"role": "user", "content": "hi"}], "next", use_template=False)
        assert rule == "prefix" and text == "\nUser: next\nAssistant:"


# ----- Ctrl-C mid-answer keeps the session ----------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_stops_the_answer_not_the_session(chat_llama_dir, tmp_path):
    out = tmp_path / "c.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "tinygpt_mlx.cli.main", "chat", str(chat_llama_dir), "--temperature", "0",
                          "--tokens", "3000", "--streaming-llm-sink", "4", "--streaming-llm-window", "64",
                          "--report-json", str(out)],
                         cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        p.stdin.write(b"Tell me about the fox.\n")
        p.stdin.flush()
        deadline = time.time() + 60
        got = b""
        while len(got) < 20 and time.time() < deadline:       # the answer is streaming
            if select.select([p.stdout], [], [], 1)[0]:
                got += os.read(p.stdout.fileno(), 4096)
        assert len(got) >= 20, got
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        rest, errs = p.communicate(b"/stats\nAnd the dog?\n", timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, errs.decode()
    turns = report(out)["turns"]
    assert len(turns) == 2, errs.decode()
    assert turns[0]["finish_reason"] == "cancel" and 0 < turns[0]["generated"] < 3000
    assert turns[1]["generated"] > 0 and turns[1]["prefilled"] == turns[1]["new_tokens"]
    assert turns[1]["current_length"] > turns[0]["current_length"] + turns[1]["new_tokens"]
    assert b"currentLength" in errs and b"interrupted" not in errs


def test_ctrl_c_library_level_cancel_keeps_the_conversation(native):
    """`should_stop` mid-answer: what was fed stays, and the next turn continues from it."""
    from tinygpt_mlx.chat import ChatSession
    s = ChatSession(native, CacheConfig(), SampleConfig(temperature=0.0, max_tokens=50, ignore_eos=True))
    n = {"calls": 0}

    def stop():
        n["calls"] += 1
        return n["calls"] > 5
    "".join(s.say("The quick brown fox", should_stop=stop))
    t = s.turns[-1]
    assert t.finish_reason == "cancel" and t.generated == 5
    assert s.cache.current_length == len(s.conversation.fed) == t.reply_offset + 5 and not s.conversation.pending
    "".join(s.say("jumps"))
    assert s.turns[-1].prefilled == s.turns[-1].new_tokens


@pytest.mark.parametrize("policy", ["full", "window"])
def test_save_feeds_the_last_token_and_the_file_continues_like_the_session(native, tmp_path, policy):
    """/save after an answer cut at --tokens (its last sampled token not fed yet): that token is
    fed first, the file holds the whole transcript, and a run continued from the file answers
    the next message exactly as the session does."""
    from tinygpt_mlx.cli.chat import save
    from tinygpt_mlx.cache.persist import load_prompt_cache
    from tinygpt_mlx.chat import ChatSession
    from tinygpt_mlx.generate import steps
    from tinygpt_mlx.sampling import make_sampler
    config = CacheConfig() if policy == "full" else CacheConfig(sink=4, window=16)
    s = ChatSession(native, config, SampleConfig(temperature=0.0, max_tokens=6, ignore_eos=True))
    "".join(s.say("The quick brown fox"))
    assert len(s.conversation.pending) == 1                 # the 6th token: sampled, not fed
    path = tmp_path / "chat.ptc"
    assert save(s, str(path)) == f"saved {len(s.conversation.fed)} tokens to {path}"
    assert not s.conversation.pending and s.cache.current_length == len(s.conversation.fed)
    restored, info = load_prompt_cache(path, native)
    assert info.tokens == s.conversation.fed and restored.current_length == s.cache.current_length
    before = len(s.conversation.fed)
    ids, _ = s.conversation.next_ids("jumps over")
    "".join(s.say("jumps over"))
    want = s.conversation.transcript_ids()[before + len(ids):]
    got = [st.token for st in steps(native.model, ids, restored, make_sampler(0.0), 6, 512) if st.token is not None]
    assert got == want and len(got) == 6


# ----- 200 turns in bounded memory ------------------------------------------------------------------
def test_two_hundred_turns_stay_at_sink_plus_window(native_path, tmp_path):
    out = tmp_path / "w.json"
    msgs = [f"turn {i}: the quick brown fox" for i in range(200)]
    r = run("chat", native_path, "--temperature", "0", "--tokens", "3", "--streaming-llm-sink", "4",
            "--streaming-llm-window", "32", "--report-json", out, input="\n".join(msgs) + "\n")
    assert r.exit_code == 0, r.output
    turns = report(out)["turns"]
    assert len(turns) == 200
    assert all(t["stored_count"] <= 36 for t in turns)
    assert all(t["stored_count"] == 36 for t in turns[5:])
    assert len({t["cache_bytes"] for t in turns[5:]}) == 1
    assert turns[-1]["current_length"] > 200 * 10                    # far past sink + window and the context
    assert all(t["prefilled"] == t["new_tokens"] for t in turns)
    assert max(t["new_tokens"] for t in turns) < 40                  # one message, never the history


def test_stats_say_what_streaming_evicted(native_path):
    msgs = ["the quick brown fox jumps over the lazy dog"] * 6 + ["/stats"]
    r = run("chat", native_path, "--temperature", "0", "--tokens", "4", "--streaming-llm-sink", "4",
            "--streaming-llm-window", "16", input="\n".join(msgs) + "\n")
    assert r.exit_code == 0, r.output
    assert "evicted and are gone" in r.stderr and "stored 20" in r.stderr


def test_chat_help_loads_no_model_code():
    from tests.test_cli_imports import HEAVY, _loaded_after
    loaded = _loaded_after("from typer.testing import CliRunner\nfrom tinygpt_mlx.cli.main import app\n"
                           "r = CliRunner().invoke(app, ['chat', '--help'])\nassert r.exit_code == 0, r.output")
    assert not [m for m in HEAVY if m in loaded]


# ----- long messages stay inside the trained context ------------------------------------------------
def _max_query_position(monkeypatch, held: int):
    """Spy on the engine's one model call: the highest position a query of any pass sits at
    under shifted positions: the stored tokens a pass keeps (at most `held`: a window evicts
    down to window - 1 before new tokens arrive) + the pass's length."""
    import tinygpt_mlx.generate as gen
    real, seen = gen.forward, [0]

    def spy(model, x, cache, **kw):
        seen[0] = max(seen[0], min(cache.stored_count, held) + x.shape[1])
        return real(model, x, cache, **kw)
    monkeypatch.setattr(gen, "forward", spy)
    return seen


@pytest.mark.parametrize("config", [CacheConfig(sink=4, window=200),
                                    CacheConfig(sink=4, hot_budget=128, page_size=16)])
def test_a_long_message_prefills_inside_the_context(native, monkeypatch, config):
    """A message that carries the conversation past the trained context, through a shifted
    window or retrieval: chat narrows its prefill chunks (default 512) so that no query sits
    past the context (without it the first pass reaches sink + window - 1 + 512)."""
    from tinygpt_mlx.chat import ChatSession
    ctx = native.context_length
    seen = _max_query_position(monkeypatch, config.slot_span - 1)
    s = ChatSession(native, config, SampleConfig(temperature=0.0, max_tokens=2, ignore_eos=True))
    "".join(s.say("the quick brown fox " * 40))
    "".join(s.say("the quick brown fox jumps over the lazy dog " * 60))
    assert s.cache.current_length > 2 * ctx
    assert ctx - 8 <= seen[0] <= ctx
    s.close()


def test_fitted_chunk_is_the_widest_inside_the_context():
    cfg = CacheConfig(sink=4, window=200)
    assert cfg.fitted_chunk(512, 256, 256) == 512                   # nothing passes the context
    assert cfg.fitted_chunk(512, 256, 257) == 256 - 203 == 53       # 203 held before each chunk
    assert cfg.fitted_chunk(16, 256, 1000) == 16                    # already narrower
    assert CacheConfig(sink=4, window=200, rope_mode="absolute").fitted_chunk(512, 256, 1000) == 512
    assert CacheConfig().fitted_chunk(512, 256, 1000) == 512        # the full cache: no window to fit


# ----- a late question reaches an early turn through retrieval -----------------------------------------
KEYED = ROOT / "models" / "tinygpt-keyed.tinygpt"
CHAT_FILLER = ["Tell me about the weather in the valley today.", "And the king went up to the city with all his men.",
               "What do the fishermen bring home in the evening?", "The wind came down from the hills and the river rose.",
               "Who keeps the gate of the old town at night?"]


def _ask_after_filler(loaded, config: CacheConfig, rounds: int) -> tuple[str, int]:
    from tinygpt_mlx.chat import ChatSession
    s = ChatSession(loaded, config, SampleConfig(temperature=0.0, max_tokens=12, ignore_eos=True))
    "".join(s.say("The pass key is 48213. Remember it."))
    for text in CHAT_FILLER * rounds:
        "".join(s.say(text))
    reply = "".join(s.say("What is the pass key?"))
    n = s.cache.current_length
    s.close()
    return reply, n


@pytest.mark.skipif(not KEYED.exists(), reason="models/tinygpt-keyed.tinygpt not in this checkout")
@pytest.mark.slow
def test_retrieval_lets_a_late_question_reach_an_early_turn():
    """The keyed model (docs/model.md, stage 3) in a chat: the pass key in turn 1, then 40
    filler turns (1,501 tokens: 2.9x the model's context, 5.7x the hot budget), then the
    question. StreamingLLM with the same hot memory (sink 4 + 256) has evicted the key and
    answers another number; retrieval fetches it back from the cold store and answers it.
    (The full cache cannot hold this conversation: the model's context is 512.) Fails when the
    coarse pass fetches the newest cold pages instead of the best-scoring ones."""
    from tinygpt_mlx.loading import load
    loaded = load(KEYED)
    reply, n = _ask_after_filler(loaded, CacheConfig(sink=4, hot_budget=256), rounds=8)
    assert n > 2.5 * loaded.context_length
    assert "The pass key is 48213" in reply, reply
    reply, _ = _ask_after_filler(loaded, CacheConfig(sink=4, window=256), rounds=8)
    assert "48213" not in reply and "pass key" in reply, reply


def test_a_cancelled_prefill_keeps_the_rest_of_the_message_for_the_next_turn(native):
    """Ctrl-C during a long message's prefill: the chunks fed stay in the cache, the unfed rest is
    pending and is fed first in the next turn, so the cache always holds a prefix of the
    conversation; after the next turn its logits equal a fresh cache fed the whole transcript."""
    import mlx.core as mx

    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.chat import ChatSession
    from tinygpt_mlx.generate import prefill
    s = ChatSession(native, CacheConfig(), SampleConfig(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                        prefill_chunk=8))
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        return calls["n"] >= 2         # checked after each model call: stops after the second chunk
    long_message = "the quick brown fox jumps over the lazy dog " * 4
    ids, _ = s.conversation.next_ids(long_message)
    assert len(ids) > 24
    "".join(s.say(long_message, should_stop=stop))
    t = s.turns[-1]
    assert t.finish_reason == "cancel" and t.generated == 0
    conv = s.conversation
    assert s.cache.current_length == len(conv.fed) == 16
    assert conv.fed == ids[:16] and conv.pending == ids[16:]
    "".join(s.say("jumps"))
    t = s.turns[-1]
    assert t.new_tokens == t.prefilled and t.new_tokens > len(ids) - 16
    s.flush()
    fresh = make_cache(native.model, CacheConfig())
    want = prefill(native.model, conv.fed, fresh, 8)
    assert conv.fed[:len(ids)] == ids and s.cache.current_length == len(conv.fed)
    assert mx.abs(s.logits - want).max().item() < 1e-4


def _fake_session(pieces, templated, finish="stop"):
    from types import SimpleNamespace
    turn = SimpleNamespace(index=1, prefilled=5, generated=3, finish_reason=finish, decode_tokens_per_s=1.0,
                           kernels_built=0, stored_count=8, current_length=8, cache_bytes=64)

    class Fake:
        def __init__(self):
            self.templated, self.turns = templated, []

        def say(self, message, should_stop=None):
            self.turns.append(turn)
            yield from pieces
    return Fake()


@pytest.mark.parametrize("templated", [False, True])
def test_an_empty_answer_is_said_on_stderr(templated, capsys):
    """A turn that ends with no visible text (Gemma 3's pretrained file in `chat`: three tokens,
    then end of turn) says so on stderr, naming the missing chat template where there is none;
    an answer with text, or one cut by the token limit, gets no such line; stdout keeps the text."""
    from tinygpt_mlx.cli import chat as chat_cli

    assert chat_cli.answer(_fake_session(["", "\n", " "], templated), "hi")
    out, errs = capsys.readouterr()
    assert out.strip() == "" and "ended its turn without any text" in errs
    assert ("no chat template" in errs) == (not templated)
    assert chat_cli.answer(_fake_session(["Paris", "."], templated), "hi")
    out, errs = capsys.readouterr()
    assert out == "Paris.\n" and "without any text" not in errs
    assert chat_cli.answer(_fake_session([" "], templated, finish="length"), "hi")
    assert "without any text" not in capsys.readouterr()[1]


def test_save_to_a_missing_folder_names_the_folder_not_a_temporary_file(tmp_path):
    """/save into a folder that does not exist: one line naming what was typed and the folder,
    and the chat goes on (before: `[Errno 2] No such file or directory: '.../.x.pc.1234-ab12cd34.tmp'`,
    the temporary file the save writes through)."""
    target = tmp_path / "missing" / "x.pc"
    r = run("chat", SHIPPED, "--temperature", "0", "--tokens", "2",
            input=f"Hello\n/save {target}\n/save {tmp_path}\n/stats\n")
    assert r.exit_code == 0, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: /save {target}: folder {target.parent} does not exist",
                      f"error: /save {tmp_path}: {tmp_path} is a directory, not a file"], r.stderr
    assert ".tmp" not in r.stderr and not target.parent.exists()
    assert "conversation: 1 turns" in r.stderr                 # the chat went on


@pytest.mark.parametrize("typed, sent, note", [
    (['"""', "first", "second"], [], True),             # Ctrl-D inside a """ block
    (["one \\"], [], True),                              # ... after a line ending in \
    (["whole", '"""'], ["whole"], True),
    (["whole"], ["whole"], False)])
def test_ctrl_d_inside_a_message_says_it_was_not_sent(monkeypatch, capsys, typed, sent, note):
    """At the terminal prompt, Ctrl-D in the middle of a multi-line message ended the chat without
    a word; the message, never sent, is said to be dropped."""
    from tinygpt_mlx.cli import chat as chat_cli

    lines = iter(typed)

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    assert list(chat_cli.read_messages(True)) == sent
    assert ("unfinished message was not sent" in capsys.readouterr().err) == note


def test_zero_tokens_per_answer_is_refused():
    """chat -n 0 answered every message with nothing ('0 generated (token limit), 0.0 tok/s'), exit 0."""
    r = run("chat", SHIPPED, "-n", "0", input="hello\n")
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: Invalid value for '--tokens' / '-n'") and "got '0'" in r.stderr, r.stderr


def test_an_unknown_command_says_how_to_send_a_slash_message():
    """A message that starts with / ('/etc/hosts lists ...') is taken for an unknown command; the
    error and /help say that // sends it (docs/chat.md did, the chat did not)."""
    r = run("chat", SHIPPED, "-n", "1", input="/etc/hosts lists names\n/help\n")
    assert r.exit_code == 0, r.output
    said = [line for line in r.stderr.splitlines() if "//" in line]
    assert len(said) == 2 and said[0].startswith("error: unknown command /etc/hosts"), r.stderr
