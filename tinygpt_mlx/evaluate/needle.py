"""Needle-in-a-haystack grid: pass/fail of greedy answers per policy x context x depth x seed.

Documents come from `tinygpt_mlx.corpus.make_needle_doc_tokens` (the same needles the model is
trained on, held-out filler, new random values): "... The pass key is 48213. Remember it. ...
What is the pass key? The pass key is" -> a cell passes when the greedy continuation starts
with the answer (and not with a longer number). The prompt is prefilled in chunks through the
cache policy (so a retrieval policy's hot budget caps the prefill too), then the answer is
decoded greedily. The same document is used for every policy of a (context, depth, seed).

The filler defaults to the King James Bible's held-out tail shipped with the package
(`DEFAULT_FILLER`); the full held-out split `data/heldout.txt` comes from scripts/fetch_corpus.sh.

Policies: "full" (exact full cache; only where the context fits the model), "streaming"
(StreamingLLM with the retrieval policy's sink and hot budget as its window: the same hot
memory without a cold store) and "retrieval" (the given retrieval policy). For retrieval
cells the ground-truth needle positions are given to the cold stores, and the telemetry of
the last prefill chunk and the decode steps (page / token recall of the needle) is kept.

Every cell also says where its greedy answer first leaves the answer's own tokens
(`first_miss`: the step, the wanted token's probability and rank, the token taken), read from
the logits the greedy decode computes anyway: with the recall it separates a miss of reach (the
needle not fetched: low recall) from one of reading (fetched, yet a digit misread, e.g. '0' at
p 0.08 ranked 4th). `--probe` asks the other half directly: a failed retrieval cell runs again
with the needle's pages pinned into every pass's pool (an oracle coarse pass); if that answers,
the page ranking lost the needle, if not, it is out of the ranking's hands.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

from ..cache import make_cache
from ..config import CacheConfig
from ..corpus import fit_tokens, make_task_doc, random_value, values_right
from ..chat_template import encode_fragment
from ..generate import GenerationStats, greedy_steps, rss_bytes
from .inputs import HELDOUT_KJV

POLICIES = ("full", "streaming", "retrieval")
#: The haystack when none is given: the KJV held-out tail shipped with the package
#: (`inputs.HELDOUT_KJV`). The numbers in docs/ used `data/heldout.txt` (scripts/fetch_corpus.sh).
DEFAULT_FILLER = HELDOUT_KJV


def policy_specs(retrieval: CacheConfig) -> dict[str, str]:
    """The policy spec (`CacheConfig.from_spec`) of "full" and "streaming" around one retrieval
    config: its storage, and its sink with the hot budget as the window."""
    return {"full": retrieval.storage,
            "streaming": f"{retrieval.storage}+sink{retrieval.sink}/window{retrieval.hot_budget}"}


#: the fields of a retrieval config's storage that "full" and "streaming" share with it: its
#: precision and its KIVI settings (`--kv-quantize int4` quantises all three policies' caches)
STORAGE_FIELDS = ("storage", "key_bits", "value_bits", "group_size", "value_group", "residual",
                  "long_residual", "exact_topk", "kivi_sink", "rotate", "near", "near_bits", "near_share")


def policy_configs(retrieval: CacheConfig, names: list[str]) -> dict[str, CacheConfig]:
    """The cache configs of the grid's policies, built around one retrieval config: "full" and
    "streaming" take its storage and its KIVI settings (`STORAGE_FIELDS`), so under
    `--kv-quantize int4` the full cache is int4 too (before 2026-12-06 it stayed exact)."""
    if not retrieval.retrieval:
        raise ValueError("the needle grid needs a retrieval policy: give --kiv-hot-budget")
    specs = policy_specs(retrieval)
    storage = {name: getattr(retrieval, name) for name in STORAGE_FIELDS}
    out = {}
    for name in names:
        if name == "retrieval":
            out[name] = retrieval
        elif name in specs:
            out[name] = dataclasses.replace(CacheConfig.from_spec(specs[name]), **storage)
        else:
            raise ValueError(f"unknown needle policy {name!r}; choose from {', '.join(POLICIES)}")
    return out


def needle_positions(encode: Callable, prompt: str, answer: str) -> list[int]:
    """Token positions of the needle's value in the prompt (its first occurrence), +-1 token;
    an answer that states several numbers (`--task keyed-all`) marks each of them."""
    values = [answer] if answer in prompt else re.findall(r"\d+", answer)
    out: list[int] = []
    for value in values:
        char = prompt.find(value)
        if char < 0:
            continue
        first = len(encode(prompt[:char]))
        last = len(encode(prompt[:char + len(value)]))
        out += [i for i in range(max(0, first - 1), last + 1) if i not in out]
    return out


def passed(text: str, answer: str) -> bool:
    t = text.strip()
    return t.startswith(answer) and not t[len(answer):len(answer) + 1].isdigit()


def run_cell(model: Any, tokenizer: Any, config: CacheConfig, ids: list[int], answer: str,
             truth: list[int], chunk: int, on_chunk: Optional[Callable[[int, int, Any], None]] = None,
             oracle: bool = False, context: Optional[int] = None, tail: int = 0) -> dict:
    """Prefill `ids` through a fresh cache (in `chunk`s, the last `tail` tokens apart:
    `generate.pass_end`), decode the answer greedily; pass/fail + numbers.
    `on_chunk(done, total, cache)` follows the prefill (long documents' progress). `oracle`:
    every retrieval pass is offered the needle's pages whatever its coarse pass ranks them
    (`KVCache.pin`; the fine pass still picks from the pool by score). `context`: the model's
    trained context, where positions are the run's choice (`CacheConfig.for_run`: the cell's
    prompt and answer inside it take original positions)."""
    want = encode_fragment(tokenizer, " " + answer)
    n_new = len(want) + 1
    config = config.for_run(context, len(ids) + n_new)
    stats = GenerationStats()
    with make_cache(model, config) as cache:
        if config.retrieval:
            cache.record_retrievals()     # (the cell's telemetry: recall of the needle's pages and tokens)
            cache.set_truth(truth)
            if oracle:
                cache.pin(truth)

        peak = {"anon": 0, "file": 0}

        def keep_last_chunk(done: int, total: int) -> None:
            if done < total <= done + chunk:   # the next chunk is the question's: keep it and the decode
                cache.reset_telemetry()
            if done % (64 * chunk) == 0 or done == total:   # sampled: /proc costs a read
                peak.update({k: max(peak[k], v) for k, v in rss_bytes().items()})
            if on_chunk is not None:
                on_chunk(done, total, cache)
        out, miss = greedy_answer(model, ids, cache, want, n_new, chunk, keep_last_chunk, stats, tail)
        text = tokenizer.decode(out)
        cell = {"passed": passed(text, answer), "answer": answer, "output": text,
                "values": len(re.findall(r"\d+", answer)), "values_right": values_right(text, answer),
                "first_miss": miss and {**miss, "want": tokenizer.decode([miss["want"]]),
                                        "got": tokenizer.decode([miss["got"]])},
                "prompt_tokens": len(ids), "prefill_s": round(stats.prefill_seconds, 4),
                "decode_ms_per_token": round(1000 * stats.decode_seconds / max(1, n_new - 1), 3),
                "cache_bytes": cache.nbytes_breakdown(),
                "rss_anon_peak_bytes": peak["anon"], "rss_file_peak_bytes": peak["file"]}
        if config.streaming or config.retrieval:
            cell["rope_mode"] = config.rope_mode
        if config.retrieval:
            cell["telemetry"] = cache.retrieval_report()
    return cell


def probe_record(oracle_cell: dict) -> dict:
    """What a failed retrieval cell gave with the needle's pages pinned (`run_cell(oracle=True)`):
    its answer, recall and first miss, and the verdict: "ranking" where it passes (the needle was
    there to read once offered: the coarse pass lost it), "reading" where it still fails (offered
    the pages, the fine pass or the model misses it: a better page ranking would not help).
    `oracle_token_recall` is the share of the needle's tokens fetched (the telemetry's
    `token_recall`), `oracle_token_any` the share of layer-head steps fetching any of them; JSONs
    written before 2026-12-06 (session 44) hold `token_any` under `oracle_token_recall`."""
    tel = oracle_cell.get("telemetry", {})
    return {"verdict": "ranking" if oracle_cell["passed"] else "reading", "oracle_passed": oracle_cell["passed"],
            "oracle_output": oracle_cell["output"], "oracle_first_miss": oracle_cell["first_miss"],
            "oracle_token_recall": tel.get("token_recall"), "oracle_token_any": tel.get("token_any"),
            "oracle_page_recall": tel.get("page_recall")}


def greedy_answer(model: Any, ids: list[int], cache: Any, want: list[int], n_new: int, chunk: int,
                  progress: Optional[Callable[[int, int], None]] = None,
                  stats: Optional[GenerationStats] = None, tail: int = 0) -> tuple[list[int], Optional[dict]]:
    """`n_new` greedy ids after `ids` (as `generate.greedy_tokens`), and the first step at which
    they leave the answer's tokens `want`: {"step", "want", "p" (its probability there), "rank"
    (tokens more probable), "got"}, ids; None where they never do."""
    out: list[int] = []
    miss = None
    for step in greedy_steps(model, ids, cache, n_new, chunk, progress, stats, tail):
        if step.token is None:
            continue
        i = len(out)
        out.append(step.token)
        if miss is None and i < len(want) and step.token != want[i]:
            p = mx.softmax(step.logits.astype(mx.float32))
            miss = {"step": i, "want": want[i], "p": round(float(p[want[i]]), 4),
                    "rank": int((p > p[want[i]]).sum()), "got": step.token}
    return out, miss


def cell_document(tok: Any, filler_text: str, context: int, depth: float, seed: int, task: str = "passkey",
                  digits: int = 5, facts: int = 4, template: Optional[int] = None) -> tuple[str, str]:
    """The (prompt, answer) of one grid cell: a `task` document of about `context` tokens with
    the fact at `depth`, drawn from a generator seeded by (seed, context, depth), so any cell can
    be rebuilt alone (benchmarks/needle_step_probe.py)."""
    rng = random.Random(f"needle-{seed}-{context}-{depth}")
    value = random_value(rng, digits)
    return fit_tokens(lambda n: make_task_doc(rng, filler_text, n, task, depth, value=value, facts=facts,
                                              template=template), rng, tok.encode, context)


def split_question(prompt: str) -> tuple[str, str]:
    """A cell's prompt as (document and question, the answer's lead-in): "... What is the pass
    key?" and "The pass key is"."""
    q = prompt.rfind("?")
    return (prompt[:q + 1], prompt[q + 1:].strip()) if q >= 0 else (prompt, "")


