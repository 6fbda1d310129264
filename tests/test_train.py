"""Training: torch/MLX equivalence, a tiny run that learns and exports, resume, needle docs."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import numpy as np
import pytest

from tinygpt_mlx import corpus
from tinygpt_mlx.config import ModelConfig

WORDS = ("the cat sat on the mat and the dog ran to the old red barn where a farmer kept "
         "seven sheep while rain fell on the quiet hills of the north").split()


def _tiny_corpus(tmp_path):
    rng = random.Random(0)
    lines = []
    for _ in range(1200):
        n = rng.randint(6, 14)
        start = rng.randrange(len(WORDS) - n)
        lines.append(" ".join(WORDS[start:start + n]).capitalize() + ".")
    d = tmp_path / "corpus"
    d.mkdir(parents=True, exist_ok=True)
    (d / "a.txt").write_text("\n".join(lines[:1000]) + "\n")
    (tmp_path / "heldout.txt").write_text("\n".join(lines[1000:]) + "\n")
    return d, tmp_path / "heldout.txt"


def _args(tmp_path, **kw):
    from tinygpt_mlx.train import TrainArgs
    data, heldout = _tiny_corpus(tmp_path)
    base = dict(data=str(data), heldout=str(heldout), out=str(tmp_path / "m.tinygpt"),
                work_dir=str(tmp_path / "work"), steps=30, seq_len=64, batch_size=8, lr=1e-2,
                vocab_size=320, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                eval_every=10, eval_windows=4, ckpt_every=10, threads=1, precision="fp32",
                needle_fraction=0.2, log_every=10)
    base.update(kw)
    return TrainArgs(**base)


def _quiet_console():
    from rich.console import Console
    return Console(stderr=True, quiet=True)


@pytest.mark.parametrize("yoco", [False, True])
def test_torch_and_mlx_logits_match(yoco):
    torch = pytest.importorskip("torch")
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from tinygpt_mlx.model import Model
    from tinygpt_mlx.train.torch_model import build_model, load_from_mlx, to_mlx

    cfg = ModelConfig(vocab_size=101, d_model=64, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=96,
                      context_length=64, yoco=yoco)
    torch.manual_seed(0)
    tm = build_model(cfg)
    mm = to_mlx(tm)
    assert sorted(tm.state_dict()) == sorted(k for k, _ in tree_flatten(Model(cfg).parameters()))
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        a = tm(torch.from_numpy(x)).numpy()
    b = np.array(mm(mx.array(x)))
    assert np.abs(a - b).max() < 1e-4
    # and back: MLX weights into a fresh torch model give the same logits
    tm2 = build_model(cfg)
    load_from_mlx(tm2, mm)
    with torch.no_grad():
        c = tm2(torch.from_numpy(x)).numpy()
    assert np.abs(c - b).max() < 1e-4


def test_train_lowers_loss_and_writes_loadable_model(tmp_path):
    pytest.importorskip("torch")
    import mlx.core as mx

    from tinygpt_mlx.format import load
    from tinygpt_mlx.train import run

    args = _args(tmp_path)
    extra = run(args, console=_quiet_console())
    history = [json.loads(line) for line in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [10, 20, 30]
    assert history[-1]["heldout_loss"] < history[0]["heldout_loss"]
    assert extra["heldout_loss"] < extra["unigram_heldout_loss"]
    model, tok_json, meta = load(tmp_path / "m.tinygpt")
    assert model.config.context_length == 64 and model.config.n_layers == 2
    assert meta["steps"] == 30 and meta["tokens_trained"] == 30 * 8 * 64
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tok_json)
    ids = tok.encode("The cat sat on the mat. 12345").ids
    assert tok.decode(ids) == "The cat sat on the mat. 12345"
    assert [tok.id_to_token(i) for i in tok.encode("12345").ids] == list("12345")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), tok.get_vocab_size())


def test_resume_continues_from_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    from tinygpt_mlx.train import run

    run(_args(tmp_path / "a", steps=20), console=_quiet_console())
    first = _args(tmp_path / "b", steps=20, stop_after=10)
    assert run(first, console=_quiet_console())["stopped"]
    ckpt = torch.load(tmp_path / "b" / "work" / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 10
    extra = run(_args(tmp_path / "b", steps=20, resume=True), console=_quiet_console())
    assert extra["steps"] == 20
    a = torch.load(tmp_path / "a" / "work" / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "work" / "checkpoint.pt", weights_only=False)["model"]
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def test_resume_without_checkpoint_fails(tmp_path):
    pytest.importorskip("torch")
    from tinygpt_mlx.train import run

    with pytest.raises(FileNotFoundError):
        run(_args(tmp_path, resume=True), console=_quiet_console())


def test_init_from_warm_starts_and_yoco_drops_shared_kv(tmp_path):
    """--init-from copies the weights (fresh optimizer): the warm-started model equals the
    checkpoint; a YOCO model takes a standard checkpoint minus the K/V projections of its
    shared layers; a checkpoint of another shape is an error."""
    torch = pytest.importorskip("torch")
    from tinygpt_mlx.train import run
    from tinygpt_mlx.train.loop import init_weights
    from tinygpt_mlx.train.torch_model import build_model

    run(_args(tmp_path / "a", steps=10, n_layers=4), console=_quiet_console())
    ckpt = tmp_path / "a" / "work" / "checkpoint.pt"
    saved = torch.load(ckpt, weights_only=False)
    cfg = ModelConfig(**saved["config"])
    extra = run(_args(tmp_path / "c", steps=4, n_layers=4, init_from=str(ckpt), copy_fraction=0.3),
                console=_quiet_console())   # end to end with the copy task mixed in
    assert extra["segments"][-1]["init_from"] == str(ckpt)
    m = build_model(cfg)
    init_weights(m, str(ckpt), torch)
    for k, v in m.state_dict().items():
        assert torch.equal(v, saved["model"][k]), k
    y = build_model(ModelConfig(**{**saved["config"], "yoco": True}))
    init_weights(y, str(ckpt), torch)
    assert len(y.state_dict()) < len(saved["model"])
    with pytest.raises(ValueError, match="does not fit"):
        init_weights(build_model(ModelConfig(**{**saved["config"], "n_layers": 3})), str(ckpt), torch)


def test_copy_rows_repeat_a_span_and_weigh_its_first_copy_zero():
    from tinygpt_mlx.train.data import TrainData

    tokens = np.arange(5000, dtype=np.uint16) % 300
    td = TrainData(tokens, "", lambda s: [], eot_id=0)
    for span in (0, 16):
        rows, w = td.batch(seed=1, step=3, batch_size=32, seq_len=64, needle_fraction=0.0,
                           copy_fraction=1.0, vocab_size=300, copy_span=span)
        assert rows.shape == (32, 65)
        lengths = []
        for row, wr in zip(rows, w):
            n = int((wr == 0).sum()) + 1            # first copy: targets 0..n-2 weigh 0
            assert (row[n:] == row[:65 - n]).all()  # every later token repeats the span
            lengths.append(n)
        assert 8 <= min(lengths) and max(lengths) <= (span or 32)
    # copy_fraction 0 leaves the old batches unchanged
    a, _ = td.batch(seed=1, step=3, batch_size=8, seq_len=64, needle_fraction=0.0)
    b, _ = td.batch(seed=1, step=3, batch_size=8, seq_len=64, needle_fraction=0.0, copy_fraction=0.0)
    assert (a == b).all()


def test_lr_schedule():
    from tinygpt_mlx.train import lr_at

    assert lr_at(0, 100, 10, 1.0, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 100, 10, 1.0, 0.1) == pytest.approx(1.0)
    assert lr_at(100, 100, 10, 1.0, 0.1) == pytest.approx(0.1)
    assert lr_at(55, 100, 10, 1.0, 0.1) == pytest.approx(0.55)


FILLER = " ".join(f"Line {i} of the filler says nothing of note." for i in range(400))


@pytest.mark.parametrize("template", range(len(corpus.TEMPLATES)))
def test_needle_doc_templates(template):
    rng = random.Random(template)
    prompt, answer = corpus.make_needle_doc(rng, FILLER, 800, depth=0.5, template=template)
    assert answer.isdigit() and answer in prompt
    assert prompt.rstrip() == prompt and prompt.split("\n\n")[-1].startswith(("What", "In which"))
    assert abs(len(prompt) - 800) < 80
    fact_pos = prompt.index(answer) / len(prompt)
    assert 0.3 < fact_pos < 0.7


def test_needle_doc_depth_and_distractors():
    rng = random.Random(0)
    p0, a0 = corpus.make_needle_doc(rng, FILLER, 1000, depth=0.0, template=corpus.PASSKEY_TEMPLATE)
    assert p0.startswith("The pass key is " + a0)
    p1, a1 = corpus.make_needle_doc(rng, FILLER, 1000, depth=1.0, template=corpus.PASSKEY_TEMPLATE,
                                    value="4242")
    assert a1 == "4242" and p1.endswith("Remember it.\n\nWhat is the pass key? The pass key is")
    p2, a2 = corpus.make_needle_doc(rng, FILLER, 1000, template=3, distractors=2)
    assert p2.count("The secret number of") == 3 + 1  # three facts + the question
    with pytest.raises(ValueError):
        corpus.make_needle_doc(rng, FILLER, 100, depth=1.5)


def test_needle_doc_tokens_fits_budget():
    rng = random.Random(1)
    encode = lambda s: s.split()  # noqa: E731
    for n in (50, 200, 400):
        prompt, _ = corpus.make_needle_doc_tokens(rng, FILLER, encode, n)
        assert 0.9 * n <= len(encode(prompt)) <= n


def test_clean_text():
    assert corpus.clean_text("a\r\nb  \n\n\n\nc\x07\td") == "a\nb\n\nc d\n"


def test_passkey_accuracy_runs_on_mlx_model(monkeypatch):
    from tinygpt_mlx.evaluate.passkey import passkey_accuracy
    from tinygpt_mlx.model import Model
    from tinygpt_mlx.train.tokenizer import train_tokenizer

    tok = train_tokenizer([FILLER, "The pass key is 12345. Remember it."], vocab_size=300)

    class Tok:
        encode = staticmethod(lambda s: tok.encode(s, add_special_tokens=False).ids)
        decode = staticmethod(lambda ids: tok.decode(list(ids)))

    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, d_ff=64, context_length=128)
    res = passkey_accuracy(Model(cfg), Tok, FILLER, 128, trials=3, seed=0)
    from tinygpt_mlx.evaluate.needle import passed
    assert res["trials"] == 3 and [r[0] for r in res["results"]] == [0.0, 0.5, 1.0]
    assert all(len(r[1]) == 5 for r in res["results"])
    assert res["accuracy"] == sum(passed(out, ans) for _, ans, out in res["results"]) / 3

    # oracles in place of greedy decoding, reading the needle back out of the prompt: the score
    # is 1 for the right digits and 0 for a wrong last digit, whatever the tiny model above did
    import re

    from tinygpt_mlx.evaluate import passkey
    assert None not in [tok.token_to_id(c) for c in "0123456789."]   # one token per digit

    def oracle(wrong_last: bool):
        def greedy(model, ids, cache, n, chunk):
            answer = re.search(r"The pass key is (\d+)\.", Tok.decode(ids)).group(1)
            if wrong_last:
                answer = answer[:-1] + str((int(answer[-1]) + 1) % 10)
            return [tok.token_to_id(d) for d in answer + "."][:n]
        return greedy
    for wrong, expected in ((False, 1.0), (True, 0.0)):
        monkeypatch.setattr(passkey, "greedy_tokens", oracle(wrong))
        res = passkey_accuracy(Model(cfg), Tok, FILLER, 128, trials=3, seed=0)
        assert res["accuracy"] == expected, res["results"]


def test_shipped_model_loads_and_matches_docs():
    from pathlib import Path

    from tinygpt_mlx.format import load

    root = Path(__file__).resolve().parent.parent
    path = root / "models" / "tinygpt-base.tinygpt"
    if not path.exists():
        pytest.skip("no shipped model in this checkout")
    model, tok_json, extra = load(path)
    cfg = model.config
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff) == (4, 256, 8, 4, 768)
    assert (cfg.vocab_size, cfg.context_length, cfg.yoco) == (4096, 512, False)
    assert path.stat().st_size <= 40e6
    docs = (root / "docs" / "model.md").read_text()
    n = model.num_parameters()
    assert f"{n:,}" in docs and f"{extra['tokens_trained']:,}" in docs
    assert "| layers | 4 decoder blocks" in docs and "d_model 256" in docs and "d_ff 768" in docs


def test_default_training_step_runs_under_bf16_autocast(tmp_path, monkeypatch):
    """TrainArgs' default precision is bf16 autocast: the training forward's matmuls run in
    bfloat16 (logits come out bf16) while the weights stay fp32; against an fp32 step from the
    same seed and batch the logits differ by bf16 rounding, not more."""
    torch = pytest.importorskip("torch")
    from tinygpt_mlx.train import TrainArgs, loop, run
    from tinygpt_mlx.train.torch_model import build_model

    assert TrainArgs(data="x", out="y").precision == "bf16"
    seen: dict = {}

    def recording_build_model(cfg):
        model = build_model(cfg)

        def hook(module, inputs, output):
            if module.training:                       # the training step, not evaluation
                seen.setdefault(run_name, []).append(output.detach())
        model.register_forward_hook(hook)
        return model
    monkeypatch.setattr(loop, "build_model", recording_build_model)

    params = {}
    for run_name, kw in (("default", {}), ("fp32", {"precision": "fp32"})):
        args = _args(tmp_path / run_name, steps=1, eval_every=1, ckpt_every=1, **kw)
        if not kw:
            args = dataclasses.replace(args, precision=TrainArgs.precision)   # the default
        extra = run(args, console=_quiet_console())
        params[run_name] = torch.load(tmp_path / run_name / "work" / "checkpoint.pt", weights_only=False)["model"]
        assert extra["precision"] == args.precision
    (bf16_logits,), (fp32_logits,) = seen["default"], seen["fp32"]
    assert bf16_logits.dtype == torch.bfloat16 and fp32_logits.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in params["default"].values())      # fp32 weights
    err = (bf16_logits.float() - fp32_logits).abs().max().item()
    scale = fp32_logits.abs().max().item()
    print(f"measured bf16 vs fp32 logits: max err {err:.3g} of max |logit| {scale:.3g}")
    assert 0 < err < 0.006             # measured 0.00296 (max |logit| 0.81): bf16 rounding
    # and so the step itself: the weights after it differ from the fp32 step's
    assert any(not torch.equal(params["default"][k], params["fp32"][k]) for k in params["fp32"])


# ------------------------------------------------------------------ KIV's limits as documents
# Mutations checked (one at a time, reverted): ask_all answering in document order instead of the
# question's; the phone book letting the asked name repeat; the chat fact placed at a fixed turn;
# values_right counting a value anywhere instead of position by position.

def _fact_depth(prompt: str, fact: str) -> float:
    return prompt.index(fact) / len(prompt)


def test_keyed_doc_asks_one_of_several_facts():
    for seed in range(20):
        rng = random.Random(seed)
        prompt, answer = corpus.make_keyed_doc(rng, FILLER, 1200, depth=0.5, template=3, facts=4)
        facts = re.findall(r"The secret number of (\w+) is (\d+)\.", prompt)
        assert len(facts) == 4 and len({n for n, _ in facts}) == 4   # four people, one fact each
        asked = re.search(r"What is the secret number of (\w+)\? The secret number of \1 is$", prompt).group(1)
        assert dict(facts)[asked] == answer and len({len(v) for _, v in facts}) == 1
        assert 0.3 < _fact_depth(prompt, f"of {asked} is {answer}.") < 0.7


def test_keyed_doc_ask_all_answers_in_the_questions_order():
    for template, pattern in ((3, r"The secret number of (\w+) is (\d+)\."),
                              (4, r"(\w+)'s lucky number is (\d+)\."), (7, r"(\w+) lives in room number (\d+)\.")):
        rng = random.Random(template)
        prompt, answer = corpus.make_keyed_doc(rng, FILLER, 1500, template=template, facts=3, ask_all=True)
        body, question = prompt.rsplit("\n\n", 1)
        facts = dict(re.findall(pattern, body))
        asked = re.findall(r"\b(" + "|".join(corpus.NAMES) + r")\b", question.split("?")[0])
        assert sorted(asked) == sorted(facts) and len(asked) == 3
        said = [(asked[0], re.match(r"(\d+)\.", answer).group(1))] + re.findall(pattern, answer)
        assert said == [(n, facts[n]) for n in asked]                  # every value, in the asked order
        assert question.endswith(corpus.TEMPLATES[template][0].format(name=asked[0], v="").rstrip(" ."))
    with pytest.raises(ValueError, match="no key"):
        corpus.make_keyed_doc(random.Random(0), FILLER, 500, template=0)


def test_phonebook_is_all_entries_and_the_asked_one_is_unique():
    rng = random.Random(0)
    prompt, answer = corpus.make_phonebook_doc(rng, 20000, depth=0.25)   # long: other names repeat
    book, question = prompt.rsplit("\n\n", 1)
    lines = book.split("\n")
    assert all(re.fullmatch(r"[A-Z][a-z]+ [A-Z][a-z]+: \d{5}", ln) for ln in lines)
    target = re.match(r"What is the number of (\w+ \w+)\?", question).group(1)
    hits = [i for i, ln in enumerate(lines) if ln.startswith(target + ":")]
    assert len(hits) == 1 and lines[hits[0]] == f"{target}: {answer}"
    assert abs(hits[0] / len(lines) - 0.25) < 0.01
    assert len({ln.split(":")[0] for ln in lines}) < len(lines)       # look-alikes repeat at this size
    assert question.endswith(f"The number of {target} is")


def test_chat_doc_asks_for_an_earlier_user_turn():
    from tinygpt_mlx.chat_template import plain_text
    filler = "\n".join(f"Line {i} of the filler says nothing of note." for i in range(300))
    seen = set()
    for seed in range(12):
        rng = random.Random(seed)
        prompt, answer = corpus.make_chat_doc(rng, filler, 1500, template=corpus.PASSKEY_TEMPLATE)
        lines = prompt.split("\n")
        assert lines[-1] == "Assistant:" and lines[-2] == "User: What is the pass key?"
        assert all(ln.startswith(("User: ", "Assistant: ", "Assistant:")) for ln in lines)
        roles = [ln.split(":")[0] for ln in lines[:-1]]
        assert roles == ["User", "Assistant"] * (len(roles) // 2) + ["User"]
        fact = next(i for i, ln in enumerate(lines) if "pass key is" in ln and "?" not in ln)
        assert lines[fact].startswith("User: The pass key is ") and answer == "The pass key is " + \
            re.search(r"(\d+)", lines[fact]).group(1)
        seen.add(fact)
        msgs = [{"role": ln.split(":")[0].lower(), "content": ln.split(": ", 1)[1]} for ln in lines[:-1]]
        assert plain_text(msgs) == prompt
    assert len(seen) > 3                                               # the depth varies


def test_values_right_counts_position_by_position():
    want = "4821. The secret number of Bob is 7731. The secret number of Zoe is 512."
    assert corpus.values_right(" " + want, want) == 3
    assert corpus.values_right(" 4821. The secret number of Bob is 7731. Zoe is 5120.", want) == 2
    assert corpus.values_right(" 7731. Bob 4821. Zoe 512.", want) == 1        # swapped: only the last
    assert corpus.values_right(" nothing", want) == 0


def test_keyed_and_chat_rows_weigh_their_answers():
    from tinygpt_mlx.train.data import TrainData

    words = FILLER.split()
    vocab = {w: i + 1 for i, w in enumerate(sorted(set(words + list("0123456789"))))}
    encode = lambda s: [vocab.setdefault(w, len(vocab) + 1) for w in re.findall(r"\d|[^\s\d]+", s)]  # noqa: E731
    td = TrainData(np.asarray(encode(FILLER) * 3, dtype=np.uint16), FILLER, encode, eot_id=0)
    rows, w = td.batch(0, 1, 32, 256, 0.0, 5.0, keyed_fraction=0.5, chat_fraction=0.5)
    inv = {i: t for t, i in vocab.items()}
    answered = 0
    for row, weights in zip(rows, w):
        idx = np.nonzero(weights == 5.0)[0]
        if len(idx):
            answered += 1
            assert np.all(np.diff(idx) == 1)                           # one contiguous answer
            assert any(inv[t].isdigit() for t in row[idx + 1])         # it holds the value's digits
    assert answered >= 28


def test_fine_tune_from_a_model_file_adopts_its_shape_and_tokenizer(tmp_path):
    """--init-from a .tinygpt: the torch model starts as the file's weights (logits equal), the
    work dir gets its tokenizer, another tokenizer there is an error; keyed/chat rows train."""
    torch = pytest.importorskip("torch")
    import mlx.core as mx

    from tinygpt_mlx.format import load_file
    from tinygpt_mlx.train import run
    from tinygpt_mlx.train.loop import adopt_model_file, init_weights
    from tinygpt_mlx.train.torch_model import build_model

    run(_args(tmp_path / "a", steps=6, d_model=48), console=_quiet_console())
    src = tmp_path / "a" / "m.tinygpt"
    f = load_file(src)
    args = adopt_model_file(_args(tmp_path / "b", init_from=str(src)), tmp_path / "b" / "work")
    assert args.d_model == 48 and (tmp_path / "b" / "work" / "tokenizer.json").read_text() == f.tokenizer_json
    m = build_model(args.model_config())
    init_weights(m, str(src), torch)
    ids = [[1, 5, 9, 30, 2, 7]]
    want = np.array(f.model(mx.array(ids)))
    got = m(torch.tensor(ids)).detach().numpy()
    assert np.abs(got - want).max() < 1e-4
    extra = run(_args(tmp_path / "b", steps=3, init_from=str(src), keyed_fraction=0.3, chat_fraction=0.3,
                      out=str(tmp_path / "b" / "ft.tinygpt")), console=_quiet_console())
    assert extra["segments"][-1]["keyed_fraction"] == 0.3 and load_file(tmp_path / "b" / "ft.tinygpt").tokenizer_json == f.tokenizer_json
    (tmp_path / "c" / "work").mkdir(parents=True)
    (tmp_path / "c" / "work" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="another tokenizer"):
        run(_args(tmp_path / "c", init_from=str(src)), console=_quiet_console())
    with pytest.raises(ValueError, match="sum to at most 1"):
        run(_args(tmp_path / "d", keyed_fraction=0.6, chat_fraction=0.5), console=_quiet_console())


@pytest.mark.parametrize("flags, named", [(["--steps", "0"], "'--steps'"), (["--tokens", "0"], "'--tokens'"),
                                          (["--steps", "-5"], "'--steps'"),
                                          (["--steps", "1", "--eval-every", "0"], "'--eval-every'"),
                                          (["--steps", "1", "--ckpt-every", "0"], "'--ckpt-every'"),
                                          (["--steps", "1", "--batch-size", "0"], "'--batch-size'")])
def test_train_refuses_a_count_below_one_before_any_work(tmp_path, monkeypatch, flags, named):
    """A step count, interval or size below 1 is a usage error naming the flag, before the corpus or
    torch is touched (before: --steps 0 said 'give --steps or --tokens', --steps -5 went on into
    training, and --eval-every 0 ended in a ZeroDivisionError traceback after the first step)."""
    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app

    def started(*a, **k):
        raise AssertionError("training started")

    monkeypatch.setattr("tinygpt_mlx.train.run", started)
    r = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "x.tinygpt"), "--data", str(tmp_path), *flags])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Invalid value for") and named in lines[0], r.stderr
