"""Config rules live in the dataclasses (issue #14): every rule that depends only on a
`CacheConfig`'s fields raises `ConfigError` from `__post_init__`, whoever builds it (Python, the
CLI, the server, a policy spec); `CacheConfig.from_spec` is the one policy spec parser and gives
every spec the docs use the same label and settings as before it was the one; `ServerConfig`
errors carry their field too."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tinygpt_mlx.config import DEFAULT_ROPE_MODE, GROUP_SIZES, CacheConfig, ConfigError
from tinygpt_mlx.evaluate import bench, modes, needle
from tinygpt_mlx.server.config import ServerConfig, listen_address

ROOT = Path(__file__).resolve().parent.parent

# ----- every cross-field rule raises from the dataclass itself ------------------------------------
# (fields, the field at fault, a piece of the message)
RULES = [
    (dict(rope_mode="absolute"), "rope_mode", "needs window"),
    (dict(rope_mode="shifted"), "rope_mode", "needs window"),
    (dict(key_bits=4, value_bits=4, rope_mode="absolute"), "rope_mode", "needs window"),
    (dict(window=8, rope_mode="sideways"), "rope_mode", "must be one of shifted, absolute"),
    (dict(key_bits=4, value_bits=4, hot_budget=64, exact_topk=8), "rope_mode", "retrieval's default: set it to absolute"),
    (dict(key_bits=8, hot_budget=64, rope_mode="shifted", exact_topk=8), "rope_mode", "must be absolute for KIVI's"),
    (dict(value_bits=2, hot_budget=64, sink=4, exact_topk=4), "rope_mode", "must be absolute for KIVI's"),
    (dict(key_bits=4, value_bits=4, group_size=16, residual=16), "group_size", "must be one of 32, 64, 128"),
    (dict(key_bits=4, value_bits=4, group_size=48, residual=48), "group_size", "got 48"),
    (dict(group_size=256, residual=256), "group_size", "must be one of 32, 64, 128"),
    (dict(key_bits=4, value_bits=4, residual=48), "residual", "multiple of group_size"),
    (dict(exact_topk=16), "exact_topk", "refines a KIVI cache"),
    (dict(key_bits=4, value_bits=4, shadow_store="ram"), "shadow_store", "only applies with exact_topk"),
    (dict(sink=4), "sink", "needs window"),
    (dict(hot_budget=8, window=8), "hot_budget", "cannot be combined with window"),
    (dict(rope_mode="auto"), "rope_mode", "needs window"),
    (dict(rope_auto=True), "rope_auto", "it needs one"),
    (dict(hot_budget=8, rope_mode="absolute", rope_auto=True), "rope_auto", "'absolute' is already chosen"),
    (dict(key_bits=4, value_bits=4, hot_budget=64, exact_topk=8, rope_mode="auto"), "rope_mode",
     "must be absolute for KIVI's"),
]


@pytest.mark.parametrize("fields, field, message", RULES, ids=lambda x: x if isinstance(x, str) else None)
def test_cross_field_rules_raise_from_the_dataclass(fields, field, message):
    with pytest.raises(ConfigError) as e:
        CacheConfig(**fields)
    assert e.value.field == field, e.value
    assert message in str(e.value), e.value


def test_absolute_rope_without_a_window_is_refused_from_python():
    with pytest.raises(ConfigError) as e:
        CacheConfig(rope_mode="absolute")
    assert e.value.field == "rope_mode" and set(e.value.related) == {"window", "hot_budget"}


# the neighbours of the rules above are accepted
@pytest.mark.parametrize("fields", [
    dict(window=8, rope_mode="absolute"), dict(hot_budget=8, rope_mode="absolute"),
    dict(key_bits=4, value_bits=4, hot_budget=64, rope_mode="absolute"),
    dict(key_bits=4, value_bits=4, window=64),          # KIVI + shifted StreamingLLM is supported
    *(dict(key_bits=4, value_bits=4, group_size=g, residual=g) for g in GROUP_SIZES),
    dict(sink=4, hot_budget=8),
], ids=repr)
def test_valid_neighbours_are_accepted(fields):
    CacheConfig(**fields)


def test_rope_mode_is_none_without_eviction_and_shifted_by_default_with_it():
    assert DEFAULT_ROPE_MODE == "shifted" and CacheConfig().rope_mode is None
    assert CacheConfig(window=8).rope_mode == "shifted" == CacheConfig(hot_budget=8).rope_mode
    assert CacheConfig(window=8) == CacheConfig(window=8, rope_mode="shifted")
    assert CacheConfig(window=8, rope_mode="absolute").rope_mode == "absolute"
    # a config changed field by field is validated again
    with pytest.raises(ConfigError, match="rope_mode needs"):
        dataclasses.replace(CacheConfig(window=8, rope_mode="absolute"), window=None)


def test_auto_positions_are_the_run_s_choice():
    """rope_mode "auto": shifted until `for_run` sees a run that fits the trained context, then
    absolute (and no longer a choice); past it, or with no context known, unchanged. Not policy:
    equal to the shifted config."""
    for fields in (dict(hot_budget=8), dict(window=8, sink=4)):
        auto = CacheConfig(rope_mode="auto", **fields)
        assert auto.rope_mode == "shifted" and auto.rope_auto and auto == CacheConfig(**fields)
        inside = auto.for_run(256, 256)
        assert inside.rope_mode == "absolute" and not inside.rope_auto
        assert inside == CacheConfig(rope_mode="absolute", **fields)
        assert auto.for_run(256, 257) is auto and auto.for_run(None, 5) is auto
        named = CacheConfig(rope_mode="shifted", **fields)
        assert named.for_run(256, 10) is named and not named.rope_auto


def test_from_flags_uses_the_precision_table():
    c = CacheConfig.from_flags(kv_quantize="int4", kv_quantize_values="fp16")
    assert (c.key_bits, c.value_bits, c.storage) == (4, None, "fp32")
    c = CacheConfig.from_flags(kv_quantize="bf16", kv_quantize_keys="int8")
    assert (c.key_bits, c.value_bits, c.storage) == (8, None, "bf16")
    for keyword in ("kv_quantize", "kv_quantize_keys", "kv_quantize_values"):
        with pytest.raises(ConfigError) as e:
            CacheConfig.from_flags(**{keyword: "int7"})
        assert e.value.field == keyword
    # one side takes every width MLX's kernels take; --kv-quantize names int8/int4/int2 only
    c = CacheConfig.from_flags(kv_quantize="int4", kv_quantize_keys="int5", kv_quantize_values="int3")
    assert (c.key_bits, c.value_bits) == (5, 3)
    assert (CacheConfig.from_spec("k5v4").key_bits, CacheConfig.from_spec("k5v4").value_bits) == (5, 4)
    with pytest.raises(ConfigError, match="int5") as e:
        CacheConfig.from_flags(kv_quantize="int5")
    assert e.value.field == "kv_quantize"
    with pytest.raises(ConfigError, match="key_bits must be one of 8, 6, 5, 4, 3, 2, got 7"):
        CacheConfig(key_bits=7)


# ----- the one spec parser ---------------------------------------------------------------------------
# label() and describe() of every spec in docs/ (and the examples of the spec help and tests),
# recorded from the code before `from_spec` was the one parser (commit 121c9e2); a full int8
# cache's entries name its long residual since it became int8's default (2026-12-04).
SPEC_LABELS = {
    'fp16+k4v4+lr64': ('int4, fp16 exact, R 64 from 1024 tokens',
        '{"storage":"fp16","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"long_residual":64,"rotate":true,"near_share":8,"near_bits":8,"exact_sink":4}}'),
    'k6v6': ('int6',
        '{"storage":"fp32","kivi":{"key_bits":6,"value_bits":6,"group_size":32,"residual":32,"rotate":true,"exact_sink":4}}'),
    'int8+lr0': ('int8, no long residual',
        '{"storage":"fp32","kivi":{"key_bits":8,"value_bits":8,"group_size":32,"residual":32,"rotate":true,"exact_sink":4}}'),
    'int4+lr64': ('int4, R 64 from 1024 tokens',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"long_residual":64,"rotate":true,"near_share":8,"near_bits":8,"exact_sink":4}}'),
    'int4+near/0': ('int4, no near tier',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"exact_sink":4}}'),
    'int4+norot+esink0+near/0': ('int4, unrotated, no near tier, no exact sink',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":false,"exact_sink":0}}'),
    'int4+near/4b6': ('int4, newest 1/4 frozen at int6',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":4,"near_bits":6,"exact_sink":4}}'),
    'int4+near/2b6': ('int4, newest 1/2 frozen at int6',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":2,"near_bits":6,"exact_sink":4}}'),
    'int8+r64': ('int8, R 64',
        '{"storage":"fp32","kivi":{"key_bits":8,"value_bits":8,"group_size":32,"residual":64,"rotate":true,"exact_sink":4}}'),
    'int8+r96': ('int8, R 96',
        '{"storage":"fp32","kivi":{"key_bits":8,"value_bits":8,"group_size":32,"residual":96,"rotate":true,"exact_sink":4}}'),
    'int8+r128': ('int8, R 128',
        '{"storage":"fp32","kivi":{"key_bits":8,"value_bits":8,"group_size":32,"residual":128,"rotate":true,"exact_sink":4}}'),
    'sink4/hot1024': ('fp32 + retrieval hot 1024 + top 32 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":256,"page_size":8,"top_pages":256,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'int4+near/8': ('int4',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":8,"exact_sink":4}}'),
    'int2+near/8b4': ('int2, newest 1/8 frozen at int4',
        '{"storage":"fp32","kivi":{"key_bits":2,"value_bits":2,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":4,"exact_sink":4}}'),
    'int4+near512': ('int4, newest 512 frozen at int8',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near":512,"near_bits":8,"exact_sink":4}}'),
    'int4+near256': ('int4, newest 256 frozen at int8',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near":256,"near_bits":8,"exact_sink":4}}'),
    'int4+r256': ('int4, R 256',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":256,"rotate":true,"near_share":8,"near_bits":8,"exact_sink":4}}'),
    'fp32': ('fp32',
        '{"storage":"fp32"}'),
    'sink4/hot252': ('fp32 + retrieval hot 252 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":252,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'int8+sink4/window252': ('int8 + StreamingLLM sink 4 + window 252 (shifted RoPE)',
        '{"storage":"fp32","kivi":{"key_bits":8,"value_bits":8,"group_size":32,"residual":32,"rotate":true},"streaming_llm":{"sink":4,"window":252,"rope_mode":"shifted"}}'),
    'int4+sink4/window252': ('int4 + StreamingLLM sink 4 + window 252 (shifted RoPE)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":8},"streaming_llm":{"sink":4,"window":252,"rope_mode":"shifted"}}'),
    'full': ('fp32',
        '{"storage":"fp32"}'),
    'fp16': ('fp16',
        '{"storage":"fp16"}'),
    'bf16': ('bf16',
        '{"storage":"bf16"}'),
    'int8': ('int8',
        '{"storage":"fp32","kivi":{"key_bits":8,"value_bits":8,"group_size":32,"residual":32,"long_residual":64,"rotate":true,"exact_sink":4}}'),
    'int4': ('int4',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":8,"exact_sink":4}}'),
    'int2+norot+esink0': ('int2, unrotated, no exact sink',
        '{"storage":"fp32","kivi":{"key_bits":2,"value_bits":2,"group_size":32,"residual":32,"rotate":false,"exact_sink":0}}'),
    'int4+norot+esink0': ('int4, unrotated, no exact sink',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":false,"near_share":8,"near_bits":8,"exact_sink":0}}'),
    'int2': ('int2',
        '{"storage":"fp32","kivi":{"key_bits":2,"value_bits":2,"group_size":32,"residual":32,"rotate":true,"exact_sink":4}}'),
    'int2+k3v2+vg64': ('K int3 / V int2, V groups 64',
        '{"storage":"fp32","kivi":{"key_bits":3,"value_bits":2,"group_size":32,"residual":32,"value_group":64,"rotate":true,"exact_sink":4}}'),
    'k5v4+vg64': ('K int5 / V int4, V groups 64',
        '{"storage":"fp32","kivi":{"key_bits":5,"value_bits":4,"group_size":32,"residual":32,"value_group":64,"rotate":true,"exact_sink":4}}'),
    'int4+vg64+near/8': ('int4, V groups 64',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"value_group":64,"rotate":true,"near_share":8,"near_bits":8,"exact_sink":4}}'),
    'k5v4+vg64+near/16': ('K int5 / V int4, V groups 64, newest 1/16 frozen at int8',
        '{"storage":"fp32","kivi":{"key_bits":5,"value_bits":4,"group_size":32,"residual":32,"value_group":64,"rotate":true,"near_share":16,"near_bits":8,"exact_sink":4}}'),
    'int4+vg64+near/6': ('int4, V groups 64, newest 1/6 frozen at int8',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"value_group":64,"rotate":true,"near_share":6,"near_bits":8,"exact_sink":4}}'),
    'int4+vg64+near/4b6': ('int4, V groups 64, newest 1/4 frozen at int6',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"value_group":64,"rotate":true,"near_share":4,"near_bits":6,"exact_sink":4}}'),
    'int4+vg64+near/3b6': ('int4, V groups 64, newest 1/3 frozen at int6',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"value_group":64,"rotate":true,"near_share":3,"near_bits":6,"exact_sink":4}}'),
    'k3v2': ('K int3 / V int2',
        '{"storage":"fp32","kivi":{"key_bits":3,"value_bits":2,"group_size":32,"residual":32,"rotate":true,"exact_sink":4}}'),
    'k5v4': ('K int5 / V int4',
        '{"storage":"fp32","kivi":{"key_bits":5,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"exact_sink":4}}'),
    'k4v8': ('K int4 / V int8',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":8,"group_size":32,"residual":32,"rotate":true,"exact_sink":4}}'),
    'k8v4': ('K int8 / V int4',
        '{"storage":"fp32","kivi":{"key_bits":8,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"exact_sink":4}}'),
    'int2+g64+r0': ('int2, G 64, R 0',
        '{"storage":"fp32","kivi":{"key_bits":2,"value_bits":2,"group_size":64,"residual":0,"rotate":true,"exact_sink":4}}'),
    'int2+g64+r64': ('int2, G 64, R 64',
        '{"storage":"fp32","kivi":{"key_bits":2,"value_bits":2,"group_size":64,"residual":64,"rotate":true,"exact_sink":4}}'),
    'int2+top64': ('int2 (exact top-64)',
        '{"storage":"fp32","kivi":{"key_bits":2,"value_bits":2,"group_size":32,"residual":32,"rotate":true,"exact_sink":4,"exact_topk":64,"shadow_store":"disk"}}'),
    'int4+g32+r64': ('int4, R 64',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":64,"rotate":true,"near_share":8,"near_bits":8,"exact_sink":4}}'),
    'int4+g64+r0': ('int4, G 64, R 0',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":64,"residual":0,"rotate":true,"near_share":8,"near_bits":8,"exact_sink":4}}'),
    'int4+g64+r64': ('int4, G 64, R 64',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":64,"residual":64,"rotate":true,"near_share":8,"near_bits":8,"exact_sink":4}}'),
    'int4+r128': ('int4, R 128',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":128,"rotate":true,"near_share":8,"near_bits":8,"exact_sink":4}}'),
    'k8v4+r128': ('K int8 / V int4, R 128',
        '{"storage":"fp32","kivi":{"key_bits":8,"value_bits":4,"group_size":32,"residual":128,"rotate":true,"exact_sink":4}}'),
    'int4+sink4/window124': ('int4 + StreamingLLM sink 4 + window 124 (shifted RoPE)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":8},"streaming_llm":{"sink":4,"window":124,"rope_mode":"shifted"}}'),
    'int4+sink4/window28': ('int4 + StreamingLLM sink 4 + window 28 (shifted RoPE)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":8},"streaming_llm":{"sink":4,"window":28,"rope_mode":"shifted"}}'),
    'int4+sink4/window64': ('int4 + StreamingLLM sink 4 + window 64 (shifted RoPE)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":8},"streaming_llm":{"sink":4,"window":64,"rope_mode":"shifted"}}'),
    'int4+top128': ('int4 (exact top-128)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"exact_sink":4,"exact_topk":128,"shadow_store":"disk"}}'),
    'int4+top16': ('int4 (exact top-16)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"exact_sink":4,"exact_topk":16,"shadow_store":"disk"}}'),
    'int4+top32': ('int4 (exact top-32)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"exact_sink":4,"exact_topk":32,"shadow_store":"disk"}}'),
    'int4+top64': ('int4 (exact top-64)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"exact_sink":4,"exact_topk":64,"shadow_store":"disk"}}'),
    'int4+top64+shadowram': ('int4 (exact top-64, ram shadow)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"exact_sink":4,"exact_topk":64,"shadow_store":"ram"}}'),
    'k8v4+top32': ('K int8 / V int4 (exact top-32)',
        '{"storage":"fp32","kivi":{"key_bits":8,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"exact_sink":4,"exact_topk":32,"shadow_store":"disk"}}'),
    'sink1/window255': ('fp32 + StreamingLLM sink 1 + window 255 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":1,"window":255,"rope_mode":"shifted"}}'),
    'sink1/window255:absolute': ('fp32 + StreamingLLM sink 1 + window 255 (absolute RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":1,"window":255,"rope_mode":"absolute"}}'),
    'sink4/window124': ('fp32 + StreamingLLM sink 4 + window 124 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":124,"rope_mode":"shifted"}}'),
    'sink4/window124:absolute': ('fp32 + StreamingLLM sink 4 + window 124 (absolute RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":124,"rope_mode":"absolute"}}'),
    'sink4/window256': ('fp32 + StreamingLLM sink 4 + window 256 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":256,"rope_mode":"shifted"}}'),
    'sink4/window1020': ('fp32 + StreamingLLM sink 4 + window 1020 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":1020,"rope_mode":"shifted"}}'),
    'window1024': ('fp32 + StreamingLLM sink 0 + window 1024 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":0,"window":1024,"rope_mode":"shifted"}}'),
    'sink4/window1024': ('fp32 + StreamingLLM sink 4 + window 1024 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":1024,"rope_mode":"shifted"}}'),
    'int4+sink4/window1020': ('int4 + StreamingLLM sink 4 + window 1020 (shifted RoPE)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":8},"streaming_llm":{"sink":4,"window":1020,"rope_mode":"shifted"}}'),
    'sink4/window128': ('fp32 + StreamingLLM sink 4 + window 128 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":128,"rope_mode":"shifted"}}'),
    'sink4/window252': ('fp32 + StreamingLLM sink 4 + window 252 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":252,"rope_mode":"shifted"}}'),
    'sink4/window252:absolute': ('fp32 + StreamingLLM sink 4 + window 252 (absolute RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":252,"rope_mode":"absolute"}}'),
    'sink4/window28': ('fp32 + StreamingLLM sink 4 + window 28 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":28,"rope_mode":"shifted"}}'),
    'sink4/window64': ('fp32 + StreamingLLM sink 4 + window 64 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":64,"rope_mode":"shifted"}}'),
    'sink4/window64:absolute': ('fp32 + StreamingLLM sink 4 + window 64 (absolute RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":64,"rope_mode":"absolute"}}'),
    'window128': ('fp32 + StreamingLLM sink 0 + window 128 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":0,"window":128,"rope_mode":"shifted"}}'),
    'window256': ('fp32 + StreamingLLM sink 0 + window 256 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":0,"window":256,"rope_mode":"shifted"}}'),
    'window256:absolute': ('fp32 + StreamingLLM sink 0 + window 256 (absolute RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":0,"window":256,"rope_mode":"absolute"}}'),
    'window64': ('fp32 + StreamingLLM sink 0 + window 64 (shifted RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":0,"window":64,"rope_mode":"shifted"}}'),
    'int8+sink4/window256': ('int8 + StreamingLLM sink 4 + window 256 (shifted RoPE)',
        '{"storage":"fp32","kivi":{"key_bits":8,"value_bits":8,"group_size":32,"residual":32,"rotate":true},"streaming_llm":{"sink":4,"window":256,"rope_mode":"shifted"}}'),
    'int4+sink4/window256': ('int4 + StreamingLLM sink 4 + window 256 (shifted RoPE)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":8},"streaming_llm":{"sink":4,"window":256,"rope_mode":"shifted"}}'),
    'sink4/window256:absolute': ('fp32 + StreamingLLM sink 4 + window 256 (absolute RoPE)',
        '{"storage":"fp32","streaming_llm":{"sink":4,"window":256,"rope_mode":"absolute"}}'),
    'int4+top16+shadowdisk': ('int4 (exact top-16)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"exact_sink":4,"exact_topk":16,"shadow_store":"disk"}}'),
    'int4+top16+shadowram': ('int4 (exact top-16, ram shadow)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"exact_sink":4,"exact_topk":16,"shadow_store":"ram"}}'),
    'int2+top16+shadowram+sink4/window64:shifted': ('int2 (exact top-16, ram shadow) + StreamingLLM sink 4 + window 64 (shifted RoPE)',
        '{"storage":"fp32","kivi":{"key_bits":2,"value_bits":2,"group_size":32,"residual":32,"rotate":true,"exact_topk":16,"shadow_store":"ram"},"streaming_llm":{"sink":4,"window":64,"rope_mode":"shifted"}}'),
    'int4+sink4/window64:absolute': ('int4 + StreamingLLM sink 4 + window 64 (absolute RoPE)',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":8},"streaming_llm":{"sink":4,"window":64,"rope_mode":"absolute"}}'),
    'hot256': ('fp32 + retrieval hot 256 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":0,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot256': ('fp32 + retrieval hot 256 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot256+spans': ('fp32 + retrieval hot 256 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot256+tokens+block32': ('fp32 + retrieval hot 256 + top 64 tokens',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":32,"retrieve_unit":"tokens","sticky":true,"index_expand":4}}'),
    'sink4/hot256+spans+block32': ('fp32 + retrieval hot 256 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":32,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot256+hybrid+nosticky+expand1+pages128': ('fp32 + retrieval hot 256 + top 8 pages (hybrid summary)',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":128,"summary":"hybrid","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":false,"index_expand":1}}'),
    'sink4/hot256+hybrid+nosticky+expand1': ('fp32 + retrieval hot 256 + top 8 pages (hybrid summary)',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"hybrid","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":false,"index_expand":1}}'),
    'sink4/hot256+hybrid+sticky+expand1': ('fp32 + retrieval hot 256 + top 8 pages (hybrid summary)',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"hybrid","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":1}}'),
    'sink4/hot256+minmax+nosticky+expand1': ('fp32 + retrieval hot 256 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":false,"index_expand":1}}'),
    'sink4/hot256+minmax+sticky+block0': ('fp32 + retrieval hot 256 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":0,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot256+minmax+sticky+expand1': ('fp32 + retrieval hot 256 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":1}}'),
    'sink4/hot256+block0': ('fp32 + retrieval hot 256 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":0,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot256+spans+page+colddisk': ('fp32 + retrieval hot 256 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"disk","cold_bits":null,"rope_mode":"shifted","retrieved_position":"page","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot1024+colddisk': ('fp32 + retrieval hot 1024 + top 32 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":256,"page_size":8,"top_pages":256,"summary":"minmax","cold_store":"disk","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot256+coldram': ('fp32 + retrieval hot 256 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":256,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'fp16+k4v4': ('int4, fp16 exact',
        '{"storage":"fp16","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":8,"exact_sink":4}}'),
    'fp16+k4v4+near/4': ('int4, fp16 exact, newest 1/4 frozen at int8',
        '{"storage":"fp16","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":4,"near_bits":8,"exact_sink":4}}'),
    'fp16+k8v8': ('int8, fp16 exact',
        '{"storage":"fp16","kivi":{"key_bits":8,"value_bits":8,"group_size":32,"residual":32,"long_residual":64,"rotate":true,"exact_sink":4}}'),
    'fp16+k8v8+r64': ('int8, fp16 exact, R 64',
        '{"storage":"fp16","kivi":{"key_bits":8,"value_bits":8,"group_size":32,"residual":64,"rotate":true,"exact_sink":4}}'),
    'sink4/hot1024+mean+spanmean': ('fp32 + retrieval hot 1024 + top 32 pages (mean summary, pages by mean score)',
        '{"storage":"fp32","retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":256,"page_size":8,"top_pages":256,"summary":"mean","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4,"span_score":"mean"}}'),
    'sink4/hot1024+spanmean': ('fp32 + retrieval hot 1024 + top 32 pages (pages by mean score)',
        '{"storage":"fp32","retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":256,"page_size":8,"top_pages":256,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4,"span_score":"mean"}}'),
    'int4+sink4/hot1024': ('int4 + retrieval hot 1024 + top 32 pages',
        '{"storage":"fp32","kivi":{"key_bits":4,"value_bits":4,"group_size":32,"residual":32,"rotate":true,"near_share":8,"near_bits":8},"retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":256,"page_size":8,"top_pages":256,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot1024+spill32': ('fp32 + retrieval hot 1024 + top 32 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":256,"page_size":8,"top_pages":256,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4,"cold_ram_mib":32}}'),
    'sink4/hot1024+spill1': ('fp32 + retrieval hot 1024 + top 32 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":256,"page_size":8,"top_pages":256,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4,"cold_ram_mib":1}}'),
    'sink4/hot128': ('fp32 + retrieval hot 128 + top 8 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":128,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot128:absolute': ('fp32 + retrieval hot 128 + top 8 pages (original positions)',
        '{"storage":"fp32","retrieval":{"hot_budget":128,"sink":4,"retrieve_tokens":64,"page_size":8,"top_pages":64,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"absolute","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    # retrieval at original positions names them (needle_step_probe in docs/gguf.md)
    'sink4/hot1024:absolute': ('fp32 + retrieval hot 1024 + top 32 pages (original positions)',
        '{"storage":"fp32","retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":256,"page_size":8,"top_pages":256,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"absolute","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot1024:absolute+fetch512+pages512': ('fp32 + retrieval hot 1024 + top 64 pages (original positions)',
        '{"storage":"fp32","retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":512,"page_size":8,"top_pages":512,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"absolute","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot1024+fetch1024+pages1024': ('fp32 + retrieval hot 1024 + top 128 pages',
        '{"storage":"fp32","retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":1024,"page_size":8,"top_pages":1024,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot1024:absolute+fetch1024+pages1024': ('fp32 + retrieval hot 1024 + top 128 pages (original positions)',
        '{"storage":"fp32","retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":1024,"page_size":8,"top_pages":1024,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"absolute","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'sink4/hot2048:absolute': ('fp32 + retrieval hot 2048 + top 64 pages (original positions)',
        '{"storage":"fp32","retrieval":{"hot_budget":2048,"sink":4,"retrieve_tokens":512,"page_size":8,"top_pages":512,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"absolute","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
    'bf16+sink4/hot1024': ('bf16 + retrieval hot 1024 + top 32 pages',
        '{"storage":"bf16","retrieval":{"hot_budget":1024,"sink":4,"retrieve_tokens":256,"page_size":8,"top_pages":256,"summary":"minmax","cold_store":"ram","cold_bits":null,"rope_mode":"shifted","retrieved_position":"fixed","index_block":8,"retrieve_unit":"spans","sticky":true,"index_expand":4}}'),
}


@pytest.mark.parametrize("spec", sorted(SPEC_LABELS))
def test_specs_keep_their_labels(spec):
    import json

    label, described = SPEC_LABELS[spec]
    config = CacheConfig.from_spec(spec)
    assert config.label() == label
    assert json.dumps(config.describe(), separators=(",", ":")) == described


def _doc_specs() -> set[str]:
    specs = set()
    texts = [p.read_text() for p in (*ROOT.glob("docs/**/*.md"), ROOT / "README.md", *ROOT.glob("scripts/*.sh"),
                                     *ROOT.glob("benchmarks/*.sh"))]
    for text in texts:
        for m in re.finditer(r"--(?:modes|policies|baseline)[ =]+[\"']?([\w+/:,.@-]+)", text):
            # bench's SPEC@eager is SPEC run without the compiled step, needle_step_probe.py's
            # oracle:SPEC is SPEC with the needle's pages added to its pool: the same policy
            specs.update(s.removesuffix("@eager").removeprefix("oracle:") for s in m[1].split(",") if s)
    return specs


def test_every_spec_in_the_docs_parses():
    specs = _doc_specs()
    assert {"int4+top64+shadowram", "sink4/window252:absolute", "k8v4"} <= specs   # the grep works
    ours = {s for s in specs if not s.startswith("mlx") and s not in ("none", *needle.POLICIES)}
    for spec in ours:
        CacheConfig.from_spec(spec)
    assert ours <= set(SPEC_LABELS), ours - set(SPEC_LABELS)


def test_spec_parser_grammar():
    assert modes.parse_policy == CacheConfig.from_spec   # the same function, not a second parser
    assert CacheConfig.from_spec("FULL") == CacheConfig() == CacheConfig.from_spec("")
    assert CacheConfig.from_spec("int4+hot64:absolute") == CacheConfig(
        key_bits=4, value_bits=4, hot_budget=64, rope_mode="absolute")
    assert CacheConfig.from_spec("hot64") == CacheConfig(hot_budget=64, rope_mode="shifted")
    assert CacheConfig.from_spec("k2v8+g64+r128+top8+shadowram") == CacheConfig(
        key_bits=2, value_bits=8, group_size=64, residual=128, exact_topk=8, shadow_store="ram")
    for bad, words in [("int3", "unknown part 'int3'"), ("int4+int8", "'int8' sets kv_quantize twice"),
                       ("window8:absolute+hot8:shifted", "'hot8:shifted' sets rope_mode twice"),
                       ("int4+hot64+top8", "rope_mode must be absolute for KIVI's exact top-k"),
                       ("int4+g48+r48", "group_size must be one of"), ("sink4", "unknown part")]:
        with pytest.raises(ValueError, match=re.escape(f"policy {bad!r}: {words}")):
            CacheConfig.from_spec(bad)


def test_the_fetch_budget_follows_the_hot_window_unless_given():
    """A quarter of the hot window, at least 64 tokens (so every hot window up to 256, the
    shipped model's setting, keeps 64), the coarse pass keeping as many pages; a given
    `retrieve_tokens` or `top_pages` wins, and the spec's fetchN / pagesN set them."""
    for hot, fetched in [(16, 64), (64, 64), (256, 64), (300, 75), (1024, 256), (4096, 1024)]:
        c = CacheConfig(sink=4, hot_budget=hot)
        assert (c.retrieve_tokens, c.top_pages) == (fetched, fetched), hot
    assert (CacheConfig().retrieve_tokens, CacheConfig().top_pages) == (64, 64)
    c = CacheConfig(sink=4, hot_budget=1024, retrieve_tokens=32)
    assert (c.retrieve_tokens, c.top_pages) == (32, 64)
    assert CacheConfig(sink=4, hot_budget=1024, top_pages=16).retrieve_tokens == 256
    assert CacheConfig.from_spec("sink4/hot1024+fetch128+pages32") == CacheConfig(
        sink=4, hot_budget=1024, retrieve_tokens=128, top_pages=32)
    assert CacheConfig.from_spec("sink4/hot1024") == CacheConfig(sink=4, hot_budget=1024, retrieve_tokens=256,
                                                                  top_pages=256)
    with pytest.raises(ValueError, match="retrieve_tokens must be"):
        CacheConfig.from_spec("hot64+fetch0")


def test_needle_and_bench_build_on_the_parser():
    retrieval = CacheConfig(storage="bf16", sink=4, hot_budget=64)
    configs = needle.policy_configs(retrieval, ["full", "streaming", "retrieval"])
    assert configs == {"full": CacheConfig.from_spec("bf16"),
                       "streaming": CacheConfig.from_spec("bf16+sink4/window64"),
                       "retrieval": retrieval}
    assert configs["streaming"] == CacheConfig(storage="bf16", sink=4, window=64)
    # under --kv-quantize the grid's full cache and window are quantised as retrieval's hot window
    # is (they stayed exact before 2026-12-06, so an "int4" full column was the fp32 cache)
    quantised = CacheConfig.from_flags(kv_quantize="int4", sink=4, hot_budget=64)
    configs = needle.policy_configs(quantised, ["full", "streaming"])
    assert configs == {"full": CacheConfig.from_spec("int4"),
                       "streaming": CacheConfig.from_spec("int4+sink4/window64")}
    assert configs["full"].quantised and configs["streaming"].quantised
    policy = bench.make_policy("int4+sink4/window64:absolute", model=None)   # ours: no model needed
    assert policy.label == "int4 + StreamingLLM sink 4 + window 64 (absolute RoPE)"
    with pytest.raises(ValueError, match="policy 'int4\\+hot64\\+top8': rope_mode must be absolute"):
        bench.make_policy("int4+hot64+top8", model=None)


# ----- ServerConfig ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, field", [
    (dict(port=0), "port"), (dict(port=70000), "port"), (dict(port="80"), "port"),
    (dict(max_slots=0), "max_slots"), (dict(small_request=-1), "small_request"),
    (dict(prefill_chunk=0), "prefill_chunk"),
], ids=repr)
def test_server_config_errors_carry_the_field(fields, field):
    with pytest.raises(ConfigError) as e:
        ServerConfig(**fields)
    assert e.value.field == field and str(e.value).startswith(f"{field} must")