def as_chat(tok: Any, prompt: str, lead_in: Optional[str] = None) -> str:
    """A cell's document as an instruct model is asked: the document and its question as one user
    message in the model's chat template, the answer's lead-in ("The pass key is", or `lead_in`)
    starting the assistant's turn, so the same `passed` check reads the reply."""
    user, lead = split_question(prompt)
    return tok.chat_prompt([{"role": "user", "content": user}]) + (lead if lead_in is None else lead_in)


def with_lead_in(prompt: str, lead_in: Optional[str]) -> str:
    """The raw prompt with its answer's lead-in replaced by `lead_in` (None: kept)."""
    if lead_in is None:
        return prompt
    user, _ = split_question(prompt)
    return f"{user} {lead_in}"


def needle_grid(loaded: Any, retrieval: CacheConfig, contexts: list[int], depths: list[float],
                seeds: int, policies: list[str], filler_text: str, chunk: int = 128,
                digits: int = 5, template: Optional[int] = None, task: str = "passkey", facts: int = 4,
                progress: Optional[Callable[[dict], None]] = None,
                on_chunk: Optional[Callable[[int, int, Any], None]] = None,
                partial: Optional[Callable[[dict], None]] = None, chat: bool = False,
                lead_in: Optional[str] = None, first_seed: int = 0, probe: bool = False, tail: int = 0,
                past_context: bool = False, done: Optional[list[dict]] = None) -> dict:
    """Run the grid of documents of one `corpus.TASKS` kind (`facts` facts for the keyed ones);
    returns {"policies", "cells", "summary", ...} (JSON-ready). `progress(cell)`
    after each cell, `on_chunk(done, total, cache)` during each prefill, `partial(result so far)`
    after each cell (to save a long grid as it goes). `chat`: each document is asked through the
    model's chat template (`as_chat`), as an instruct model is used. `lead_in` replaces the
    answer's lead-in that ends the prompt ("The pass key is"): a small model may need another
    ("The pass key is number") before even the full cache answers. The documents are seeds
    `first_seed` .. `first_seed + seeds - 1`, so a grid can be extended by more seeds. `probe`:
    every retrieval cell that fails runs again with the needle's pages pinned into each pass's
    pool (`run_cell(oracle=True)`), and the cell keeps what that gave (`probe_record`). `tail`: each
    prompt's last `tail` tokens are prefilled as a pass of their own (`generate.pass_end`; 0 = off).
    `past_context`: the full cache runs every cell, those longer than the model's context too
    (otherwise it skips them: where it does not fit). `done`: cells of an earlier run of this grid
    (`resume_check` has checked that it is this grid), kept as they are and not run again."""
    configs = policy_configs(retrieval, policies)
    tok = loaded.tokenizer
    ctx_len = loaded.context_length
    kept = {cell_key(c): c for c in done or []}
    run = run_record(digits, chat, lead_in, filler_text, probe)
    cells = []
    for context in contexts:
        for depth in depths:
            for seed in range(first_seed, first_seed + seeds):
                if all((name, context, depth, seed) in kept for name in configs):
                    cells += [kept.pop((name, context, depth, seed)) for name in configs]
                    continue     # (a full cell skipped past the context is never kept: the document is built)
                prompt, answer = cell_document(tok, filler_text, context, depth, seed, task, digits, facts, template)
                prompt = as_chat(tok, prompt, lead_in) if chat else with_lead_in(prompt, lead_in)
                ids = list(tok.encode(prompt))
                truth = needle_positions(tok.encode, prompt, answer)
                for name, cfg in configs.items():
                    if (name, context, depth, seed) in kept:
                        cells.append(kept.pop((name, context, depth, seed)))
                        continue
                    if name == "full" and not past_context and ctx_len and len(ids) > ctx_len:
                        continue   # the full cache does not fit the model's context
                    r = run_cell(loaded.model, tok, cfg, ids, answer, truth, chunk, on_chunk, context=ctx_len,
                                 tail=tail)
                    if probe and cfg.retrieval and not r["passed"]:
                        r["probe"] = probe_record(run_cell(loaded.model, tok, cfg, ids, answer, truth, chunk,
                                                           on_chunk, oracle=True, context=ctx_len, tail=tail))
                    cell = {"policy": name, "context": context, "depth": depth, "seed": seed,
                            "passed": bool(r.pop("passed")), **r}
                    cells.append(cell)
                    if progress is not None:
                        progress(cell)
                    if partial is not None:   # (with the kept cells not reached yet: a stop loses none)
                        partial(_result(loaded, configs, cells + list(kept.values()), contexts, depths, seeds, chunk,
                                        task, facts, first_seed, tail, past_context, run))
    return _result(loaded, configs, cells + list(kept.values()), contexts, depths, seeds, chunk, task, facts,
                   first_seed, tail, past_context, run)


