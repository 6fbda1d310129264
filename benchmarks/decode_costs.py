"""Where a decode step's time goes, for docs/results.md (the headline decode path):

1. attention parts of one layer at the shipped model's shape (4 KV heads, 2 queries each, head
   dim 32) over `--context` keys: MLX's `quantized_matmul` for q.K and p.V (int4, G=32, fp16 and
   fp32 parameters) against dense fp32 matmuls of the same products, the softmax over the
   scores (and an exp alone, and 2^x, which this CPU build computes ~3x faster than exp), and
   fp32 `scaled_dot_product_attention`;
2. the Python side of a decode step on the shipped model: the time to build one step's graph
   (the model call before `mx.eval`: `generate.forward`, the engine's call) and the whole step,
   for mlx-lm's RotatingKVCache(256, 4) and our StreamingLLM ring (sink 4 + window 252,
   absolute and shifted), each ring stepped eagerly and as the compiled step
   (cache/compiled.py), interleaved step by step after a 1,024-token prefill (the split is
   `posttrainllm bench --parts`'s, which runs it on any model and policies);
3. kernels per steady decode step (`evaluate/opcount.py`: graph nodes that are not views, the
   mean over 32 steps after 400 tokens, so one KIVI block freeze and eviction each) for the
   full and windowed caches (the rings eager and compiled), KIVI's frame positions beside the
   pre-RoPE path they replaced;
4. a shifted ring far out (its counters set as if 95,000 tokens had gone by: it re-bases once
   and its sink block is advanced and refreshed as in a long run) against one near position 0,
   decode steps (compiled, as `sample` runs them) interleaved: whether anything in the ring
   slows with tokens seen;
5. retrieval's decode step (sink 4 + hot window 252, the default search) after a
   `--retrieval-context`-token prefill, interleaved: the shifted hot window on frame positions
   (kept as the model rotated it), the pre-RoPE window it replaced (`make_cache(..., ring=False)`
   here, as tests/prerope.py builds it for the tests: placed after the retrieval slots on every
   read) and absolute positions (nothing rotated), and
   the same with a KIVI int4 hot window (shifted on frame positions, and absolute).

    python -m benchmarks.decode_costs [--context 8192] [--steps 300] [--model models/tinygpt-base.tinygpt]
        [--parts attention,python,kernels,far,retrieval] [--retrieval-context 4096]

Microseconds, medians. Not a test; for benchmarks preload OpenBLAS (README of docs/results.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx

from benchmarks._timing import ms_per_call
from tinygpt_mlx import quant
from tinygpt_mlx.cache import factory
from tinygpt_mlx.cache.positions import Positions
from tinygpt_mlx.evaluate.bench import step_parts


def _us(f) -> float:
    return ms_per_call(f, 200, warmup=10, median=True) * 1e3


def _step_times(model, caches: dict, steps: int, warmup: int) -> dict[str, tuple[float, float]]:
    """Median microseconds (graph build, whole step) of one decode step per cache, the caches
    stepped in turn (interleaved): `bench --parts`'s split (`evaluate.bench.step_parts`)."""
    parts = step_parts(model, list(caches.values()), steps, warmup)
    return {n: (p["build"], p["whole"]) for n, p in zip(caches, parts)}


