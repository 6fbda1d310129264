"""The one declaration of the cache settings (tinygpt_mlx/knobs.py): every flag, spec part and
value check comes from `KNOBS`, so each is tested here against the others."""

from __future__ import annotations

import dataclasses

import pytest
import typer
from typer.testing import CliRunner

from tinygpt_mlx.cli.common import CACHE_OPTIONS, CONFIG_FLAGS, with_cache_options
from tinygpt_mlx.cli.main import app as main_app
from tinygpt_mlx.config import RUN_CHOICES, CacheConfig, ConfigError
from tinygpt_mlx.knobs import BY_KEYWORD, KNOBS, PANELS
from tinygpt_mlx.policy_spec import SPEC_HELP, spec_flags

PRECISION = {"storage", "key_bits", "value_bits"}   # set through --kv-quantize*, not one knob each

# knob keyword -> (a policy that gives it a meaning, its spec part, its command-line flags):
# the spec part and the flags must name the same non-default config.
EXAMPLES = {
    "kv_quantize": ("", "int4", ["--kv-quantize", "int4"]),
    "group_size": ("int4+r128", "g64", ["--kv-group-size", "64"]),
    "value_group": ("int4", "vg64", ["--kv-value-group", "64"]),
    "residual": ("int4", "r128", ["--kv-residual", "128"]),
    "long_residual": ("int4", "lr64", ["--kv-long-residual", "64"]),
    "exact_topk": ("int4", "top16", ["--kv-exact-topk", "16"]),
    "shadow_store": ("int4+top16", "shadowram", ["--kv-shadow", "ram"]),
    "kivi_sink": ("int4", "esink0", ["--kv-exact-sink", "0"]),
    "rotate": ("int4", "norot", ["--no-kv-rotate"]),
    "retrieve_tokens": ("hot256", "fetch96", ["--kiv-top-p", "96"]),
    "top_pages": ("hot256", "pages80", ["--kiv-top-pages", "80"]),
    "summary": ("hot256", "mean", ["--kiv-summary", "mean"]),
    "cold_store": ("hot256", "colddisk", ["--kiv-cold-store", "disk"]),
    "cold_ram": ("hot256", "spill512", ["--kiv-cold-ram", "512"]),
    "retrieved_position": ("hot256", "page", ["--kiv-positions", "page"]),
    "retrieve_unit": ("hot256", "tokens", ["--kiv-unit", "tokens"]),
    "span_score": ("hot256", "spanmean", ["--kiv-span-score", "mean"]),
    "index_block": ("hot256", "block4", ["--kiv-index-block", "4"]),
    "sticky": ("hot256", "nosticky", ["--no-kiv-sticky"]),
    "index_expand": ("hot256", "expand2", ["--kiv-index-expand", "2"]),
}
# the base policies above as flags
BASE_FLAGS = {"": [], "int4": ["--kv-quantize", "int4"], "int4+r128": ["--kv-quantize", "int4", "--kv-residual", "128"], "int4+top16": ["--kv-quantize", "int4", "--kv-exact-topk", "16"],
              "hot256": ["--kiv-hot-budget", "256"]}


def _config_from_flags(argv: list[str]) -> CacheConfig:
    """The CacheConfig a command with every cache flag builds from `argv` (the generated options)."""
    seen = []
    app = typer.Typer()

    @app.command()
    @with_cache_options
    def probe(cache_config: CacheConfig) -> None:
        seen.append(cache_config)

    @app.command()
    def other() -> None:   # two commands: typer then takes the command name
        pass

    r = CliRunner().invoke(app, ["probe", *argv])
    assert r.exit_code == 0, r.output
    return seen[0]


def test_every_config_field_is_one_knob_and_every_knob_a_keyword():
    fields = {f.name for f in dataclasses.fields(CacheConfig)}
    keywords = [k.keyword for k in KNOBS]
    assert len(keywords) == len(set(keywords))
    assert fields - PRECISION - set(RUN_CHOICES) == set(keywords) - {"kv_quantize", "kv_quantize_keys", "kv_quantize_values"}
    assert CacheConfig(hot_budget=64, rope_mode="auto").rope_auto   # a run's choice: set by a knob's value
    assert {kw for _, kw in CACHE_OPTIONS.values()} == set(keywords)
    for knob in KNOBS:
        assert CONFIG_FLAGS[knob.keyword] == knob.flag.split("/")[0]
        assert knob.part in PANELS