@pytest.mark.parametrize("value, address", [
    ("127.0.0.1:11500", ("127.0.0.1", 11500)), (":8080", ("0.0.0.0", 8080)), ("0.0.0.0", ("0.0.0.0", 11434)),
    ("", ("127.0.0.1", 11434)), (" localhost:9 ", ("localhost", 9)), ("http://example.org", ("example.org", 80)),
    ("https://example.org/api", ("example.org", 443)), ("http://h:7/", ("h", 7)), ("[::1]:9000", ("::1", 9000)),
    ("[::1]", ("::1", 11434)), ("::1", ("::1", 11434)),
], ids=repr)
def test_ollama_host_is_read_as_ollama_reads_it(value, address):
    assert listen_address(value) == address


@pytest.mark.parametrize("value, says", [("h:abc", "port 'abc'"), ("h:0", "port '0'"), ("h:70000", "port '70000'"),
                                         ("ftp://h", "scheme 'ftp'")], ids=repr)
def test_a_bad_ollama_host_names_the_value(value, says):
    with pytest.raises(ValueError, match=f"OLLAMA_HOST={re.escape(repr(value))}: .*{re.escape(says)}"):
        listen_address(value)


@pytest.mark.parametrize("fields", [
    {}, dict(sink=4, window=60), dict(key_bits=4, value_bits=4), dict(key_bits=4, value_bits=4, sink=4, window=60),
    dict(sink=4, hot_budget=32),
], ids=["fp32", "window", "int4", "int4+window", "retrieval"])
def test_the_policy_is_worked_out_once_not_per_decode_step(native32, monkeypatch, fields):
    """Issue 54: "a policy decided once at construction, not re-read per token". The config's
    derived facts (`streaming`, `retrieval`, `quantised`, `held_sink`...) are worked out on their
    first read and plain attributes after (`functools.cached_property`): over decode steps, with
    the cache warmed by a prompt that evicts, none of them is worked out again (a `@property`, or a
    config made anew per step, would run them per layer per step: this counts their calls)."""
    import functools

    import mlx.core as mx

    from tinygpt_mlx.cache.factory import make_cache
    from tinygpt_mlx.generate import forward

    calls: dict[str, int] = {}
    # every derived fact, a plain `@property` too (`_DERIVED` lists only the cached ones: a fact
    # turned back into a `@property` would drop out of it and go uncounted)
    derived = [n for n, v in vars(CacheConfig).items() if isinstance(v, (property, functools.cached_property))]
    assert len(derived) >= 15, derived
    for name in derived:
        prop = vars(CacheConfig)[name]
        assert isinstance(prop, functools.cached_property), f"{name} is worked out on every read"

        def counted(self, _f=prop.func, _n=name):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(self)
        monkeypatch.setattr(prop, "func", counted)
    model = native32.model
    cache = make_cache(model, CacheConfig(**fields))
    prompt = mx.array([[(7 * i) % 90 + 3 for i in range(200)]])
    mx.eval(forward(model, prompt, cache))
    for t in range(12):                 # warm: the first steps may trace, freeze, evict
        mx.eval(forward(model, mx.array([[5 + t]]), cache))
    assert calls, "the counter saw nothing at all: the derived facts were never read"
    calls.clear()
    for t in range(24):
        mx.eval(forward(model, mx.array([[20 + t]]), cache))
    assert calls == {}, f"derived policy facts worked out again during decode steps: {calls}"