def filler_id(text: str) -> str:
    """A short fingerprint of a grid's filler text (recorded in its JSON, checked on resume)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def run_record(digits: int, chat: bool, lead_in: Optional[str], filler_text: str, probe: bool) -> dict:
    """The settings a grid's JSON records beside `_result`'s own, for `resume_check`."""
    return dict(digits=digits, chat=chat, lead_in=lead_in, filler=filler_id(filler_text), probe=probe)


def cell_key(cell: dict) -> tuple:
    return cell["policy"], int(cell["context"]), float(cell["depth"]), int(cell["seed"])


#: what a grid's JSON records of how its cells were run: field -> the value a JSON written before
#: the field was recorded had (the option did not exist yet), or UNKNOWN (it may have been anything)
UNKNOWN = object()
RUN_FIELDS = {"model": UNKNOWN, "context_length": UNKNOWN, "task": "passkey", "facts": UNKNOWN,
              "prefill_chunk": UNKNOWN, "prefill_tail": 0, "past_context": False, "digits": UNKNOWN,
              "chat": UNKNOWN, "lead_in": UNKNOWN, "filler": UNKNOWN, "probe": UNKNOWN}
#: how `needle` spells each run setting (a --resume mismatch names what to type)
RUN_FLAGS = {"model": "MODEL", "context_length": "a model of context", "task": "--task", "facts": "--facts",
             "prefill_chunk": "--prefill-chunk", "prefill_tail": "--prefill-tail", "past_context": "--past-context",
             "digits": "--digits", "chat": "--chat", "lead_in": "--lead-in", "filler": "--filler",
             "probe": "--probe"}
#: what `_result` reads of every cell
CELL_FIELDS = ("policy", "context", "depth", "seed", "passed", "values", "values_right")


def unrecorded(old: dict) -> list[str]:
    """The run settings the grid JSON `old` does not record and whose value is not known."""
    return [f for f, default in RUN_FIELDS.items() if f not in old and default is UNKNOWN]


def resume_check(old: dict, new: dict) -> Optional[str]:
    """Why the grid JSON `old` cannot be resumed as the grid `new` (both `needle_grid` results;
    `new` with no cells), or None. The run's settings must agree (a field `old` does not record
    is taken as it was before the field was recorded, or as this run's where that is not known:
    `unrecorded`), each policy `old` ran must be configured as `new` configures it, and every
    cell of `old` must lie in `new`'s grid and hold what the summary counts."""
    for field, default in RUN_FIELDS.items():
        was = old.get(field, default)
        if was is not UNKNOWN and was != new.get(field):
            said = RUN_FLAGS.get(field, field)
            if field == "filler":
                return f"it was run on a {said} text hashing to {was}, this run's hashes to {new.get(field)}"
            return f"it was run with {said} {was!r}, this run has {new.get(field)!r}"
    for name, described in old.get("policies", {}).items():
        if name in new["policies"] and described != new["policies"][name]:
            return f"its policy {name!r} was configured otherwise ({described}), this run: {new['policies'][name]}"
    seeds = range(new["first_seed"], new["first_seed"] + new["seeds"])
    for cell in old.get("cells", []):
        lacks = [f for f in CELL_FIELDS if f not in cell]
        if lacks:
            return f"its cells do not record {', '.join(lacks)} (written by an older version): run the grid afresh"
        p, n, d, s = cell_key(cell)
        if p not in new["policies"] or n not in new["contexts"] or d not in new["depths"] or s not in seeds:
            return (f"it holds a cell outside this grid ({p}, context {n}, depth {d:g}, seed {s}): give its "
                    f"--policies, --contexts, --depths and seeds too")
    return None


