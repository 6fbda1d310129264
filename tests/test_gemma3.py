"""The real Gemma 3 270M (the pretrained model, Q4_K_M GGUF; Gemma terms of use) from its GGUF:
the config its metadata gives, greedy tokens equal to transformers' own GGUF loader's (recorded by
`python -m benchmarks.gemma3_hf_reference --json docs/results/gemma3_hf_greedy.json`, fp32 both),
through the API and through `posttrainllm sample`, and a chat template carried in its metadata.

The file is not fetched here (about 253 MB, four wheels): `python scripts/fetch_gemma3.py` puts it
in the cache (`$POSTTRAINLLM_CACHE`, default ~/.cache/posttrainllm); without it these tests skip,
and CI (`$CI` set) fetches it like any user, a failed fetch failing the run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import openblas
from tinygpt_mlx.errors import PosttrainError

pytestmark = pytest.mark.slow   # a real model: README's `-m "not slow"` skips these

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "results" / "gemma3_hf_greedy.json"
# Gemma 3's chat template as its instruction-tuned checkpoints ship it (string contents only)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


def test_this_module_under_openblas():
    """The tests below run in a pytest process of their own with OpenBLAS preloaded, as the
    command runs (tests/openblas.py): on the reference BLAS they took ~45 minutes of a loaded
    machine, under OpenBLAS ~6."""
    openblas.under_openblas("tests/test_gemma3.py")


@pytest.fixture(scope="session")
def gemma3_gguf():
    from tinygpt_mlx.realmodel import gemma3_path

    if openblas.elsewhere():
        pytest.skip("run under OpenBLAS by test_this_module_under_openblas")

    try:
        return gemma3_path(fetch=bool(os.environ.get("CI")))
    except PosttrainError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Gemma 3 270M not available here: {e}")


@pytest.fixture(scope="session")
def gemma3(gemma3_gguf):
    from tinygpt_mlx.loading import load

    with load(gemma3_gguf) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def reference():
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def gemma3_md(gemma3_gguf):
    """The file's tokenizer metadata, as ggml's reader gives it."""
    import gguf

    from tinygpt_mlx.ggml.tensors import _field_value

    reader = gguf.GGUFReader(str(gemma3_gguf))
    return {name: _field_value(f, gguf) for name, f in reader.fields.items()
            if name.startswith(("tokenizer.", "general.architecture"))}


def test_config_from_metadata(gemma3):
    info, c = gemma3.info, gemma3.info["config"]
    assert info["architecture"] == "gemma3" and info["model_type"] == "gemma3_text"
    assert gemma3.context_length == 32768
    assert (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"],
            c["head_dim"]) == (18, 4, 1, 640, 256)
    assert (c["sliding_window"], c["sliding_window_pattern"], c["query_pre_attn_scalar"]) == (512, 6, 256)
    assert (c["rope_theta"], c["rope_local_base_freq"]) == (1e6, 1e4)
    # no output.weight: the output is the token embeddings, counted once (mlx-lm ties it)
    assert c["tie_word_embeddings"] and "lm_head" not in gemma3.model
    assert info["parameters"] == 268_098_176
    assert {t: v["count"] for t, v in info["tensor_types"].items()} == \
        {"F32": 109, "Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}
    assert gemma3.tokenizer.encode("The capital of France is")[0] == 2   # BOS, as llama.cpp adds it


def test_greedy_equals_transformers(gemma3, reference):
    """Our greedy ids (full policy) equal transformers' for the short prompts and for one that
    passes the 512-token window (the sliding layers' rotating caches at work)."""
    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.evaluate.inputs import HELDOUT_KJV
    from tinygpt_mlx.generate import greedy_tokens

    rows = reference["prompts"]
    checked = 0
    for row in rows:
        if "prompt_chars" in row:
            if row["prompt_chars"] > 3000:
                continue   # the ~2,000-token prompt: the benchmark's
            text = HELDOUT_KJV.read_text(encoding="utf-8")[: row["prompt_chars"]]
        else:
            text = row["prompt"]
        ids = gemma3.tokenizer.encode(text)
        assert len(ids) == row["prompt_tokens"]
        if "prompt_ids" in row:
            assert ids == row["prompt_ids"]
        got = greedy_tokens(gemma3.model, ids, make_cache(gemma3.model, CacheConfig()), reference["tokens"], 512)
        assert got == row["transformers"]["ids"], (row["prompt"], gemma3.tokenizer.decode(got))
        checked += 1
    assert checked == 5 and any(r["prompt_tokens"] > 512 for r in rows)


def test_cli_sample(gemma3_gguf, reference):
    from typer.testing import CliRunner

    from tinygpt_mlx.cli.main import app

    row = reference["prompts"][0]
    r = CliRunner().invoke(app, ["sample", str(gemma3_gguf), "--prompt", row["prompt"], "--temperature", "0",
                                 "--tokens", str(reference["tokens"])])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == row["transformers"]["text"].strip(), r.stdout
    assert "GGUF gemma3 via mlx-lm" in r.stderr


def test_chat_template_from_metadata(gemma3, gemma3_md):
    """The pretrained file carries no chat template (chat falls back to the plain turn format); one
    written into its metadata, as the instruction-tuned files carry Gemma's, renders Gemma's turns
    with one BOS and its turn markers as single tokens."""
    from tinygpt_mlx.chat_template import encode_fragment, has_template, prompt_ids
    from tinygpt_mlx.ggml.tokenizer import tokenizer_from_metadata
    from tinygpt_mlx.tokenizer import Tokenizer

    md = gemma3_md
    assert "tokenizer.chat_template" not in md and not has_template(gemma3.tokenizer)
    tok = Tokenizer(wrapper=tokenizer_from_metadata({**md, "tokenizer.chat_template": GEMMA_TEMPLATE}, "test"))
    assert has_template(tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert tok.chat_prompt(messages) == \
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    ids = prompt_ids(tok, messages)
    start, end = encode_fragment(tok, "<start_of_turn>"), encode_fragment(tok, "<end_of_turn>")
    assert len(start) == len(end) == 1
    assert ids[0] == 2 and ids.count(2) == 1 and ids.count(start[0]) == 2 and ids.count(end[0]) == 1


def test_tokenizer_from_the_cache_is_the_converters(gemma3_gguf, gemma3, gemma3_md):
    """The loaded tokenizer was read from the tokenizer cache's entry for this file (written by
    this load or an earlier one; tinygpt_mlx/ggml/tokenizer_cache.py) and is the one transformers'
    converter makes from the metadata (tests/tokenizer_reference.py, the loader's code before the
    cache): the same serialisation, vocabulary, special ids, detokenizer and encodings."""
    from tests.tokenizer_reference import TEXTS, assert_same, reference_tokenizer
    from tinygpt_mlx.ggml import tokenizer_cache

    if tokenizer_cache.switches.flag(tokenizer_cache.OFF_VAR):
        pytest.skip(f"{tokenizer_cache.OFF_VAR} is set: no cache to read")
    metas = [json.loads(m.read_text()) for m in tokenizer_cache.root().glob("*/meta.json")]
    assert any(m["gguf"] == str(gemma3_gguf.resolve()) for m in metas), metas
    assert_same(gemma3.tokenizer._wrapper, reference_tokenizer(gemma3_md, "reference"),
                TEXTS + ["<start_of_turn>user\nHi<end_of_turn>\n<bos>", "\x01\x7f tab\tand 😀🙂 ⁂"])


@pytest.mark.parametrize("spec", ["fp32", "int4", "sink4/hot256", "int4+sink4/hot256"])
def test_needle_cell_past_the_window_and_the_hot_budget(gemma3, spec):
    """One pass-key document of ~800 tokens (`needle`'s own cell, depth 0.3 seed 0: the needle
    past the sliding layers' 512 and the hot window's 256): the full cache, int4, retrieval
    and int4 + retrieval answer it, retrieval having brought the needle's tokens back from the
    global layers' cold stores (the sliding rings hold 512 and have none)."""
    from tinygpt_mlx.cache import make_cache
    from tinygpt_mlx.evaluate.modes import parse_policy
    from tinygpt_mlx.evaluate.needle import DEFAULT_FILLER, cell_document, needle_positions, run_cell

    tok = gemma3.tokenizer
    prompt, answer = cell_document(tok, DEFAULT_FILLER.read_text(encoding="utf-8"), 800, 0.3, 0)
    ids, truth = list(tok.encode(prompt)), needle_positions(tok.encode, prompt, answer)
    assert len(ids) > 700 and len(ids) - truth[-1] > 512      # the needle is past every sliding window
    cfg = parse_policy(spec)
    cell = run_cell(gemma3.model, tok, cfg, ids, answer, truth, 512)
    assert cell["passed"], cell["output"]
    if cfg.retrieval:
        assert cell["telemetry"]["token_recall"] > 0.5, cell["telemetry"]
        assert cell["cache_bytes"]["sliding"] == 15 * 512 * 2 * 256 * 4      # 15 rings of 512, fp32 K and V


def test_retrieval_scaling_bench_grows_the_global_layers(gemma3):
    """The scaling bench (`benchmarks.retrieval_bench`) on Gemma 3: its cold stores are the three
    global layers', grown to 4K tokens from a 600-token prefill; the sliding rings stay at 512."""
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.evaluate.inputs import HELDOUT_KJV
    from tinygpt_mlx.evaluate.retrieval_bench import decode_scaling

    ids = gemma3.tokenizer.encode(HELDOUT_KJV.read_text(encoding="utf-8")[:3000])[:600]
    cfg = CacheConfig(sink=4, hot_budget=256)
    rows = decode_scaling(gemma3.model, cfg, ids, [4096], decode_steps=2, chunk=512)
    (row,) = rows
    assert row["context"] == 4096 + 3
    # three global layers' cold stores: 4096 - 260 hot tokens each, fp32 K and V of one head of 256
    assert row["cold_bytes"] == 3 * (4096 - 260 + 3) * 2 * 256 * 4, row["bytes"]
    assert row["bytes"]["sliding"] == 15 * 512 * 2 * 256 * 4


def test_retrieval_scaling_bench_grows_the_full_caches_global_layers(gemma3):
    """The scaling bench's full cache (`--full`, `grow_full`) on Gemma 3: its three global layers
    grown to 4K tokens by copies of a 600-token prefill, the sliding rings left at their window of
    512 (as `grow_cold` leaves them), and the retrieval and full rows stepped side by side. (Fails
    with `grow_full` growing every layer: a ring has no `fetch`, the bench stopped on a traceback.)"""
    from tinygpt_mlx.config import CacheConfig
    from tinygpt_mlx.evaluate.inputs import HELDOUT_KJV
    from tinygpt_mlx.evaluate.retrieval_bench import decode_scaling

    ids = gemma3.tokenizer.encode(HELDOUT_KJV.read_text(encoding="utf-8")[:3000])[:600]
    rows = decode_scaling(gemma3.model, CacheConfig(sink=4, hot_budget=256), ids, [4096], decode_steps=2,
                          chunk=512, full=True, record=False)
    assert [(r["cache"], r["context"]) for r in rows] == [("retrieval", 4096 + 3), ("full", 4096 + 3)]
    full = rows[1]["bytes"]
    assert full["body"] == 3 * (4096 + 3) * 2 * 256 * 4, full     # three global layers, fp32 K and V
    assert full["sliding"] == rows[0]["bytes"]["sliding"] == 15 * 512 * 2 * 256 * 4
