"""Speed and memory per cache policy and context: ours side by side with mlx-lm's caches.

For each context C: prefill C deterministic pseudo-random tokens in chunks, then time
`decode_steps` greedy steps, every step one model call of `generate.steps` (the loop `sample`
runs), and read the bytes each cache reports (mlx-lm's caches allocate in steps of 256 tokens and report
that). The policies run interleaved, chunk by chunk and step by step, so a busy machine slows
them alike; decode tokens/s is 1 / the median step time. mlx-lm's own caches run through the
same function on the same model, as baselines:

    mlx             mlx-lm's own caches for the model (`make_prompt_cache`: KVCache per layer;
                    Gemma 3's sliding layers RotatingKVCache(window), as mlx-lm gives them)
    mlx-rotatingN   RotatingKVCache(max_size=N, keep=4)      (compare with sink4/window<N-4>)
    mlx-q8, mlx-q4  QuantizedKVCache(group_size=64, bits)     (group 32 if head_dim % 64)

Every other spec is one of ours (`CacheConfig.from_spec`), optionally ending in `@eager`: the
same cache with its decode steps run eagerly, never as the compiled step over full rings
(cache/compiled.py), to measure what compiling gives. The fp32 full cache always runs: the
ratios are against it, measured in the same process.

`parts=True` (`bench --parts`) then splits each policy's decode step, in `decode_steps` more
steps interleaved, into building its graph on the host (the model call before evaluation: the
Python of the model and the cache) and evaluating it (the kernels), medians in microseconds
(`step_parts`): a step whose build time is most of it is bound by the host, not the kernels
(except retrieval's, whose build reads the query on the host and so waits for the layers before).

`grow_from=P` (`bench --grow-from P`) prefills P real tokens per context and then fills each
cache to the context directly, by copies of its own rows (`retrieval_bench.grow`: a full
cache's stored rows tiled, a retrieval cache's cold pages copied), as `retrieval_bench --full`
does: a decode step's graph build reads the cache's counts and buffers' shapes, never the
values it holds (nothing is read back while a step is built: tests/test_retrieval_device.py's
sync counter; cache/compiled_retrieval.py `step_inputs` makes the step's key and numbers from
the host's counters), and a filled cache has the counts and shapes of one prefilled over as
many tokens (tests/test_bench_grow.py), so the build at 32K on a 30-layer model needs no hour
of prefill. Only full caches (no eviction, no quantisation) and retrieval policies with exact
cold rows can be filled so (`check_grow`); a model's sliding-window rings beside them (Gemma 3's
local layers) are fed their own rows until they have seen as many tokens (`grow_rings`).
"""

from __future__ import annotations

import random
import re
import statistics
from collections import Counter
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx
from mlx_lm.models import cache as mc

from ..cache import KVCache, make_cache
from ..cache.ring import SINK_STEPS
from ..config import CacheConfig, SampleConfig, field_default
from ..errors import PosttrainError
from ..generate import forward, steps
from ..model import last_logits
from ..sampling import make_sampler
from .defaults import BENCH_DECODE_STEPS as DECODE_STEPS
from .defaults import BENCH_REFERENCE as REFERENCE
from .opcount import graph_ops, summary
from .retrieval_bench import grow

PREFILL_CHUNK = field_default(SampleConfig, "prefill_chunk")
#: a spec of ours ending in this runs its decode steps eagerly (module doc)
EAGER = "@eager"
#: untimed rounds of `step_parts` before its timed ones
PARTS_WARMUP = 5
_MLX = re.compile(r"mlx(?:-rotating(\d+)|-q([248]))?")


class MlxLmCache(list):
    """mlx-lm's own per-layer caches as one model cache (the baselines): the model gets them as
    they are, and they evict inside their own update (`generate.forward` trims only a
    `KVCache`); `nbytes` is what they report."""

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self)


@dataclass
class Policy:
    name: str
    label: str
    make: Callable[[], list]


def _head_dim(model: Any) -> int:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "head_dim"):
        return cfg.head_dim
    args = model.args
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def parse_spec(spec: str) -> Any:
    """A bench spec checked without a model: one of ours (its `CacheConfig`) or an mlx-lm
    baseline (the regex match); a bad spec is a ValueError naming it."""
    m = _MLX.fullmatch(spec.strip().lower())
    if m is None:
        ours, eager = _without_eager(spec)
        if eager and _MLX.fullmatch(ours.lower()):
            raise ValueError(f"policy {spec!r}: {EAGER} is for our policies (mlx-lm's caches always step eagerly)")
        try:
            return CacheConfig.from_spec(ours)
        except ValueError as e:     # name what was typed
            raise ValueError(str(e).replace(f"policy {ours!r}", f"policy {spec!r}", 1)) from None
    if m[1] and int(m[1]) <= 4:
        raise ValueError(f"policy {spec!r}: the rotating size must be > keep (4)")
    return m