def grid_header(loaded: Any, retrieval: CacheConfig, policies: list[str], contexts: list[int], depths: list[float],
                seeds: int, filler_text: str, chunk: int = 128, digits: int = 5, task: str = "passkey",
                facts: int = 4, chat: bool = False, lead_in: Optional[str] = None, first_seed: int = 0,
                probe: bool = False, tail: int = 0, past_context: bool = False) -> dict:
    """What `needle_grid` with these arguments records, without its cells (for `resume_check`)."""
    return _result(loaded, policy_configs(retrieval, policies), [], contexts, depths, seeds, chunk, task, facts,
                   first_seed, tail, past_context, run_record(digits, chat, lead_in, filler_text, probe))


def _result(loaded: Any, configs: dict, cells: list[dict], contexts: list[int], depths: list[float],
            seeds: int, chunk: int, task: str = "passkey", facts: int = 4, first_seed: int = 0,
            tail: int = 0, past_context: bool = False, run: Optional[dict] = None) -> dict:
    ctx_len = loaded.context_length
    summary = {}
    for name in configs:
        mine = [c for c in cells if c["policy"] == name]
        summary[name] = {"cells": len(mine), "passed": sum(c["passed"] for c in mine),
                         "pass_rate": (sum(c["passed"] for c in mine) / len(mine)) if mine else None,
                         "values_right": sum(c["values_right"] for c in mine),
                         "values": sum(c["values"] for c in mine)}
        probed = [c["probe"]["verdict"] for c in mine if "probe" in c]
        if probed:
            summary[name].update(probed=len(probed), ranking_misses=probed.count("ranking"))
    return {"model": getattr(loaded, "name", "?"), "context_length": ctx_len,
            "task": task, "facts": facts if task in ("keyed", "keyed-all") else None,
            "contexts": contexts, "depths": depths, "seeds": seeds, "first_seed": first_seed, "prefill_chunk": chunk,
            "prefill_tail": tail, "past_context": past_context, **(run or {}),
            "policies": {n: c.describe() for n, c in configs.items()},
            "cells": cells, "summary": summary}


