"""The policy spec grammar (generated from `knobs.KNOBS`), the short label of a policy and its settings.

A policy spec such as "int4+sink4/window252:absolute" names a `CacheConfig` in one string
(`compare --modes`, `perplexity`, `bench --policies`, needle's grid); `spec_flags` turns it into
the `CacheConfig.from_flags` keywords, `label` names a config for humans and `describe` lists its
settings for banners and JSON reports. Nothing here validates: `CacheConfig` does, and
`config.py` imports this module (never the other way).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from .knobs import KNOBS, LONG_RESIDUAL_SHARE, Knob

__all__ = ["SPEC_BRIEF", "SPEC_HELP", "SPEC_PARTS", "describe", "label", "spec_flags"]


def spec_flags(spec: str) -> dict[str, Any]:
    """The `CacheConfig.from_flags` keywords of a policy spec (`CacheConfig.from_spec`, the one
    spec parser: `--modes`, `--policies`, `--baseline`, needle's grid): `+`-joined parts, each
    optional, case-insensitive, each one of `SPEC_PARTS` (listed in `SPEC_HELP`: a knob's own part
    from `knobs.KNOBS`, or one of the parts below that set several keywords at once).
    e.g. "int4", "int8+sink4/window256", "k8v4", "sink4/window256:absolute". The empty spec
    and "full" are the fp32 full cache. An unknown part, or a keyword set twice, is a ValueError
    naming the spec (and for an unknown part a few examples, `SPEC_BRIEF`: the whole grammar,
    `SPEC_HELP`, is a thousand characters, for --help)."""
    flags: dict[str, Any] = {}
    text = spec.strip().lower()
    for part in ([] if text in ("", "full") else [p.strip() for p in text.split("+")]):
        matched = False
        for pattern, build, _ in SPEC_PARTS:
            if m := pattern.fullmatch(part):
                for key, value in build(m).items():
                    if key in flags:
                        raise ValueError(f"policy {spec!r}: {part!r} sets {key} twice")
                    flags[key] = value
                matched = True
                break
        if not matched:
            raise ValueError(f"policy {spec!r}: unknown part {part!r} ({SPEC_BRIEF})")
    return flags


def describe(config: Any) -> dict:
    """The active settings of a `CacheConfig`, as shown in banners and JSON reports (derived
    defaults as in effect: int4's near tier, int8's grown residual)."""
    d: dict[str, Any] = {"storage": config.storage}
    if config.quantised:
        d.update(kivi={"key_bits": config.key_bits, "value_bits": config.value_bits,
                       "group_size": config.group_size, "residual": config.residual})
        if config.residual_grows:
            d["kivi"]["long_residual"] = config.grown_residual
        if config.value_group is not None:
            d["kivi"]["value_group"] = config.value_group
        d["kivi"]["rotate"] = config.rotate
        if config.near_tier:
            d["kivi"].update(**({"near": config.near} if config.near else {"near_share": config.tier_share}),
                             near_bits=config.near_bits)
        if not (config.streaming or config.retrieval):
            d["kivi"]["exact_sink"] = config.kivi_sink
        if config.exact_topk:
            d["kivi"].update(exact_topk=config.exact_topk, shadow_store=config.shadow_store)
    if config.streaming:
        d.update(streaming_llm={"sink": config.sink, "window": config.window,
                                "rope_mode": config.rope_mode})
        if config.rope_auto:
            d["streaming_llm"]["rope_auto"] = True
    if config.retrieval:
        d.update(retrieval={"hot_budget": config.hot_budget, "sink": config.sink,
                            "retrieve_tokens": config.retrieve_tokens,
                            "page_size": config.page_size, "top_pages": config.top_pages,
                            "summary": config.summary, "cold_store": config.cold_store,
                            "cold_bits": config.cold_bits, "rope_mode": config.rope_mode,
                            "retrieved_position": config.retrieved_position,
                            "index_block": config.index_block, "retrieve_unit": config.retrieve_unit,
                            "sticky": config.sticky, "index_expand": config.index_expand})
        if config.span_score != "max":
            d["retrieval"]["span_score"] = config.span_score
        if config.rope_auto:
            d["retrieval"]["rope_auto"] = True
        if config.cold_ram is not None:
            d["retrieval"]["cold_ram_mib"] = config.cold_ram
    return d


def label(config: Any, default: Any) -> str:
    """A short human name for a `CacheConfig`, e.g. 'int4 + sink4/window256 (shifted)'; the
    defaults (`default(field)`: `CacheConfig`'s) go unnamed."""
    if config.quantised:
        kb = f"int{config.key_bits}" if config.key_bits else config.storage
        vb = f"int{config.value_bits}" if config.value_bits else config.storage
        prec = kb if kb == vb else f"K {kb} / V {vb}"
        if config.exact_topk:
            where = "" if config.shadow_store == "disk" else f", {config.shadow_store} shadow"
            prec += f" (exact top-{config.exact_topk}{where})"
        # the defaults (fp32 exact tokens, G 32, R 32, rotated, the first 4 tokens exact) go
        # unnamed; a departure is named (an exact side already names the exact dtype)
        if config.key_bits and config.value_bits and config.storage != default("storage"):
            prec += f", {config.storage} exact"
        if config.group_size != default("group_size"):
            prec += f", G {config.group_size}"
        if config.value_group_size != config.group_size:
            prec += f", V groups {config.value_group_size}"
        if config.residual != default("residual"):
            prec += f", R {config.residual}"
        grown = config.grown_residual   # named where it does what the precision's own does not
        if config.in_effect("long_residual") != dataclasses.replace(config, long_residual=None).in_effect("long_residual"):
            prec += (f", R {grown} from {LONG_RESIDUAL_SHARE * grown} tokens" if config.residual_grows
                     else ", no long residual")
        if not config.rotate:
            prec += ", unrotated"
        default_tier = (not config.near and config.tier_share == config.default_near_share()
                        and config.near_bits == default("near_bits"))   # int4's own tier goes unnamed
        if config.near_tier and not default_tier:
            newest = config.near or f"1/{config.tier_share}"
            prec += f", newest {newest} frozen at int{config.near_bits}"
        elif not config.near_tier and config.default_near_share():
            prec += ", no near tier"
        if not (config.streaming or config.retrieval) and config.kivi_sink != default("kivi_sink"):
            prec += f", first {config.kivi_sink} exact" if config.kivi_sink else ", no exact sink"
    else:
        prec = config.storage
    parts = [prec]
    if config.streaming:
        parts.append(f"StreamingLLM sink {config.sink} + window {config.window} ({config.rope_mode} RoPE)")
    if config.retrieval:
        fetched = (f"top {config.retrieve_tokens} tokens" if config.retrieve_unit == "tokens" else
                   f"top {max(1, config.retrieve_tokens // config.page_size)} pages")
        # the page rankings, where not the defaults (min/max bound, a page by its best token)
        notes = ([f"{config.summary} summary"] if config.summary != default("summary") else []) + (
            [f"pages by {config.span_score} score"] if config.span_score != default("span_score") else [])
        # the positions, where not shifted slots (the default, and `rope_auto`'s until `for_run`)
        notes += ["original positions"] if config.rope_mode == "absolute" else []
        parts.append(f"retrieval hot {config.hot_budget} + {fetched}" + (f" ({', '.join(notes)})" if notes else ""))
    return " + ".join(parts)


def _rope(m: "re.Match") -> dict[str, Any]:
    return {"rope_mode": m["rope"]} if m["rope"] else {}


def _knob_part(knob: Knob) -> tuple["re.Pattern", Any, str]:
    return re.compile(knob.spec), lambda m: {knob.keyword: knob.spec_value(m[1])}, knob.spec_help


_ROPE = r"(?::(?P<rope>absolute|shifted))?"
# The parts that set several keywords at once, each listed beside the knob of the first keyword it sets.
_COMPOSITE = {
    "kv_quantize_keys": (re.compile(r"k([2-8])v([2-8])"),
                    lambda m: {"kv_quantize_keys": f"int{m[1]}", "kv_quantize_values": f"int{m[2]}"},
                    "kNvM (KIVI key/value bits)"),
    "near": (re.compile(r"near(/?)(\d+)(?:b(\d+))?"),
               lambda m: {("near_share" if m[1] else "near"): int(m[2]), **({"near_bits": int(m[3])} if m[3] else {})},
               "nearN[bB] or near/S[bB] (KIVI near tier: N tokens, or 1/S of the frozen ones, at B bits)"),
    "window": (re.compile(r"(?:sink(\d+)/)?window(\d+)" + _ROPE),
                  lambda m: {"window": int(m[2]), "sink": int(m[1] or 0), **_rope(m)},
                  "sinkN/windowM[:absolute|:shifted] or windowM (StreamingLLM)"),
    "hot_budget": (re.compile(r"(?:sink(\d+)/)?hot(\d+)" + _ROPE),
                   lambda m: {"hot_budget": int(m[2]), **({"sink": int(m[1])} if m[1] else {}), **_rope(m)},
                   "[sinkN/]hotM[:absolute|:shifted] (retrieval)"),
}
#: (a spec part's pattern, the `from_flags` keywords it sets, its help), tried in order by
#: `spec_flags`: every knob's own part (knobs.KNOBS) and the composite parts above.
SPEC_PARTS = tuple(part for knob in KNOBS
                   for part in ((_knob_part(knob),) if knob.spec else ()) + ((_COMPOSITE[knob.keyword],)
                                                                              if knob.keyword in _COMPOSITE else ()))
#: What an unknown part's error says is accepted, in brief: a few parts and their joining (a command's
#: --help lists them all, `SPEC_HELP`).
SPEC_BRIEF = "parts such as int8, int4, k8v4, sink4/window256, sink4/hot1024, joined by '+'"
SPEC_HELP = ("'+'-joined parts: " + ", ".join(help for _, _, help in SPEC_PARTS)
             + "; e.g. int4, int8+sink4/window256, k8v4, sink4/window256:absolute")
