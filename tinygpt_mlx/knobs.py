"""Every cache setting declared once: `KNOBS`, one `Knob` per command-line flag.

A knob names its `CacheConfig.from_flags` keyword, its flag, the part of the policy it belongs
to (the `--help` panel), its help text, its policy-spec part (if it has one) and the values it
takes. From this one table come the cache options of every command (cli/common.py), the error
translation from a config field to the flag the user typed (`CONFIG_FLAGS` there), the spec
grammar and its help (`policy_spec.SPEC_PARTS`, `SPEC_HELP`) and the per-field value checks
`CacheConfig` runs before its cross-field rules (`check_values`). A new setting is one more
`Knob`: its flag, spec part, help and check cannot drift apart.

Nothing here imports the package: `config.py` and `policy_spec.py` build on this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

STORAGE_DTYPES = ("fp32", "fp16", "bf16")
QUANT_BITS = {"int8": 8, "int4": 4, "int2": 2}
#: One side's KIVI precisions (`--kv-quantize-keys/-values`, spec kNvM): every code width MLX's
#: quantised kernels take (`quant.LEVELS`); `--kv-quantize` names the three above for both sides.
SIDE_BITS = {"int8": 8, "int6": 6, "int5": 5, "int4": 4, "int3": 3, "int2": 2}
KV_QUANTIZE_CHOICES = STORAGE_DTYPES + tuple(QUANT_BITS)
SIDE_CHOICES = "|".join(STORAGE_DTYPES + tuple(SIDE_BITS))
#: KIVI group sizes: the ones MLX's quantised kernels accept (`quant.py`).
GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
#: The error of a group size outside them (key blocks and value groups alike).
GROUP_MESSAGE = "must be one of {choices} (the KIVI group sizes MLX's quantised kernels take), got {value}"
#: "auto" is a choice, not a mode: `CacheConfig.for_run` makes it absolute for a run that fits the
#: model's trained context and leaves it shifted otherwise (`CacheConfig.rope_auto`)
ROPE_MODES = ("shifted", "absolute", "auto")
#: The RoPE mode of a StreamingLLM or retrieval policy that names none.
DEFAULT_ROPE_MODE = "shifted"
#: The command line's choice for retrieval where --streaming-llm-rope is not given.
RETRIEVAL_ROPE_CHOICE = "auto"
SUMMARY_KINDS = ("minmax", "mean", "hybrid")
COLD_STORES = ("ram", "disk")
RETRIEVED_POSITIONS = ("fixed", "page", "slots")
RETRIEVE_UNITS = ("tokens", "spans")
SPAN_SCORES = ("max", "mean")
#: The least tokens a retrieval step fetches (and pages kept), by default (`config.fetch_budget`).
FETCH_FLOOR = 64
#: int4's near tier unless told otherwise: the newest 1/8 of the frozen tokens at 8 bits
#: (`CacheConfig.default_near_share`; +6.4% to +9.5% of an int4 cache's bytes, docs/kivi.md).
INT4_NEAR_SHARE = 8
#: int8's exact residual on a long context (`CacheConfig.grown_residual`): R grows to 64 once
#: the cache holds LONG_RESIDUAL_SHARE x 64 tokens, so at most 1/16 of it is exact (+7.4% of int8's
#: bytes at 1K tokens, +1.0% at 8K, none below 1K; docs/kivi.md).
INT8_LONG_RESIDUAL, LONG_RESIDUAL_SHARE = 64, 16

#: The parts of a policy, as `--help` groups their flags.
PANELS = {"precision": "KV precision (KIVI)", "streaming": "StreamingLLM", "retrieval": "Retrieval (KIV)"}


@dataclass(frozen=True)
class Knob:
    """One cache setting. `keyword`: its `CacheConfig.from_flags` keyword (a field, or one of
    the `kv_quantize*` precision names). `flag`: its long flag ("--on/--off" for a switch).
    `kind`: the value's type. `part`: its key in `PANELS`. `help`: the flag's help, where
    `{default}` stands for `CacheConfig`'s default (on/off for a switch) and `{fetch_floor}`,
    `{rope}`, `{precisions}` for the constants of those names. `spec`: the regex of its part
    of a policy spec, whose group 1 is the value (a switch's: "no" or nothing), "" if it has
    none; `spec_help`: that part as `SPEC_HELP` lists it. `choices` / `minimum`: the values it
    takes (`check_values`; `message` replaces the generic "must be one of ..."). `levels`: a
    precision knob's KIVI names and their bits (`config.precision_fields`)."""
    keyword: str
    flag: str
    kind: type
    part: str
    help: str
    spec: str = ""
    spec_help: str = ""
    choices: tuple = ()
    minimum: Optional[int] = None
    message: str = ""
    levels: Optional[dict] = None

    @property
    def switch(self) -> bool:
        return self.kind is bool

    def spec_value(self, group: Optional[str]) -> Any:
        """The value a matched spec part gives this knob (`group`: the regex's group 1)."""
        if self.switch:
            return not group
        return int(group) if self.kind is int else group


KNOBS: tuple[Knob, ...] = (
    # ---- precision (KIVI) ----
    Knob("kv_quantize", "--kv-quantize", str, "precision",
       "KV precision: {precisions} (int* = KIVI: keys per channel, values per token; int4 holds its newest "
       "1/" + str(INT4_NEAR_SHARE) + " frozen tokens at 8 bits, see --kv-near-share). Default {default}.",
       "(" + "|".join(KV_QUANTIZE_CHOICES) + ")", "precision " + "|".join(KV_QUANTIZE_CHOICES), levels=QUANT_BITS),
    Knob("kv_quantize_keys", "--kv-quantize-keys", str, "precision",
       "Key precision, overriding --kv-quantize: " + SIDE_CHOICES + " (e.g. int5 with int4 values: keys carry "
       "most of int4's error, docs/kivi.md).", levels=SIDE_BITS),
    Knob("kv_quantize_values", "--kv-quantize-values", str, "precision",
       "Value precision, overriding --kv-quantize: " + SIDE_CHOICES + " (e.g. int4).", levels=SIDE_BITS),
    Knob("group_size", "--kv-group-size", int, "precision",
       "KIVI group size G (tokens per key block; channels per value group unless --kv-value-group). Default "
       "{default}.", r"g(\d+)", "gN (group)",
       choices=GROUP_SIZES, minimum=1, message=GROUP_MESSAGE),
    Knob("value_group", "--kv-value-group", int, "precision",
       "KIVI channels per value group (one fp16 scale and zero each), where not G: 64 halves the values' "
       "scales and zeros (int2 values cost 2.5 bits instead of 3, int4 values 4.5 instead of 5); it must "
       "divide the head dimension. With int4, --kv-value-group 64 --kv-near-share 3 --kv-near-bits 6 costs "
       "what --kv-near-share 8 does, for a lower KL on SmolLM2's long prompts (docs/kivi.md). Default: G.",
       r"vg(\d+)", "vgN (value group)", choices=GROUP_SIZES, minimum=1, message=GROUP_MESSAGE),
    Knob("residual", "--kv-residual", int, "precision",
       "KIVI residual R: newest tokens kept exact (a multiple of G). Default {default}. Each exact token costs "
       "the storage dtype's bytes in place of packed ones: int8 with R 64 holds 1.07x int8's bytes at 1K "
       "tokens, 1.01x at 8K, and kept the greedy text of the long prompts int8 loses on SmolLM2 "
       "(docs/kivi.md).", r"r(\d+)", "rN (residual)", minimum=0),
    Knob("long_residual", "--kv-long-residual", int, "precision",
       "KIVI: the residual grows from --kv-residual to N exact tokens (a multiple of G, above R) once the cache "
       "has stored " + str(LONG_RESIDUAL_SHARE) + " x N tokens, its sink counted (a window or hot budget must hold "
       "that many), so at most 1/" + str(LONG_RESIDUAL_SHARE) + " of a long context is exact. Default: "
       + str(INT8_LONG_RESIDUAL) + " under int8 (rounded up to G; +7.4% of its bytes at 1K tokens, +1.0% at 8K, "
       "none below 1K; it kept the greedy text of all 36 long prompts on SmolLM2, where R 32 lost 2), off "
       "otherwise; 0 turns it off.", r"lr(\d+)", "lrN (KIVI residual on long contexts)",
       minimum=0),
    Knob("exact_topk", "--kv-exact-topk", int, "precision",
       "KIVI: per query head, re-score and re-value the K packed tokens with the highest scores from an exact "
       "shadow copy (sharp heads then see exact K/V; 0 = off). Default {default}.",
       r"top(\d+)", "topN (KIVI exact top-k)", minimum=0),
    Knob("shadow_store", "--kv-shadow", str, "precision",
       "KIVI --kv-exact-topk: keep the exact shadow copy on disk (memory-mapped, RAM holds only the packed "
       "cache; each refined layer waits for its top-k indices on the host) or in ram (the fp32 cache's size "
       "in memory, gathered on the device: no wait). Default {default}.", r"shadow(ram|disk)", "shadowram|shadowdisk", choices=COLD_STORES),
    Knob("kivi_sink", "--kv-exact-sink", int, "precision",
       "KIVI without a StreamingLLM window or retrieval: keep the first N tokens exact (attention sinks). "
       "They count toward --kv-residual, so the cache holds the same bytes (the newest R - N tokens stay exact "
       "instead of R). Under StreamingLLM and retrieval the --streaming-llm-sink tokens are exact instead. "
       "Default {default}.", r"esink(\d+)", "esinkN (KIVI: first N exact)", minimum=0),
    Knob("rotate", "--kv-rotate/--no-kv-rotate", bool, "precision",
       "KIVI: quantise keys and values in a randomized Hadamard basis of the head dimension (queries are "
       "turned alike and the output turned back: no extra bytes, two small matmuls per layer and step). "
       "Default {default}.", r"(no)?rot", "rot|norot (KIVI rotation)"),
    Knob("near", "--kv-near", int, "precision",
       "KIVI near tier: hold the newest N frozen tokens (a multiple of G) at --kv-near-bits and pack them "
       "again at the body's bits as they age (attention reads recent tokens most). Costs N x (near bits - "
       "body bits) more bits per channel per layer, e.g. +2.4% of an int4 cache at 8K tokens (+9.2% at 2K) "
       "for N = 256 (see docs/kivi.md). Default {default} (off).", minimum=0),
    Knob("near_share", "--kv-near-share", int, "precision",
       "KIVI near tier sized to the context, instead of --kv-near: hold the newest 1/S of the frozen tokens "
       "(whole groups of G) at --kv-near-bits. An int4 tier token costs 80% more bytes than a body token (an "
       "int2 one at 4 bits, 67%), so S = 8 keeps an int4 cache within +10% of its bytes at every length (see "
       "docs/kivi.md). Default: " + str(INT4_NEAR_SHARE) + " under int4 (+6.4% of its bytes at 1K tokens to "
       "+9.5% at 8K, none below 288 tokens; greedy text of fp32 kept 0.505 -> 0.723 of the way on SmolLM2's "
       "long prompts), off otherwise; 0 turns it off.", minimum=0),
    Knob("near_bits", "--kv-near-bits", int, "precision",
       "KIVI near tier's bits, 8, 6 or 4 (above the body's). A 6-bit tier holds twice an 8-bit one's tokens "
       "above an int4 body for the same bytes (--kv-near-share 4 --kv-near-bits 6 costs what --kv-near-share "
       "8 does; see docs/kivi.md). Default {default}.", choices=(8, 6, 4), message="must be 8, 6 or 4, got {value!r}"),
    # ---- StreamingLLM ----
    Knob("sink", "--streaming-llm-sink", int, "streaming",
       "StreamingLLM: keep the first N tokens as attention sinks (needs a window, or --kiv-hot-budget for "
       "retrieval).", minimum=0),
    Knob("window", "--streaming-llm-window", int, "streaming",
       "StreamingLLM: attend to the sink and the last M tokens; the cache stops growing at N + M. With KIVI "
       "(--kv-quantize int*) only whole frozen groups of G are evicted, never the exact residual R, so up to "
       "max(M, R) + G - 1 tokens stay stored after the sink (those older than M are masked out). Keep N + M "
       "within the model's context (sample warns otherwise).", minimum=1),
    Knob("rope_mode", "--streaming-llm-rope", str, "streaming",
       "StreamingLLM and retrieval positions: shifted (cache slots, the paper), absolute (original positions, "
       "like mlx-lm's RotatingKVCache) or auto (absolute where the whole run, prompt + --tokens, fits the "
       "model's trained context, shifted past it or where the run's length is not known: chat, serve, "
       "cache-prompt). Default {rope} for a StreamingLLM window, {retrieval_rope} for retrieval (sample, "
       "needle, perplexity; docs/retrieval.md \"Position rule\").", choices=ROPE_MODES),
    # ---- retrieval ----
    Knob("hot_budget", "--kiv-hot-budget", int, "retrieval",
       "Retrieval: exact hot window; older tokens go to a cold store and are fetched back.", minimum=1),
    Knob("retrieve_tokens", "--kiv-top-p", int, "retrieval",
       "Retrieval: cold tokens fetched per step. Default a quarter of --kiv-hot-budget, at least "
       "{fetch_floor} (64 up to a 256-token window, 256 for 1024).", r"fetch(\d+)", "fetchN (cold tokens fetched)",
       minimum=1),
    Knob("page_size", "--kiv-page-size", int, "retrieval",
       "Retrieval: tokens per cold page. Default {default}.", minimum=1),
    Knob("top_pages", "--kiv-top-pages", int, "retrieval",
       "Retrieval: pages the coarse pass keeps per step, whose tokens are scored exactly. Default as many as "
       "--kiv-top-p, at least {fetch_floor}.", r"pages(\d+)", "pagesN (top pages)", minimum=1),
    Knob("summary", "--kiv-summary", str, "retrieval",
       "Retrieval: page summary, minmax (Quest's per-channel key bounds), mean (KIV) or hybrid (a page kept by "
       "its better rank in either). Default {default}.", "(" + "|".join(SUMMARY_KINDS) + ")",
       "|".join(SUMMARY_KINDS) + " (page summary)", choices=SUMMARY_KINDS),
    Knob("cold_store", "--kiv-cold-store", str, "retrieval",
       "Retrieval: where the cold store lives. ram (the default): MLX arrays (unified memory on a Mac), its "
       "search inside the step's graph, nothing read back per token. On SmolLM2-135M (30 layers, 3 KV heads "
       "of 64) it holds 51.6 KiB per cold token at fp32 storage: 1.6 GiB at 32K tokens, 12.9 GiB at 256K, "
       "51.6 GiB at 1M (docs/retrieval.md); 0.56x that at bf16/fp16, 0.37x with --kiv-cold-bits 8, 0.26x with 4; "
       "--kiv-cold-ram bounds its RAM. disk: memory-mapped files (evicted tokens, page "
       "summaries and positions), so RAM stays bounded by the hot window, but its search runs on the host, "
       "reading the query back layer by layer (slow on a GPU). Default {default}.", r"cold(disk|ram)",
       "colddisk|coldram (retrieval's cold store on disk, or in RAM on the device, the default)", choices=COLD_STORES),
    Knob("cold_ram", "--kiv-cold-ram", int, "retrieval",
       "Retrieval, the ram store: MiB of RAM its cold rows may hold, over all layers; past it the oldest "
       "are spilled to memory-mapped files (under --kiv-cold-path), in bulk, a quarter of the budget at a "
       "time. A step that picks a spilled page reads it back from disk (one wait per layer, as the disk "
       "store's search does); the pages' summaries stay in RAM (1/8 of the rows' bytes with min/max), so "
       "every page is still searched. The same tokens are attended with or without it. Default: no limit.",
       r"spill(\d+)", "spillN (the ram store's rows past N MiB spilled to disk)", minimum=1),
    Knob("cold_path", "--kiv-cold-path", str, "retrieval",
       "Directory for disk stores: retrieval's cold store, KIVI's exact shadow (default: a temp dir)."),
    Knob("cold_bits", "--kiv-cold-bits", int, "retrieval",
       "Retrieval: quantise the cold store to 8 or 4 bits (default exact).", choices=(8, 4),
       message="must be 8 or 4, got {value!r}"),
    Knob("retrieved_position", "--kiv-positions", str, "retrieval",
       "Retrieval: RoPE slot of retrieved tokens, fixed (one slot before the hot window, InfLLM), page (token "
       "j of every fetched page at the j-th of --kiv-page-size slots: spans keep their inner distances) or "
       "slots (in order). Default {default}.", "(page)", "page (retrieved RoPE slots by page)",
       choices=RETRIEVED_POSITIONS),
    Knob("retrieve_unit", "--kiv-unit", str, "retrieval",
       "Retrieval: what each query fetches from the cold store, its --kiv-top-p best tokens (tokens) or its "
       "--kiv-top-p / --kiv-page-size best pages whole (spans, InfLLM's blocks). Default spans (tokens with "
       "--kiv-positions slots).", "(spans|tokens)", "spans|tokens (what retrieval fetches)", choices=RETRIEVE_UNITS),
    Knob("span_score", "--kiv-span-score", str, "retrieval",
       "Retrieval: how the fine pass ranks the pages it fetches whole (--kiv-unit spans): max (the page's best "
       "token by exact score) or mean (the query against the page's mean key: the mean of its tokens' exact "
       "scores). Default {default}.", r"span(max|mean)", "spanmax|spanmean (fine pass page score)",
       choices=SPAN_SCORES),
    Knob("index_block", "--kiv-index-block", int, "retrieval",
       "Retrieval: pages per block of the two-level page index used on long cold stores (0 = scan every page "
       "summary each step). Default {default}.", r"block(\d+)", "blockN (retrieval's page index block)", minimum=0),
    Knob("sticky", "--kiv-sticky/--no-kiv-sticky", bool, "retrieval",
       "Retrieval: each step's pool also holds the pages the previous step's query picked, so the page a copy "
       "is reading stays in reach of the next query. Default {default}.", r"(no)?sticky",
       "sticky|nosticky (the last pick's pages kept)"),
    Knob("index_expand", "--kiv-index-expand", int, "retrieval",
       "Retrieval: a decode step's two-level page index expands this many times --kiv-top-pages of its best "
       "blocks and ranks their pages (a prefill chunk's: --kiv-top-pages). Default {default}.", r"expand(\d+)",
       "expandN (index blocks expanded, x top pages)", minimum=1),
)

#: keyword -> its knob
BY_KEYWORD: dict[str, Knob] = {k.keyword: k for k in KNOBS}


def check_values(values: dict[str, Any], error: type) -> None:
    """The checks each knob declares on its own value (`choices`, `minimum`), for every field in
    `values` that is set (not None); `error(field, problem)` is raised for the first bad one.
    Rules across fields are `CacheConfig`'s."""
    for knob in KNOBS:
        value = values.get(knob.keyword)
        if value is None:
            continue
        if knob.minimum is not None and (not isinstance(value, int) or isinstance(value, bool)
                                         or value < knob.minimum):
            raise error(knob.keyword, f"must be an integer >= {knob.minimum}, got {value!r}")
        if knob.choices and value not in knob.choices:
            message = knob.message or "must be one of {choices}, got {value!r}"
            raise error(knob.keyword, message.format(choices=", ".join(map(str, knob.choices)), value=value))
