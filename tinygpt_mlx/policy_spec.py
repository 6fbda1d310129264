"""The policy vocabulary: the names of each choice, the spec-string grammar and the short label.

A policy spec such as "int4+sink4/window252:absolute" names a `CacheConfig` in one string
(`compare --modes`, `perplexity`, `bench --policies`, needle's grid); `spec_flags` turns it into
the `CacheConfig.from_flags` keywords and `label` names a config for humans. Nothing here
validates: `CacheConfig` does, and `config.py` imports this module (never the other way).
"""

from __future__ import annotations

import re
from typing import Any

STORAGE_DTYPES = ("fp32", "fp16", "bf16")
QUANT_BITS = {"int8": 8, "int4": 4, "int2": 2}
KV_QUANTIZE_CHOICES = STORAGE_DTYPES + tuple(QUANT_BITS)
#: KIVI group sizes: the ones MLX's quantised kernels accept (`quant.py`).
GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
ROPE_MODES = ("shifted", "absolute")
#: The RoPE mode of a StreamingLLM or retrieval policy that names none.
DEFAULT_ROPE_MODE = "shifted"
SUMMARY_KINDS = ("minmax", "mean", "hybrid")
COLD_STORES = ("ram", "disk")
RETRIEVED_POSITIONS = ("fixed", "page", "slots")
RETRIEVE_UNITS = ("tokens", "spans")



def spec_flags(spec: str) -> dict[str, Any]:
    """The `CacheConfig.from_flags` keywords of a policy spec (`CacheConfig.from_spec`, the one
    spec parser: `--modes`, `--policies`, `--baseline`, needle's grid): `+`-joined parts, each
    optional, case-insensitive:

        fp32 | fp16 | bf16 | int8 | int4 | int2     precision (`--kv-quantize`)
        k8v4                                       KIVI keys int8, values int4 (bits 8, 4 or 2)
        g64, r128                                  KIVI group size G, residual R
        esink4, rot | norot                        KIVI: first 4 tokens exact, rotated basis
        near256, near256b4                         KIVI: newest 256 frozen tokens at 8 (4) bits
        near/8, near/8b4                           KIVI: newest 1/8 of the frozen tokens at 8 (4) bits
        top64, shadowram | shadowdisk              KIVI exact top-k refinement, where its shadow lives
        sink4/window256[:absolute|:shifted]        StreamingLLM (`window256` alone = sink 0)
        [sink4/]hot256[:absolute|:shifted]         retrieval hot budget (and its sink)
        colddisk | coldram                         retrieval's cold store on disk (default) or in RAM
        spans | tokens, page                       what retrieval fetches; page RoPE slots
        block8                                     retrieval: pages per block of the page index
        minmax | mean | hybrid                     retrieval: the page summary
        fetch256, pages64                          retrieval: cold tokens fetched per query; pages the coarse pass keeps
        sticky | nosticky                          retrieval: the last pick's pages kept in reach
        expand4                                    retrieval: blocks the index expands, x top pages

    e.g. "int4", "int8+sink4/window256", "k8v4", "sink4/window256:absolute". The empty spec
    and "full" are the fp32 full cache. An unknown part, or a keyword set twice, is a ValueError
    naming the spec."""
    flags: dict[str, Any] = {}
    text = spec.strip().lower()
    for part in ([] if text in ("", "full") else [p.strip() for p in text.split("+")]):
        matched = False
        for pattern, build in _SPEC_PARTS:
            if m := pattern.fullmatch(part):
                for key, value in build(m).items():
                    if key in flags:
                        raise ValueError(f"policy {spec!r}: {part!r} sets {key} twice")
                    flags[key] = value
                matched = True
                break
        if not matched:
            raise ValueError(f"policy {spec!r}: unknown part {part!r} ({SPEC_HELP})")
    return flags