def _without_eager(spec: str) -> tuple[str, bool]:
    """(the policy spec, whether it ended in "@eager")."""
    text = spec.strip()
    if text.lower().endswith(EAGER):
        return text[:-len(EAGER)], True
    return text, False


def make_policy(spec: str, model: Any) -> Policy:
    """A named cache factory for `model`; a bad spec is a ValueError."""
    m = parse_spec(spec)
    if isinstance(m, CacheConfig):
        eager = _without_eager(spec)[1]

        def make_ours() -> KVCache:
            cache = make_cache(model, m)
            cache.compile_decode = not eager
            return cache
        return Policy(spec, m.label() + (" (eager steps)" if eager else ""), make_ours)
    n = len(model.layers)
    if m[1]:
        size = int(m[1])
        return Policy(spec, f"mlx-lm RotatingKVCache({size}, keep=4)",
                      lambda: MlxLmCache(mc.RotatingKVCache(size, keep=4) for _ in range(n)))
    if m[2]:
        bits, hd = int(m[2]), _head_dim(model)
        group = 64 if hd % 64 == 0 else 32

        def make() -> list:
            if hd % group:
                raise ValueError(f"mx.quantize needs head_dim {hd} to be a multiple of 32")
            return MlxLmCache(mc.QuantizedKVCache(group, bits) for _ in range(n))
        return Policy(spec, f"mlx-lm QuantizedKVCache(group_size={group}, bits={bits})", make)
    return Policy(spec, _own_label(mc.make_prompt_cache(model)), lambda: MlxLmCache(mc.make_prompt_cache(model)))


def _own_label(caches: list) -> str:
    """The `mlx` row's name: mlx-lm's KVCache, and what it gives other layers (Gemma 3's sliding
    layers get a RotatingKVCache of their window)."""
    others = Counter(f"{type(c).__name__}({c.max_size})" if isinstance(c, mc.RotatingKVCache) else type(c).__name__
                     for c in caches if type(c) is not mc.KVCache)
    return "mlx-lm KVCache" + "".join(f" + {name} on {k} layers" for name, k in sorted(others.items()))


def _cold_stores(cache: Any) -> list:
    return [layer.cold for layer in cache.owned if layer.config.retrieval] if isinstance(cache, KVCache) else []


def stage_split(cache: Any, seconds: float, tokens: int) -> Optional[dict]:
    """A retrieval cache's stage times since the last call, in ms per token, and `other` (the
    rest of `seconds`: the model outside attention's wait, sampling); None for other caches."""
    stores = _cold_stores(cache)
    if not stores or not stores[0].stages.enabled:
        return None
    out: dict = {}
    for store in stores:
        for stage, t in store.stages.seconds.items():
            out[stage] = out.get(stage, 0.0) + t
        store.stages.seconds.clear()
    out["other"] = seconds - sum(out.values())
    return {k: 1e3 * v / tokens for k, v in out.items()}