def test_the_examples_cover_every_spec_part():
    assert {k.keyword for k in KNOBS if k.spec} == set(EXAMPLES)


@pytest.mark.parametrize("keyword", sorted(EXAMPLES))
def test_a_knobs_spec_part_and_its_flag_name_the_same_config(keyword):
    base, part, flags = EXAMPLES[keyword]
    assert part in SPEC_HELP or BY_KEYWORD[keyword].spec_help in SPEC_HELP
    parsed = spec_flags(part)
    assert list(parsed) == [keyword]
    from_spec = CacheConfig.from_spec(f"{base}+{part}" if base else part)
    assert from_spec != CacheConfig.from_spec(base), "the example must move the config off its default"
    assert _config_from_flags(BASE_FLAGS[base] + flags) == from_spec


def test_composite_spec_parts_match_their_flags():
    cases = [("k8v4", ["--kv-quantize-keys", "int8", "--kv-quantize-values", "int4"]),
             ("int4+near256b6", ["--kv-quantize", "int4", "--kv-near", "256", "--kv-near-bits", "6"]),
             ("int2+near/8b4", ["--kv-quantize", "int2", "--kv-near-share", "8", "--kv-near-bits", "4"]),
             ("sink4/window64:absolute", ["--streaming-llm-sink", "4", "--streaming-llm-window", "64",
                                          "--streaming-llm-rope", "absolute"]),
             ("sink4/hot128", ["--streaming-llm-sink", "4", "--kiv-hot-budget", "128"])]
    for spec, argv in cases:
        assert _config_from_flags(argv) == CacheConfig.from_spec(spec), spec


def _bad_values(knob):
    if knob.choices:
        yield ("nonesuch" if knob.kind is str else 3)
    if knob.minimum is not None:
        yield knob.minimum - 1


@pytest.mark.parametrize("knob", [k for k in KNOBS if k.choices or k.minimum is not None], ids=lambda k: k.keyword)
def test_a_knobs_own_check_names_it(knob):
    for bad in _bad_values(knob):
        with pytest.raises(ConfigError) as e:
            CacheConfig(**{knob.keyword: bad})
        assert e.value.field == knob.keyword
        assert repr(bad) in str(e.value) or str(bad) in str(e.value)


def test_help_lists_each_part_of_the_policy_under_its_heading():
    r = CliRunner().invoke(main_app, ["sample", "--help"])
    assert r.exit_code == 0, r.output
    headings = [line[:-1] for line in r.output.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings[-3:] == [PANELS["precision"], PANELS["streaming"], PANELS["retrieval"]]
    text = r.output
    for knob in KNOBS:
        section = text[text.index(PANELS[knob.part] + ":"):]
        assert knob.flag.split("/")[0] in section, knob.flag
    assert "--kv-quantize" not in text[:text.index(PANELS["precision"] + ":")].split("Options:")[1]


def test_each_precision_knob_sets_the_bits_of_its_levels():
    """`precision_fields` reads a precision knob's own `levels`: each name gives its bits to the
    sides the knob sets, and a name of another knob's table only is refused on this one."""
    side = {"kv_quantize": ("key_bits", "value_bits"), "kv_quantize_keys": ("key_bits",),
            "kv_quantize_values": ("value_bits",)}
    assert {k.keyword for k in KNOBS if k.levels} == set(side)
    for knob in KNOBS:
        for name, bits in (knob.levels or {}).items():
            config = CacheConfig.from_flags(**{knob.keyword: name})
            assert all(getattr(config, f) == bits for f in side[knob.keyword]), (knob.keyword, name)
    with pytest.raises(ValueError, match="kv_quantize must be one of .*got 'int5'"):
        CacheConfig.from_flags(kv_quantize="int5")