def attention_parts(T: int) -> dict[str, float]:
    H, rep, D = 4, 2, 32
    key = mx.random.key(0)
    q, k, v = (mx.random.normal(s, key=kk) for s, kk in
               zip(((1, H, rep, D), (1, H, T, D), (1, H, T, D)), mx.random.split(key, 3)))
    kq = quant.quantise_affine(mx.swapaxes(k, -1, -2), 4, 32, mx.float16)   # keys per channel
    vq = quant.quantise_affine(v, 4, 32, mx.float16)                        # values per token
    kq32 = (kq[0],) + tuple(a.astype(mx.float32) for a in kq[1:])
    vq32 = (vq[0],) + tuple(a.astype(mx.float32) for a in vq[1:])
    p = mx.softmax(mx.random.normal((1, H, rep, T)), axis=-1)
    q8 = q.reshape(1, H * rep, 1, D)
    mx.eval(q, k, v, p, q8, *kq, *vq, *kq32, *vq32)
    qmm = mx.quantized_matmul
    return {
        "q.K quantized_matmul (fp16 params)": _us(lambda: qmm(q, *kq, transpose=False, group_size=32, bits=4)),
        "q.K quantized_matmul (fp32 params)": _us(lambda: qmm(q, *kq32, transpose=False, group_size=32, bits=4)),
        "q.K dense fp32 matmul": _us(lambda: q @ mx.swapaxes(k, -1, -2)),
        "p.V quantized_matmul (fp16 params)": _us(lambda: qmm(p, *vq, transpose=False, group_size=32, bits=4)),
        "p.V quantized_matmul (fp32 params)": _us(lambda: qmm(p, *vq32, transpose=False, group_size=32, bits=4)),
        "p.V dense fp32 matmul": _us(lambda: p @ v),
        "softmax over the scores": _us(lambda: mx.softmax(q.sum() + p, axis=-1, precise=True)),
        "exp over the scores": _us(lambda: mx.exp(q.sum() + p)),
        "2^x over the scores (mx.power)": _us(lambda: mx.power(2.0, q.sum() + p)),
        "fp32 scaled_dot_product_attention": _us(lambda: mx.fast.scaled_dot_product_attention(q8, k, v, scale=0.17)),
    }


def python_side(model_path: str, steps: int) -> dict[str, tuple[float, float]]:
    from mlx_lm.models.cache import RotatingKVCache

    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.loading import load
    m = load(model_path)
    caches = {"mlx-lm RotatingKVCache(256, keep=4)": [RotatingKVCache(max_size=256, keep=4) for _ in m.model.layers]}
    for mode in ("absolute", "shifted"):
        for compiled in (False, True):
            c = make_cache(m.model, CacheConfig(sink=4, window=252, rope_mode=mode))
            c.compile_decode = compiled
            caches[f"ring 4 + 252, {mode}, {'compiled' if compiled else 'eager'}"] = c
    for c in caches.values():
        for i in range(0, 1024, 128):
            mx.eval(m.model(mx.array([[(j * 37 + 11) % 4000 for j in range(i, i + 128)]]), cache=c))
    return _step_times(m.model, caches, steps, warmup=50)


def make_cache(model, config, ring: bool = True):
    """The product's cache (`ring=True`), or the pre-RoPE path that frame positions replaced
    (`ring=False`: every key kept before RoPE and placed at its slot on every read; the tests
    build the same in tests/prerope.py and hold the frame paths to it)."""
    def prerope_layer(cfg, rope, layer_index=0):
        return factory.segmented_layer(cfg, Positions(cfg, rope, frame=False), layer_index)
    return factory.make_cache(model, config, **({} if ring else {"layer": prerope_layer}))


def kernels(model_path: str) -> dict[str, float]:
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.evaluate.bench import step_ops
    from tinygpt_mlx.loading import load
    m = load(model_path)
    out = {}
    for label, spec, ring, compiled in (
            ("fp32", "fp32", True, False), ("int4", "int4", True, False),
            ("sink4/window252 (eager)", "sink4/window252", True, False),
            ("sink4/window252 (compiled)", "sink4/window252", True, True),
            ("sink4/window252:absolute (eager)", "sink4/window252:absolute", True, False),
            ("sink4/window252:absolute (compiled)", "sink4/window252:absolute", True, True),
            ("int4+sink4/window252 (frame)", "int4+sink4/window252", True, False),
            ("int4+sink4/window252 (pre-RoPE path)", "int4+sink4/window252", False, False)):
        cache = make_cache(m.model, CacheConfig.from_spec(spec), ring=ring)
        cache.compile_decode = compiled
        toks = [(j * 37 + 11) % 4000 for j in range(400)]
        for i in range(0, 384, 128):
            mx.eval(m.model(mx.array([toks[i:i + 128]]), cache=cache))
        for i in range(384, 400):
            mx.eval(m.model(mx.array([toks[i:i + 1]]), cache=cache))
        out[label] = step_ops(m.model, cache, n=32)["kernels"]
    return out