def measure(model: Any, policies: list[Policy], tokens: list[int], decode_steps: int,
            prefill_chunk: int = PREFILL_CHUNK, tick: Optional[Callable[[str], None]] = None,
            stages: bool = False, parts: bool = False, seed: int = 0, parts_own: bool = False,
            fill_to: Optional[int] = None, abba: bool = False) -> list[dict]:
    """Rows for `policies` at one context, measured interleaved.

    Each policy runs a greedy generation (`generate.steps`, the loop `sample` runs) and every
    `next()` is one timed model call: all caches are filled side by side, each prefill chunk,
    then each decode step, running for every policy in turn, so load from other processes on a
    shared machine falls on all policies alike. The order is shuffled every round (`seed`), as
    `step_parts` does: a rotating order made each policy always follow the same neighbour within
    a round (docs/results.md, "The bench's order": what that neighbour does to a policy's decode
    number was not measured; a graph build after a long context's evaluation was up to a third
    slower, "which step a build follows"). Prefill time is the sum
    of the chunks (the last one includes sampling the first token); a decode step feeds one
    token and samples the next. `tick(policy name)` is called after every timed piece of work.
    `parts`: then `decode_steps` more steps split into graph build and evaluation (`step_parts`;
    `parts_own`: each build timed right after the same cache's own step, `after_own`;
    `abba`: the parts' rounds in a fixed order and its reverse in turn, `step_parts`).
    `fill_to`: after the prefill of `tokens`, every cache is filled to `fill_to` tokens by copies
    of its own rows (`retrieval_bench.grow`, not timed; `bench --grow-from`): the rows' context
    is `fill_to` and they say `grown_from` (prefill tokens/s is over `tokens`).
    """
    caches = [p.make() for p in policies]
    for cache in caches:    # retrieval's stage times (each stage then ends in a sync)
        for store in _cold_stores(cache):
            store.stages.enabled = stages
    runs = [steps(model, tokens, c, make_sampler(0.0), decode_steps + 1, prefill_chunk) for c in caches]
    prefill_s = [0.0] * len(policies)
    step_s: list[list[float]] = [[] for _ in policies]
    failed: dict[int, str] = {}   # a policy this backend cannot run: its one-line reason (the others go on)

    def timed(i: int) -> float:
        t0 = time.perf_counter()
        try:
            next(runs[i])
        except (RuntimeError, ValueError, MemoryError) as e:   # MLX is lazy: a kernel's error comes at eval
            failed[i] = failure(e)
            return 0.0
        dt = time.perf_counter() - t0
        if tick is not None:
            tick(policies[i].name)
        return dt

    rng = random.Random(seed)

    def shuffled() -> list[int]:
        order = [i for i in range(len(policies)) if i not in failed]
        rng.shuffle(order)
        return order

    def each(fn: Callable[[int], Any]) -> list:
        out = []
        for i in range(len(policies)):
            try:
                out.append(None if i in failed else fn(i))
            except (RuntimeError, ValueError, MemoryError) as e:
                failed[i] = failure(e)
                out.append(None)
        return out

    try:
        for _ in range(-(-len(tokens) // prefill_chunk)):
            for i in shuffled():
                prefill_s[i] += timed(i)
        prefill_stages = each(lambda i: stage_split(caches[i], prefill_s[i], len(tokens)))
        if fill_to is not None:     # (not timed: the caches filled to the context by copies of their rows)
            each(lambda i: grow(caches[i], fill_to))
        for _ in range(decode_steps):
            for i in shuffled():
                step_s[i].append(timed(i))
        decode_stages = each(lambda i: stage_split(caches[i], sum(step_s[i]), len(step_s[i])))
        # a spilled cache's decode steps staged ahead (cache/spill_stage.py): staged, hit, missed
        spill = each(lambda i: dict(getattr(caches[i], "spill_stats", None) or {}))
        bytes_ = each(lambda i: int(caches[i].nbytes))
        on_disk = each(lambda i: int(getattr(caches[i], "disk_nbytes", 0)))
        ops = each(lambda i: step_ops(model, caches[i]))
        split: list = [None] * len(caches)
        if parts:
            for cache in caches:    # the split's steps run without the stage syncs (`--stages`)
                for store in _cold_stores(cache):
                    store.stages.enabled = False
            live = [i for i in range(len(caches)) if i not in failed]
            stepped = None if tick is None else (lambda k: tick(f"{policies[live[k]].name} (decode step parts)"))
            for i, us in zip(live, step_parts(model, [caches[i] for i in live], decode_steps,
                                                     after_own=parts_own, abba=abba, progress=stepped)):
                split[i] = us
        # the median step: robust to the scheduler pausing us on a shared machine
        context = len(tokens) if fill_to is None else fill_to
        grown = {} if fill_to is None else {"grown_from": len(tokens)}
        return [{"policy": p.name, "label": p.label, "context": context, "error": failed[i]} if i in failed else
                {"policy": p.name, "label": p.label, "context": context, **grown,
                 "prefill_tokens_per_s": len(tokens) / prefill_s[i],
                 "decode_tokens_per_s": 1.0 / statistics.median(step_s[i]),
                 "cache_bytes": bytes_[i], "cache_disk_bytes": on_disk[i], "decode_ops": ops[i]["ops"], "decode_kernels": ops[i]["kernels"],
                 "decode_ops_by_primitive": ops[i]["by_primitive"],
                 **({"decode_step_us": split[i]} if split[i] else {}),
                 **({"spill_stage": spill[i]} if spill[i] and (spill[i]["staged"] or spill[i]["recorded"]) else {}),
                 **({"prefill_stage_ms_per_token": prefill_stages[i], "decode_stage_ms_per_token": decode_stages[i]}
                    if prefill_stages[i] else {})} for i, p in enumerate(policies)]
    finally:
        for run, cache in zip(runs, caches):
            run.close()
            if isinstance(cache, KVCache):
                cache.close()


def step_parts(model: Any, caches: list, steps: int, warmup: int = PARTS_WARMUP, seed: int = 0,
               after_own: bool = False, abba: bool = False,
               progress: Optional[Callable[[int], None]] = None) -> list[dict]:
    """Median microseconds of one decode step on each of `caches`, split into building its graph
    (`build`: the engine's model call, `generate.forward`, before evaluation) and evaluating it
    (`eval`), and the `whole`; the caches stepped in turn (interleaved), `warmup` untimed steps
    and `steps` timed ones, each feeding one token.

    The order of the caches is shuffled every round (`seed`): a build that always followed the
    same neighbour's evaluation started as warm or as cold as that neighbour left the CPU's
    caches (after a long context's evaluation, a third slower here: docs/results.md, "which
    step a build follows"), so two policies compared by their builds each follow every other.
    `after_own` (`bench --parts-own`): each cache's timed step comes right after an untimed step
    of its own, so its build follows its own evaluation, as in a decode loop (the caches still
    shuffled every round; two steps per cache and round). `abba` (`bench --abba`): the rounds
    step the caches in their given order and in its reverse in turn (A B, B A, A B, ...: each
    cache first as often as last, warm-up rounds included), not shuffled. `progress(i)` after each
    of cache i's rounds, warm-up included, outside the timed region (`bench`'s bar: this phase
    runs `warmup + steps` rounds, twice as many model calls with `after_own`)."""
    build: list[list[float]] = [[] for _ in caches]
    whole: list[list[float]] = [[] for _ in caches]
    rng = random.Random(seed)
    order = list(range(len(caches)))
    for step in range(warmup + steps):
        if abba:    # (the given order in even rounds, its reverse in odd ones)
            order = list(range(len(caches)))[::1 if step % 2 == 0 else -1]
        else:
            rng.shuffle(order)
        for i in order:
            cache = caches[i]
            if after_own:   # (its own step evaluated first: the timed build follows it)
                mx.eval(forward(model, mx.array([[7 + step % 50]]), cache))
            t0 = time.perf_counter()
            logits = forward(model, mx.array([[7 + step % 50]]), cache)
            t1 = time.perf_counter()
            mx.eval(logits)
            t2 = time.perf_counter()
            if step >= warmup:
                build[i].append(t1 - t0)
                whole[i].append(t2 - t0)
            if progress is not None:
                progress(i)
    out = []
    for b, w in zip(build, whole):
        b_us, w_us = statistics.median(b) * 1e6, statistics.median(w) * 1e6
        out.append({"build": b_us, "eval": w_us - b_us, "whole": w_us})
    return out


def step_ops(model: Any, cache: Any, n: int = SINK_STEPS) -> dict:
    """What a decode step on `cache` runs, on average over `n` more steps (opcount.summary of
    each graph; work done every few steps, like the shifted ring's sink rotation, is spread):
    the same model for every policy, so differences between policies are what their caches add."""
    total: Counter = Counter()
    for _ in range(n):
        logits = forward(model, mx.array([[1]]), cache)
        total += graph_ops(logits)
        mx.eval(logits)
    out = summary(total)
    return {k: (v / n if k != "by_primitive" else {p: c / n for p, c in v.items()}) for k, v in out.items()}


def bench(model: Any, specs: list[str], contexts: list[int], decode_steps: int = DECODE_STEPS,
          prefill_chunk: int = PREFILL_CHUNK, seed: int = 0,
          progress: Optional[Callable[[int, int, str], None]] = None, reference: str = REFERENCE,
          stages: bool = False, parts: bool = False, parts_own: bool = False,
          grow_from: Optional[int] = None, abba: bool = False) -> dict:
    """Rows for every (context, policy), with ratios against `reference` (which always runs;
    fp32 by default); policies whose cache this build or model cannot make (e.g. KIVI on a
    too-small head dim) are listed under `skipped`. `progress(done, total, description)` follows
    the timed work. `parts_own` and `abba` imply `parts` (`measure`). `grow_from`: each context's
    caches prefill that many tokens and are then filled to the context (`measure`'s `fill_to`;
    `check_grow` says which can be)."""
    parts = parts or parts_own or abba
    if not contexts or min(contexts) < 1:
        raise ValueError(f"contexts must be positive integers, got {contexts}")
    if decode_steps < 1:
        raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    specs = list(dict.fromkeys([reference, *specs]))
    policies = [make_policy(s, model) for s in specs]  # every spec parses before anything runs
    if grow_from is not None:
        check_grow(specs, contexts, grow_from)
    vocab = model(mx.array([[0]])).shape[-1]
    skipped: dict[str, str] = {}
    for p in list(policies):  # warm-up, and find the caches that cannot be made or run here
        try:
            row = measure(model, [p], list(range(8)), 2)[0]
        except (ValueError, RuntimeError, MemoryError) as e:
            row = {"error": failure(e)}
        if "error" in row:
            skipped[p.name] = row["error"]
            policies.remove(p)
    # one chunk-sized pass first, so the allocator's first growth is not billed to a policy
    # (its head at the last position, as every timed prefill pass computes it)
    mx.eval(last_logits(model, mx.zeros((1, min(prefill_chunk, max(contexts))), dtype=mx.int32), None))
    total = len(policies) * sum(-(-(c if grow_from is None else grow_from) // prefill_chunk) + decode_steps
                                + (PARTS_WARMUP + decode_steps if parts else 0) for c in contexts)
    done = 0
    rows = []
    for context in contexts:
        def tick(name: str) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(done, total, f"{context} tokens · {name}")
        n = context if grow_from is None else grow_from
        tokens = mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).tolist()
        rows += measure(model, policies, tokens, decode_steps, prefill_chunk, tick, stages, parts, seed, parts_own,
                        fill_to=None if grow_from is None else context, abba=abba)
    add_ratios(rows, reference)
    return {"decode_steps": decode_steps, "prefill_chunk": prefill_chunk, "reference": reference, "rows": rows,
            "skipped": skipped, "stages": stages, "parts": parts,
            **({"parts_order": "own" if parts_own else "shuffled",
                "parts_rounds": "abba" if abba else "shuffled"} if parts else {}),
            **({"grown_from": grow_from} if grow_from is not None else {})}


def check_grow(specs: list[str], contexts: list[int], grow_from: int) -> None:
    """Whether `bench --grow-from` can fill every policy of `specs` to each of `contexts` after
    `grow_from` prefilled tokens (`retrieval_bench.grow`): a full cache without eviction or
    quantisation (its rows tiled), or a retrieval policy with exact cold rows, none spilled, whose sink and
    hot window hold fewer than `grow_from` tokens (some are cold to copy); every context more
    than `grow_from`. A ValueError naming the flag and what was given where not."""
    if grow_from < 1:
        raise ValueError(f"--grow-from {grow_from}: give a positive number of tokens to prefill")
    short = [c for c in contexts if c <= grow_from]
    if short:
        raise ValueError(f"--grow-from {grow_from}: every --contexts value must be more than it "
                         f"(got {','.join(map(str, short))})")
    for spec in specs:
        m = parse_spec(spec)
        if not isinstance(m, CacheConfig):
            raise ValueError(f"--grow-from: policy {spec!r} is one of mlx-lm's caches; only our full caches "
                             "and retrieval policies can be filled directly")
        if m.retrieval:
            if m.cold_bits is not None or m.cold_ram is not None:
                raise ValueError(f"--grow-from: policy {spec!r} {'packs' if m.cold_bits is not None else 'spills'} "
                                 "its cold rows; only exact cold rows held in memory can be copied")
            hot = m.held_sink + m.hot_budget
            if grow_from <= hot:
                raise ValueError(f"--grow-from {grow_from}: policy {spec!r} keeps {hot} tokens hot; prefill "
                                 "more, so that some are cold to copy")
        elif m.streaming or m.quantised:
            raise ValueError(f"--grow-from: policy {spec!r} evicts or quantises; only our full caches and "
                             "retrieval policies can be filled directly")


def failure(e: BaseException) -> str:
    """A policy's failure as one line: its kind and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


def add_ratios(rows: list[dict], reference: str = REFERENCE) -> None:
    """Each row gets `<metric>_vs_<reference>`: its value over the reference row at the same context
    (None where either failed)."""
    ref = {r["context"]: r for r in rows if r["policy"] == reference and "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        base = ref.get(r["context"])
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "cache_bytes"):
            denom = base[key] if base else 0
            r[f"{key}_vs_{reference}"] = r[key] / denom if denom else None


def plot(rows: list[dict], path) -> None:
    """decode ms/token and cache MB against context, one line per policy (PNG via Agg)."""
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        raise PosttrainError("--plot needs matplotlib: pip install 'posttrainllm[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r["policy"] for r in rows):
        mine = sorted((r for r in rows if r["policy"] == name and "error" not in r), key=lambda r: r["context"])
        ctx = [r["context"] for r in mine]
        ax_t.plot(ctx, [1000 / r["decode_tokens_per_s"] for r in mine], marker="o", label=name)
        ax_m.plot(ctx, [r["cache_bytes"] / 2**20 for r in mine], marker="o", label=name)
    for ax, title in ((ax_t, "decode ms / token"), (ax_m, "cache MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_m.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
