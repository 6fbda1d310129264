"""Whether the prompt's last pass, made shorter, reads a needle that the plain chunking misses.

A retrieval policy's prefill picks one pool of cold pages per pass, shared by the pass's queries
(docs/retrieval.md "one pool per pass"); the answer's first token is read off the prompt's last
position, which the last pass computes. With 512-token chunks that pass holds the question
beside up to 511 tokens of document, whose queries may outvote it. This probe prefills the
prompt but its last `--tail` tokens in `--chunk`-token chunks once, keeps the cache
(`KVCache.checkpoint`), then for each variant restores it, feeds the tail as the variant says
and feeds the right answer token by token (teacher forcing, `needle_step_probe.answer`),
printing per answer token its probability, rank and the model's top token:

- `tail as one pass`: the last `--tail` tokens as one pass of their own;
- `tail one per pass`: each of them a pass of its own (each query its own pool, as a decode step);
- `tail-K as one pass, last K one per pass` for each K in `--singles`.

With the full cache every variant computes the same attention (chunking changes nothing but
rounding: tests/test_needle_last_pass.py). Not a product rule: the default chunking is unchanged.

    python -m benchmarks.needle_last_pass ~/.cache/posttrainllm/gemma-3-270m-q4_k_m.gguf \\
        --context 32768 --depth 0.3 --seed 0 --policy sink4/hot1024:absolute --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from benchmarks.needle_step_probe import answer
from tinygpt_mlx import loading
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.chat_template import encode_fragment
from tinygpt_mlx.cli.common import write_atomic
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.evaluate.needle import DEFAULT_FILLER, cell_document, needle_positions
from tinygpt_mlx.generate import prefill


def variants(tail: int, singles: Sequence[int]) -> list:
    """(label, [(tokens, chunk), ...]) per variant; each variant's parts cover exactly `tail` tokens."""
    out = [("tail as one pass", [(tail, tail)]), ("tail one per pass", [(tail, 1)])]
    for k in singles:
        if not 0 < k < tail:
            raise ValueError(f"each of --singles must be between 1 and --tail - 1 ({tail - 1}), not {k}")
        out.append((f"tail-{k} as one pass, last {k} one per pass", [(tail - k, tail - k), (k, 1)]))
    return out


def probe_last_pass(model: Any, ids: list, target: list, config: CacheConfig, chunk: int, tail: int,
                    singles: Sequence[int] = ()) -> dict:
    """{label: answer rows} per variant (module doc), one prefill of `ids[:-tail]` shared."""
    if not 0 < tail < len(ids):
        raise ValueError(f"--tail must be between 1 and the prompt's {len(ids) - 1} tokens, not {tail}")
    out = {}
    with make_cache(model, config) as cache:
        prefill(model, ids[:-tail], cache, chunk)
        held = cache.checkpoint()
        for label, parts in variants(tail, singles):
            cache.restore(held)
            start = len(ids) - tail
            for n, c in parts:
                logits = prefill(model, ids[start:start + n], cache, c)
                start += n
            out[label] = answer(model, cache, logits, target)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--depth", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="sink4/hot1024:absolute", help="a CacheConfig.from_spec string")
    ap.add_argument("--chunk", type=int, default=512, help="the prompt's chunk before the tail")
    ap.add_argument("--tail", type=int, default=64, help="the prompt's last tokens fed as each variant says")
    ap.add_argument("--singles", default="16,8", help="K values of the 'last K one per pass' variants")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:
        config = CacheConfig.from_spec(a.policy)
        singles = [int(k) for k in a.singles.split(",") if k.strip()]
        variants(a.tail, singles)
    except ValueError as e:
        ap.error(f"{e}")
    loaded = loading.load(a.model)
    tok = loaded.tokenizer
    prompt, answer_text = cell_document(tok, DEFAULT_FILLER.read_text(encoding="utf-8"), a.context, a.depth, a.seed)
    ids = list(tok.encode(prompt))
    truth = np.asarray(needle_positions(tok.encode, prompt, answer_text))
    target = encode_fragment(tok, " " + answer_text + ".")
    load_start, t0 = os.getloadavg(), time.time()
    print(f"cell: context {a.context}, depth {a.depth}, seed {a.seed}: {len(ids)} tokens, answer {answer_text!r}, "
          f"needle at positions {truth.min()}-{truth.max()}; the last {a.tail} tokens from {len(ids) - a.tail}",
          flush=True)
    runs = probe_last_pass(loaded.model, ids, target, config, a.chunk, a.tail, singles)
    results = {}
    for label, rows in runs.items():
        print(f"{label}: " + " | ".join(f"{tok.decode([t])!r} p={p:.2f} rank {r} top {tok.decode([top])!r}"
                                       for t, p, r, top, _, _ in rows), flush=True)
        results[label] = [dict(token=tok.decode([t]), p=p, rank=r, top=tok.decode([top])) for t, p, r, top, _, _ in rows]
    if a.json:
        write_atomic(Path(a.json), json.dumps(dict(
            command="python -m benchmarks.needle_last_pass " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
            LD_PRELOAD=os.environ.get("LD_PRELOAD", ""), load_average_at_start=list(load_start),
            load_average_at_end=list(os.getloadavg()), seconds=round(time.time() - t0, 1), context=a.context,
            depth=a.depth, seed=a.seed, policy=a.policy, chunk=a.chunk, tail=a.tail, prompt_tokens=len(ids),
            answer=answer_text, needle_positions=truth.tolist(), results=results), indent=1))


if __name__ == "__main__":
    main()