def far_out(model_path: str, steps: int) -> dict[str, float]:
    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.loading import load
    m = load(model_path)

    def ring(seen: int):
        cache = make_cache(m.model, CacheConfig(sink=4, window=252))
        for layer in cache.owned:          # as if `seen` tokens had gone by (nothing of them stored)
            layer.seen = layer.start = seen
        mx.eval(m.model(mx.array([[(j * 37 + 11) % 4000 for j in range(300)]]), cache=cache))
        return cache
    caches = {"shifted ring near position 0": ring(0), "shifted ring at 95,000 tokens": ring(95000)}
    return {n: whole for n, (_, whole) in _step_times(m.model, caches, steps, warmup=100).items()}


def retrieval_window(model_path: str, steps: int, context: int) -> dict[str, float]:
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.generate import prefill
    from tinygpt_mlx.loading import load
    m = load(model_path)
    toks = [(j * 37 + 11) % 4000 for j in range(context)]
    caches = {}
    for label, spec, ring in (("hot window on frame positions (shifted)", "sink4/hot252", True),
                              ("pre-RoPE hot window (shifted, ring=False)", "sink4/hot252", False),
                              ("absolute positions", "sink4/hot252:absolute", True),
                              ("int4 hot window, frame positions (shifted)", "int4+sink4/hot252", True),
                              ("int4 hot window, absolute positions", "int4+sink4/hot252:absolute", True)):
        caches[label] = make_cache(m.model, CacheConfig.from_spec(spec), ring=ring)
        prefill(m.model, toks, caches[label], 512)
    return {n: whole for n, (_, whole) in _step_times(m.model, caches, steps, warmup=20).items()}


PARTS = ("attention", "python", "kernels", "far", "retrieval")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=8192, help="keys for the attention parts")
    ap.add_argument("--steps", type=int, default=300, help="decode steps per cache for the Python side")
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "tinygpt-base.tinygpt"))
    ap.add_argument("--parts", default=",".join(PARTS), help=f"which sections to run, of {','.join(PARTS)}")
    ap.add_argument("--retrieval-context", type=int, default=4096, help="tokens prefilled before retrieval's steps")
    a = ap.parse_args()
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        ap.error(f"--parts {a.parts!r}: expected some of {','.join(PARTS)}")
    if "retrieval" in parts and a.retrieval_context < 512:
        ap.error(f"--retrieval-context must be at least 512, got {a.retrieval_context}")
    if a.context < 32 or a.context % 32:
        ap.error(f"--context must be a positive multiple of 32, got {a.context}")
    if a.steps < 10:
        ap.error(f"--steps must be at least 10, got {a.steps}")
    if not Path(a.model).exists():
        ap.error(f"--model {a.model}: no such file or directory")
    if "attention" in parts:
        print(f"attention parts of one layer over {a.context} keys (median us):")
        for name, us in attention_parts(a.context).items():
            print(f"  {name:40s} {us:9.1f}")
    if "python" in parts:
        print(f"decode step on {Path(a.model).name} after 1,024 tokens (median us): graph build / whole step")
        for name, (b, w) in python_side(a.model, a.steps).items():
            print(f"  {name:40s} {b:7.0f} / {w:7.0f}")
    if "kernels" in parts:
        print("kernels per decode step (mean over 32 steady steps):")
        for name, k in kernels(a.model).items():
            print(f"  {name:40s} {k:7.1f}")
    if "far" in parts:
        print("decode step far out vs near 0 (median us, interleaved):")
        for name, us in far_out(a.model, max(a.steps, 1000)).items():
            print(f"  {name:40s} {us:7.0f}")
    if "retrieval" in parts:
        print(f"retrieval decode step after {a.retrieval_context:,} tokens (median us, interleaved):")
        for name, us in retrieval_window(a.model, a.steps, a.retrieval_context).items():
            print(f"  {name:42s} {us:7.0f}")


if __name__ == "__main__":
    main()