def plot_grid(result: dict, path: Path) -> Path:
    """Heat map PNG: one panel per policy, pass fraction over seeds per (depth, context)."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    policies = list(result["policies"])
    contexts, depths = result["contexts"], result["depths"]
    fig, axes = plt.subplots(1, len(policies), figsize=(3.2 + 1.1 * len(contexts) * len(policies), 3.6),
                             squeeze=False)
    for ax, name in zip(axes[0], policies):
        grid = np.full((len(depths), len(contexts)), np.nan)
        for i, d in enumerate(depths):
            for j, ctx in enumerate(contexts):
                got = [c["passed"] for c in result["cells"]
                       if c["policy"] == name and c["context"] == ctx and c["depth"] == d]
                if got:
                    grid[i, j] = sum(got) / len(got)
        ax.imshow(np.ma.masked_invalid(grid), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(contexts)):
                ax.text(j, i, "-" if np.isnan(grid[i, j]) else f"{grid[i, j]:.0%}",
                        ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(contexts)), [str(c) for c in contexts], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("needle depth")
        s = result["summary"][name]
        rate = "n/a" if s["pass_rate"] is None else f"{s['pass_rate']:.0%}"
        ax.set_title(f"{name}: {rate}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def with_overrides(config: CacheConfig, **kw) -> CacheConfig:
    return dataclasses.replace(config, **{k: v for k, v in kw.items() if v is not None})
