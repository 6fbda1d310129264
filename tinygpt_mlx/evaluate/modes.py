"""Policy spec strings: one short name per cache policy, for `--modes` and `--policies`.

A spec is `+`-separated parts, each optional, mapped onto `CacheConfig.from_flags`:

    fp32 | fp16 | bf16 | int8 | int4 | int2     precision (`--kv-quantize`)
    k8v4                                       KIVI keys int8, values int4 (bits 8, 4 or 2)
    g64, r128                                  KIVI group size G, residual R
    top64, shadowram | shadowdisk              KIVI exact top-k refinement, where its shadow lives
    sink4/window256[:absolute|:shifted]        StreamingLLM (`window256` alone = sink 0)
    hot256                                     retrieval hot budget

e.g. "int4", "bf16", "int8+sink4/window256", "k8v4", "sink4/window256:absolute". The empty
spec and "full" are the fp32 full cache. Parts are case-insensitive; a bad one is a ValueError
naming it.
"""

from __future__ import annotations

import re

from ..config import KV_QUANTIZE_CHOICES, CacheConfig

SPEC_HELP = ("'+'-joined parts: precision fp32|fp16|bf16|int8|int4|int2, kNvM (KIVI key/value bits), "
             "gN (group), rN (residual), topN (KIVI exact top-k), shadowram|shadowdisk, sinkN/windowM[:absolute|:shifted] or windowM (StreamingLLM), "
             "hotN (retrieval); e.g. int4, int8+sink4/window256, k8v4, sink4/window256:absolute")

_KV = re.compile(r"k([248])v([248])")
_STREAM = re.compile(r"(?:sink(\d+)/)?window(\d+)(?::(absolute|shifted))?")
_NUMBERED = re.compile(r"(g|r|hot|top)(\d+)")
_FIELDS = {"g": "group_size", "r": "residual", "hot": "hot_budget", "top": "exact_topk"}


def parse_policy(spec: str) -> CacheConfig:
    """The `CacheConfig` a spec string names (see the module docstring)."""
    flags: dict = {}
    text = spec.strip().lower()
    parts = [] if text in ("", "full") else text.split("+")
    for part in (p.strip() for p in parts):
        def put(key: str, value) -> None:
            if key in flags:
                raise ValueError(f"policy {spec!r}: {part!r} sets {key} twice")
            flags[key] = value
        if part in KV_QUANTIZE_CHOICES:
            put("kv_quantize", part)
        elif m := _KV.fullmatch(part):
            put("kv_quantize_keys", f"int{m[1]}")
            put("kv_quantize_values", f"int{m[2]}")
        elif m := _STREAM.fullmatch(part):
            put("window", int(m[2]))
            put("sink", int(m[1] or 0))
            if m[3]:
                put("rope_mode", m[3])
        elif part in ("shadowram", "shadowdisk"):
            put("shadow_store", part[len("shadow"):])
        elif m := _NUMBERED.fullmatch(part):
            put(_FIELDS[m[1]], int(m[2]))
        else:
            raise ValueError(f"policy {spec!r}: unknown part {part!r} ({SPEC_HELP})")
    try:
        return CacheConfig.from_flags(**flags)
    except ValueError as e:
        raise ValueError(f"policy {spec!r}: {e}") from None


def parse_policies(specs: str) -> dict[str, CacheConfig]:
    """A comma list of specs -> {spec: CacheConfig}, in order; duplicates are an error."""
    out: dict[str, CacheConfig] = {}
    for spec in (s.strip() for s in specs.split(",")):
        if not spec:
            raise ValueError(f"empty policy in {specs!r}")
        if spec in out:
            raise ValueError(f"policy {spec!r} given twice")
        out[spec] = parse_policy(spec)
    return out
