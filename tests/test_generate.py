"""Generation pieces: incremental detokenization, stop strings, sampler."""

import mlx.core as mx
import pytest

from tinygpt_mlx.config import CacheConfig, SampleConfig
from tinygpt_mlx.generate import stream_generate
from tinygpt_mlx.sampling import make_sampler


def test_detokenizer_never_splits_a_character(native):
    tok = native.tokenizer
    text = "Café 東京 🙂🙂 naïve"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok = tok.detokenizer()
    pieces = [detok.add(t) for t in ids] + [detok.finalize()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_strings_are_never_emitted(native):
    cfg = SampleConfig(max_tokens=40, temperature=0)
    full = "".join(c.text for c in stream_generate(native, "The quick", CacheConfig(), cfg))
    assert len(full) > 6
    stop = full[3:6]
    chunks = list(stream_generate(native, "The quick", CacheConfig(),
                                  SampleConfig(max_tokens=40, temperature=0, stop=(stop,))))
    text = "".join(c.text for c in chunks)
    assert text == full[:full.index(stop)]
    assert chunks[-1].done and chunks[-1].stats.finish_reason == "stop"


def test_sampler_greedy_topk_topp():
    logits = mx.array([[0.0, 5.0, 4.9, -3.0]])
    assert make_sampler(0)(logits).item() == 1
    draws = {make_sampler(1.0, top_k=2, seed=s)(logits).item() for s in range(40)}
    assert draws == {1, 2}
    draws = {make_sampler(1.0, top_p=0.5, seed=s)(logits).item() for s in range(40)}
    assert draws == {1}
    a = [make_sampler(1.0, seed=3)(logits).item() for _ in range(5)]
    b = [make_sampler(1.0, seed=3)(logits).item() for _ in range(5)]
    assert a == b


def test_reply_is_the_text_front_end(native):
    """`Reply` (stream_generate's, the worker's and the chat session's front end): its texts join
    to the greedy tokens' text; a stop string ends it at the text before the string with
    finish_reason "stop"; a consumer's `stop()` is a stop; otherwise it runs to the length."""
    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.generate import Reply, greedy_tokens

    tok, model = native.tokenizer, native.model
    prompt = tok.encode("The quick brown fox")
    want = tok.decode(greedy_tokens(model, prompt, make_cache(model, CacheConfig()), 24, 8))

    def run(**kw):
        reply = Reply(model, tok, prompt, make_cache(model, CacheConfig()), 24, 8, **kw)
        texts, calls = [], 0
        for step, piece in reply:
            calls += 1
            texts.append(piece)
        return "".join(texts) + reply.finish(), reply, calls

    text, reply, calls = run(ignore_eos=True)
    assert text == want and reply.stats.finish_reason == "length" and reply.stats.generated_tokens == 24
    assert calls == 24 + (len(prompt) - 1) // 8   # every prefill chunk but the last is a step of its own
    cut = want[len(want) // 2:len(want) // 2 + 3]
    text, reply, _ = run(ignore_eos=True, stop=(cut,))
    assert text == want[:want.index(cut)] and reply.stats.finish_reason == "stop"
    reply = Reply(model, tok, prompt, make_cache(model, CacheConfig()), 24, 8, ignore_eos=True)
    for n, (step, piece) in enumerate(reply):
        if n == 3:
            reply.stop()
            break
    assert reply.stats.finish_reason == "stop"


@pytest.mark.slow
def test_pipelined_greedy_tokens_equal_the_stepwise_ones(native32, llama):
    """`steps(pipeline=True)` (greedy_tokens on a GPU: each token fed before the host reads it) gives the
    same tokens, the same final logits and the same cache as one model call after the other, for
    every kind of layer (full, KIVI, a StreamingLLM ring, KIVI under a window, retrieval) and for
    mlx-lm's model code; the last token is never fed."""
    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.generate import GenerationStats, generate_step, greedy_tokens, steps

    prompt = list(range(3, 60))
    every = ("fp32", "int4", "sink4/window16", "int8+sink4/window64", "sink4/hot16+fetch8")
    for loaded, specs in ((native32, every), (llama, ("fp32", "sink4/window16", "sink4/hot16+fetch8"))):  # head dim 16: no KIVI
        model = loaded.model
        for spec in specs:
            runs = []
            for pipeline in (False, True):
                cache, stats = make_cache(model, CacheConfig.from_spec(spec)), GenerationStats()
                out = list(generate_step(model, prompt, cache, make_sampler(0.0), 40, 16, stats, pipeline=pipeline))
                runs.append((out, cache.current_length, cache.stored_count, stats.logits))
            (a, len_a, kept_a, logits_a), (b, len_b, kept_b, logits_b) = runs
            assert a == b and len(a) == 40, spec
            assert len_a == len_b == len(prompt) + 39 and kept_a == kept_b, spec
            assert mx.array_equal(logits_a, logits_b).item(), spec
            if spec == "fp32":
                full = a
        assert greedy_tokens(model, prompt, make_cache(model, CacheConfig()), 5, 16) == full[:5]
    try:
        next(steps(native32.model, prompt, make_cache(native32.model, CacheConfig()), make_sampler(0.0), 4, 16,
                   eos_ids=frozenset({1}), pipeline=True))
        raise AssertionError("a pipeline that EOS could end must be refused")
    except ValueError as e:
        assert "cannot end early" in str(e)