def label(config: Any, default_kivi_sink: int) -> str:
    """A short human name for a `CacheConfig`, e.g. 'int4 + sink4/window256 (shifted)'; the
    defaults go unnamed (`default_kivi_sink`: the exact sink a full KIVI cache keeps by default)."""
    if config.quantised:
        kb = f"int{config.key_bits}" if config.key_bits else config.storage
        vb = f"int{config.value_bits}" if config.value_bits else config.storage
        prec = kb if kb == vb else f"K {kb} / V {vb}"
        if config.exact_topk:
            where = "" if config.shadow_store == "disk" else f", {config.shadow_store} shadow"
            prec += f" (exact top-{config.exact_topk}{where})"
        # the defaults (rotated, the first 4 tokens exact) go unnamed; a departure is named
        if not config.rotate:
            prec += ", unrotated"
        if config.near_tier:
            newest = config.near or f"1/{config.near_share}"
            prec += f", newest {newest} frozen at int{config.near_bits}"
        if not (config.streaming or config.retrieval) and config.kivi_sink != default_kivi_sink:
            prec += f", first {config.kivi_sink} exact" if config.kivi_sink else ", no exact sink"
    else:
        prec = config.storage
    parts = [prec]
    if config.streaming:
        parts.append(f"StreamingLLM sink {config.sink} + window {config.window} ({config.rope_mode} RoPE)")
    if config.retrieval:
        fetched = (f"top {config.retrieve_tokens} tokens" if config.retrieve_unit == "tokens" else
                   f"top {max(1, config.retrieve_tokens // config.page_size)} pages")
        parts.append(f"retrieval hot {config.hot_budget} + {fetched}")
    return " + ".join(parts)


SPEC_HELP = ("'+'-joined parts: precision fp32|fp16|bf16|int8|int4|int2, kNvM (KIVI key/value bits), "
             "gN (group), rN (residual), topN (KIVI exact top-k), shadowram|shadowdisk, esinkN (KIVI: first N exact), rot|norot (KIVI rotation), nearN[bB] or near/S[bB] (KIVI near tier: N tokens, or 1/S of the frozen ones), "
             "sinkN/windowM[:absolute|:shifted] or windowM (StreamingLLM), [sinkN/]hotM[:absolute|:shifted] (retrieval), "
             "colddisk|coldram (retrieval's cold store on disk, the default, or in RAM), spans|tokens (what retrieval fetches), page (retrieved RoPE slots by page), blockN (retrieval's page index block), "
             "minmax|mean|hybrid (page summary), fetchN (cold tokens fetched), pagesN (top pages), sticky|nosticky (the last pick's pages kept), expandN (index blocks expanded, x top pages); "
             "e.g. int4, int8+sink4/window256, k8v4, sink4/window256:absolute")


def _rope(m: "re.Match") -> dict[str, Any]:
    return {"rope_mode": m["rope"]} if m["rope"] else {}


_ROPE = r"(?::(?P<rope>absolute|shifted))?"
_NUMBERED = {"g": "group_size", "r": "residual", "top": "exact_topk"}
# (a spec part's pattern, the `from_flags` keywords it sets), tried in order by `from_spec`.
_SPEC_PARTS = (
    (re.compile("|".join(KV_QUANTIZE_CHOICES)), lambda m: {"kv_quantize": m[0]}),
    (re.compile(r"k([248])v([248])"), lambda m: {"kv_quantize_keys": f"int{m[1]}",
                                                  "kv_quantize_values": f"int{m[2]}"}),
    (re.compile(r"(?:sink(\d+)/)?window(\d+)" + _ROPE),
     lambda m: {"window": int(m[2]), "sink": int(m[1] or 0), **_rope(m)}),
    (re.compile(r"(?:sink(\d+)/)?hot(\d+)" + _ROPE),
     lambda m: {"hot_budget": int(m[2]), **({"sink": int(m[1])} if m[1] else {}), **_rope(m)}),
    (re.compile(r"cold(disk|ram)"), lambda m: {"cold_store": m[1]}),
    (re.compile(r"spans|tokens"), lambda m: {"retrieve_unit": m[0]}),
    (re.compile(r"block(\d+)"), lambda m: {"index_block": int(m[1])}),
    (re.compile(r"page"), lambda m: {"retrieved_position": "page"}),
    (re.compile(r"pages(\d+)"), lambda m: {"top_pages": int(m[1])}),
    (re.compile(r"fetch(\d+)"), lambda m: {"retrieve_tokens": int(m[1])}),
    (re.compile(r"minmax|mean|hybrid"), lambda m: {"summary": m[0]}),
    (re.compile(r"(no)?sticky"), lambda m: {"sticky": not m[1]}),
    (re.compile(r"expand(\d+)"), lambda m: {"index_expand": int(m[1])}),
    (re.compile(r"shadow(ram|disk)"), lambda m: {"shadow_store": m[1]}),
    (re.compile(r"esink(\d+)"), lambda m: {"kivi_sink": int(m[1])}),
    (re.compile(r"(no)?rot"), lambda m: {"rotate": not m[1]}),
    (re.compile(r"near(/?)(\d+)(?:b(\d+))?"), lambda m: {("near_share" if m[1] else "near"): int(m[2]),
                                                            **({"near_bits": int(m[3])} if m[3] else {})}),
    (re.compile(r"(g|r|top)(\d+)"), lambda m: {_NUMBERED[m[1]]: int(m[2])}),
)
