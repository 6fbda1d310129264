"""GGUF files into mlx-lm's model classes: the same logits and greedy tokens as mlx-lm on the
source directory (F32, and block formats against their dequantised reference), tokenizers rebuilt
from GGUF metadata that encode like the source tokenizer, and every bad GGUF a user can hand us."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from tests.conftest import TEXT, build_llama_dir
from tests.gguf_writer import write_gguf
from tinygpt_mlx import blas, generate_text
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.config import CacheConfig
from tinygpt_mlx.errors import ModelFormatError
from tinygpt_mlx.ggml.header import read_header
from tinygpt_mlx.loading import load

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 31]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MIXED = ("def f(x):\n    return x ** 2  # 東京 🙂 café\n<|im_start|>user\nnaïve 0123 <|im_end|>\n\t  spaces  "
         "and\r\nCRLF <|endoftext|>")


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    code = "def f(x):\n    return x ** 2\n\tif a and b: print('hi')\r\n" * 20
    tok.train_from_iterator([TEXT, code], trainer)
    return tok.to_str()


def _build_dir(path: Path, model_type: str, tok_json: str, seed: int = 0, drop_lm_head: bool = False,
               **extra) -> Path:
    """A tiny random mlx-lm model directory of `model_type`, with a chat template
    (`drop_lm_head`: saved without lm_head.weight, which ties a model that has no tie flag)."""
    import importlib

    path.mkdir(parents=True, exist_ok=True)
    vocab = len(json.loads(tok_json)["model"]["vocab"])
    config = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": vocab,
              "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": True, **extra}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    params = {k: v * 3.0 if v.ndim == 2 else v + 0.1 * mx.random.normal(v.shape)
              for k, v in tree_flatten(model.parameters()) if not (drop_lm_head and k == "lm_head.weight")}
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(tok_json)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 256}))
    return path


@pytest.fixture(scope="module")
def tok_json():
    return _tokenizer_json()


ARCHS = [("llama", "llama", {}),
         ("qwen2", "qwen2", {}),
         ("qwen3", "qwen3", {"head_dim": 16}),
         ("gemma2", "gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16}),
         ("gemma3", "gemma3_text", {"head_dim": 16, "query_pre_attn_scalar": 16,
                                    "sliding_window": 512, "rope_local_base_freq": 10000.0,
                                    "sliding_window_pattern": 6, "num_hidden_layers": 6}),
         ("phi3", "phi3", {"max_position_embeddings": 256, "original_max_position_embeddings": 256,
                           "tie_word_embeddings": False})]
# Whether `tiny` writes each architecture tied (no output.weight); `tiny_flipped` writes the other way.
TIED_IN_TINY = {"llama": True, "qwen2": True, "qwen3": True, "gemma2": True, "gemma3": False, "phi3": False}


def _write_tiny(root: Path, tok_json: str, flipped: bool) -> dict:
    out = {}
    for arch, model_type, extra in ARCHS:
        tied = TIED_IN_TINY[arch] != flipped
        extra, drop, write_tied = dict(extra), False, None
        if not flipped:
            pass
        elif model_type == "gemma3_text":
            drop = tied            # no tie flag: mlx-lm ties a checkpoint that has no lm_head.weight
        elif model_type == "gemma2":
            write_tied = tied      # mlx-lm's gemma2 always ties: untied = output.weight equal to the embeddings
        else:
            extra["tie_word_embeddings"] = tied
        name = f"{arch}-{'tied' if tied else 'untied'}"
        src = _build_dir(root / f"{name}-src", model_type, tok_json, drop_lm_head=drop, **extra)
        md = ({"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0}
              if arch == "gemma2" else {})
        out[arch] = (src, write_gguf(src, root / f"{name}.gguf", arch, extra_md=md, tied=write_tied))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tok_json):
    """name -> (source directory, GGUF written from it)."""
    return _write_tiny(tmp_path_factory.mktemp("gguf"), tok_json, flipped=False)


@pytest.fixture(scope="module")
def tiny_flipped(tmp_path_factory, tok_json):
    """As `tiny`, each architecture written the other way: tied where `tiny` is untied and back."""
    return _write_tiny(tmp_path_factory.mktemp("gguf-flipped"), tok_json, flipped=True)


def _logits(loaded, ids):
    return loaded.model(mx.array([ids]))[0].astype(mx.float32)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_f32_gguf_equals_source_directory(tiny, tiny_flipped, arch, tied):
    """Each architecture from a file whose output is tied to the token embeddings (no
    output.weight, as llama.cpp writes Gemma and the small Llamas) and from one with its own."""
    src, path = (tiny if TIED_IN_TINY[arch] == tied else tiny_flipped)[arch]
    assert ("output.weight" in read_header(path).tensor_types) == (not tied)
    with load(src) as ref, load(path) as ours:
        assert ours.format == "gguf" and ours.info["architecture"] == arch
        a, b = _logits(ref, PROMPT), _logits(ours, PROMPT)
        assert float(mx.abs(a - b).max()) < 1e-5   # F32 round trip: the same model (measured 0.0)
        greedy = dict(max_tokens=24, temperature=0.0)
        if arch == "gemma2":
            # mlx-lm's Gemma 2 computes its soft-capped attention itself, so our caches cannot
            # route it: refused with a clear error (mlx-lm's own caches still run it)
            with pytest.raises(ValueError, match="need our attention"):
                make_cache(ours.model, CacheConfig())
            return
        assert generate_text(ours, PROMPT, **greedy) == generate_text(ref, PROMPT, **greedy)


def test_tied_gemma3_is_tied_as_mlx_lm_ties_it(tiny_flipped, monkeypatch):
    """mlx-lm's gemma3_text has no tie flag: a tied file drops its lm_head as mlx-lm's own sanitize
    does for a checkpoint without lm_head.weight (the parameter count is the model's, not twice its
    embedding); a model that kept an lm_head would get the embedding's own arrays there."""
    import mlx_lm.models.gemma3_text as g3

    src, path = tiny_flipped["gemma3"]
    with load(src) as ref:
        want = _logits(ref, PROMPT)
        with load(path) as ours:
            assert "lm_head" not in ours.model and ours.model.tie_word_embeddings
            assert ours.info["parameters"] == ref.info["parameters"]
        monkeypatch.setattr(g3.Model, "sanitize", lambda self, weights: weights)
        with load(path) as kept:
            assert kept.model.lm_head.weight is kept.model.model.embed_tokens.weight
            assert float(mx.abs(_logits(kept, PROMPT) - want).max()) < 1e-5


def test_llama_permutation_is_undone(tiny):
    """Loading without the un-permutation (what a loader that forgets llama.cpp's Q/K layout
    computes) is far off: the test above can fail."""
    from tinygpt_mlx.ggml import arch as arch_mod

    src, path = tiny["llama"]
    saved = arch_mod.ARCHES["llama"]
    arch_mod.ARCHES["llama"] = arch_mod.Arch("llama", "llama", permute_qk=False)
    try:
        with load(src) as ref, load(path) as broken:
            assert float(mx.abs(_logits(ref, PROMPT) - _logits(broken, PROMPT)).max()) > 1e-2
    finally:
        arch_mod.ARCHES["llama"] = saved


def other_blas() -> str | None:
    """What the dense products run under where it is not MLX's own BLAS on the CPU backend on Linux
    (the suite's process, as CI runs it): the OpenBLAS mapped in, another LD_PRELOAD, or the
    platform and device; None there."""
    if blas.loaded_openblas() or os.environ.get("LD_PRELOAD"):
        return blas.loaded_openblas() or f"LD_PRELOAD={os.environ['LD_PRELOAD']}"
    if not sys.platform.startswith("linux") or mx.default_device() != mx.cpu:
        return f"{sys.platform} {mx.default_device()}"
    return None


#: Packed against the reference under another BLAS, in units of float32's epsilon times the
#: largest logit. The reference's dense products go through that BLAS's sgemm, the packed model's
#: through MLX's quantised kernels (no BLAS), each summing in its own order: measured with
#: OpenBLAS 0.3.21 (2026-12-07) Q8_0 1.05e-5, Q4_0 8.8e-6, Q4_1 1.50e-5 at a largest logit of
#: 12.6-13.9, 5.9-9.0 epsilons of it (dense, and Q5_0's dequantised "packed", 0.0: the same sgemm).
#: 64 leaves room for other kernels' blockings and is ~1e-4 here; broken in a copy, the packed
#: layers' scales and biases held in float16 were 1.3e-2 to 6.2e-2 off, the scales 2**-20 too
#: large (8 epsilons) 1.1e-4 to 2.2e-4: both fail under either BLAS.
OTHER_BLAS_EPSILONS = 64
EPS = float(np.finfo(np.float32).eps)
BLAS_OWN = "MLX's own BLAS on the CPU backend"


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_block_quantised_gguf_packed_and_dense(tmp_path, tiny, quant):
    """Block-quantised tensors: packed (MLX quantised layers) and dense (dequantised) give the
    logits of the model whose weights are ggml's own dequantisation (gguf.quants): the same bits
    under MLX's own BLAS on the CPU backend (0.0 measured for every format and mode; the suite's
    process on Linux, CI), within `OTHER_BLAS_EPSILONS` float32 epsilons of the largest logit under
    another (OpenBLAS preloaded: packed 1.5e-5 at most, measured); the failure names which."""
    src, _ = tiny["llama"]
    path = write_gguf(src, tmp_path / f"{quant}.gguf", "llama", quant=quant)
    ref_dir = tmp_path / "ref"
    shutil.copytree(src, ref_dir)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    names = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"}
    deq = {}
    for k, v in mx.load(str(src / "model.safetensors")).items():
        arr = np.array(v)
        if arr.ndim == 2 and k.rsplit(".", 2)[-2] in names:
            arr = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)
        deq[k] = mx.array(arr)
    mx.save_safetensors(str(ref_dir / "model.safetensors"), deq)
    with load(ref_dir) as ref:
        want = _logits(ref, PROMPT)
        for mode in ("dense", "packed"):
            with load(path, weights=mode) as ours:
                held = ours.info["tensor_types"]
                assert quant in held, held
                packed_layers = [m for _, m in ours.model.named_modules() if hasattr(m, "bits")]
                # Q5_0 is read by ggml's reader and always dequantised; the rest stay packed if asked
                assert bool(packed_layers) == (mode == "packed" and quant != "Q5_0")
                # and info says what was done (it said "packed" for Q5_0's dequantised tensors)
                assert held[quant]["held"].startswith("packed") == bool(packed_layers), held
                assert ("weights_note" in ours.info) == (mode == "packed" and quant == "Q5_0")
                under = other_blas()
                diff = float(mx.abs(_logits(ours, PROMPT) - want).max())
                bound = 0.0 if under is None else OTHER_BLAS_EPSILONS * EPS * float(mx.abs(want).max())
                assert diff <= bound, (f"{quant} {mode} under {under or BLAS_OWN}: max |logits - reference| "
                                       f"{diff:.3g}, bound {bound:.3g}")


def test_gguf_runs_under_our_caches(tiny):
    """Our caches on a GGUF model: StreamingLLM, KIVI and retrieval against the full cache."""
    _, path = tiny["llama"]
    with load(path) as loaded:
        full = generate_text(loaded, PROMPT, max_tokens=16, temperature=0.0)
        for cfg in (CacheConfig(key_bits=8, group_size=32, residual=32),
                    CacheConfig(sink=4, window=64), CacheConfig(sink=4, hot_budget=64)):
            cache = make_cache(loaded.model, cfg)
            assert generate_text(loaded, PROMPT, max_tokens=16, temperature=0.0, cache=cache) == full


def test_tokenizer_from_gguf_encodes_like_source(tiny):
    src, path = tiny["llama"]
    with load(src) as ref, load(path) as ours:
        assert ours.tokenizer.encode(MIXED) == ref.tokenizer.encode(MIXED)
        ids = ref.tokenizer.encode(MIXED)
        assert ours.tokenizer.decode(ids) == ref.tokenizer.decode(ids) == MIXED
        for special in SPECIALS:   # specials stay whole
            assert len(ours.tokenizer.encode(special)) == 1
        messages = [{"role": "user", "content": "hi there"}]
        assert ours.tokenizer.chat_prompt(messages) == ref.tokenizer.chat_prompt(messages)
        im_end = ref.tokenizer.encode("<|im_end|>")[0]
        assert im_end in ours.tokenizer.eos_ids or ours.tokenizer.eos_ids  # an end id is known


def test_gguf_info_names_what_was_loaded(tiny):
    from tinygpt_mlx.cli.main import app

    _, path = tiny["qwen2"]
    r = CliRunner().invoke(app, ["info", str(path), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["format"] == "gguf" and out["architecture"] == "qwen2" and out["source"] == "file"
    assert out["tensor_types"]["F32"]["count"] > 0


def _kquant_mix(tmp_path, tok_json, refused: bool) -> Path:
    """A llama GGUF whose projections are Q8_0 (a type MLX's reader holds packed) but ffn_down
    Q4_K (a K-quant, 256-weight rows: intermediate_size 256), and where `refused` attn_v Q5_0 (a
    type MLX's reader refuses), as Gemma 3's Q4_K_M file mixes Q8_0, Q4_K, Q6_K and Q5_0."""
    src = _build_dir(tmp_path / "mix-src", "llama", tok_json, intermediate_size=256)
    types = {"ffn_down": "Q4_K", **({"attn_v": "Q5_0"} if refused else {})}
    return write_gguf(src, tmp_path / f"mix-{refused}.gguf", "llama", quant="Q8_0", types=types)


def _packed_layers(loaded) -> list:
    return [name for name, m in loaded.model.named_modules() if hasattr(m, "bits")]


def test_mlx_reader_types_are_what_mlx_reads(tmp_path):
    """load.py's MLX_READER_TYPES / MLX_PACKED_TYPES, against the installed MLX: a one-tensor file
    of each type is read (packed: a .scales beside it) or refused by `mx.load`."""
    from tinygpt_mlx.ggml.load import MLX_PACKED_TYPES, MLX_READER_TYPES

    for name in (*MLX_READER_TYPES, "Q5_0", "Q5_1", "Q3_K", "Q5_K", "Q8_K", "IQ4_NL", "F64"):
        qtype = getattr(gguf.GGMLQuantizationType, name)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        w = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama")
        w.add_tensor("x.weight", np.zeros((2, 256 // block * size), np.uint8), raw_dtype=qtype)
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        try:
            got = mx.load(str(tmp_path / f"{name}.gguf"))
        except Exception:
            got = None
        assert (got is not None) == (name in MLX_READER_TYPES), name
        assert (got is not None and "x.scales" in got) == (name in MLX_PACKED_TYPES), name


def test_refused_kquant_file_packed_is_dequantised_whole_and_info_says_so(tmp_path, tok_json):
    """--weights packed on a file MLX's reader refuses (Q5_0 beside Q4_K and Q8_0, as Gemma 3's):
    ggml's reader dequantises every tensor, its Q8_0 ones too; `info` says that (it said "packed
    (MLX affine, group 32)" for every block type) and why."""
    from tinygpt_mlx.cli.main import app

    path = _kquant_mix(tmp_path, tok_json, refused=True)
    assert {"Q8_0", "Q4_K", "Q5_0"} <= set(read_header(path).type_counts)
    with load(path, weights="packed") as ours:
        assert ours.info["reader"] == "gguf" and not _packed_layers(ours)
    r = CliRunner().invoke(app, ["info", str(path), "--weights", "packed", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert {t: h["held"] for t, h in out["tensor_types"].items()} == {
        "F32": "float32", "Q4_K": "dequantised to float32", "Q5_0": "dequantised to float32",
        "Q8_0": "dequantised to float32"}
    assert out["weights_note"] == (
        "--weights packed: none of this file's tensors can stay packed: MLX's GGUF reader cannot read "
        "its Q5_0 tensors, so ggml's reader reads the whole file and every tensor, its Q8_0 ones too, "
        "is dequantised to float32")
    text = CliRunner().invoke(app, ["info", str(path), "--weights", "packed"]).stdout
    assert "packed (MLX affine" not in text and f"weights_note    {out['weights_note']}" in text, text
    # dense asks for nothing packed: nothing to explain
    r = CliRunner().invoke(app, ["info", str(path), "--weights", "dense", "--json"])
    assert "weights_note" not in json.loads(r.stdout)


def test_readable_kquant_file_packed_keeps_only_q8_0_packed(tmp_path, tok_json):
    """A file MLX's reader reads (Q4_K beside Q8_0): its Q8_0 tensors stay packed, its Q4_K ones
    MLX's reader dequantised (float16) and `info` says so, not "packed"."""
    path = _kquant_mix(tmp_path, tok_json, refused=False)
    with load(path, weights="packed") as ours:
        assert ours.info["reader"] == "mlx"
        layers = _packed_layers(ours)
        assert layers and not [n for n in layers if "down_proj" in n], layers    # ffn_down: Q4_K
        held = ours.info["tensor_types"]
        assert held["Q8_0"]["held"] == "packed (MLX affine, group 32)"
        assert held["Q4_K"]["held"] == "dequantised to float32 (by MLX's reader, through float16)", held
        assert ours.info["weights_note"] == (
            "--weights packed: this file's Q4_K tensors cannot stay packed: MLX packs only Q4_0, Q4_1, "
            "Q8_0 and its GGUF reader dequantises Q4_K itself (to float16, then float32)")


def test_refused_kquant_file_sample_packed_says_why_once_on_stderr(tmp_path, tok_json):
    """sample --weights packed on the refused file says once on stderr that its tensors cannot
    stay packed and why; --weights dense says nothing of it and samples the same text."""
    from tests.process_warnings import invoke

    path = _kquant_mix(tmp_path, tok_json, refused=True)
    args = ["sample", path, "--prompt", "def f", "--tokens", "3", "--temperature", "0"]
    r = invoke([*args, "--weights", "packed"])
    assert r.exit_code == 0, r.output
    notes = [l for l in r.stderr.splitlines() if "stay packed" in l]
    assert len(notes) == 1 and "cannot read its Q5_0 tensors" in notes[0], r.stderr
    dense = invoke([*args, "--weights", "dense"])
    assert dense.exit_code == 0 and "stay packed" not in dense.stderr, dense.stderr
    assert dense.stdout == r.stdout     # the same weights either way


@pytest.mark.slow
def test_real_gemma3_kquant_file_info_packed():
    """The real Gemma 3 270M Q4_K_M file (skipped where it is not in the cache): `info --weights
    packed` holds its Q8_0 tensors dequantised like the K-quants, and names the types that refuse."""
    from tinygpt_mlx.cli.main import app
    from tinygpt_mlx.errors import PosttrainError
    from tinygpt_mlx.realmodel import gemma3_path

    try:
        path = gemma3_path(fetch=False)
    except PosttrainError as e:
        pytest.skip(f"Gemma 3 270M not available here: {e}")
    r = CliRunner().invoke(app, ["info", str(path), "--weights", "packed", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert {t: h["held"] for t, h in out["tensor_types"].items() if t != "F32"} == {
        t: "dequantised to float32" for t in ("Q4_K", "Q5_0", "Q6_K", "Q8_0")}
    assert "MLX's GGUF reader cannot read its Q5_0 tensors" in out["weights_note"]
    assert "its Q8_0 ones too" in out["weights_note"]


# -- bad GGUF files ------------------------------------------------------------------------

def _run(args):
    from tinygpt_mlx.cli.main import app
    return CliRunner().invoke(app, args)


def test_unsupported_architecture_is_one_line(tmp_path, tiny):
    src, _ = tiny["llama"]
    path = write_gguf(src, tmp_path / "f.gguf", "llama")
    data = path.read_bytes().replace(b"llama", b"falcn", 1)   # general.architecture's value
    (tmp_path / "falcon.gguf").write_bytes(data)
    with pytest.raises(ModelFormatError, match=r"architecture 'falcn' is not supported \(supported: .*llama"):
        load(tmp_path / "falcon.gguf")
    line = _one_error_line(_run(["sample", str(tmp_path / "falcon.gguf"), "--prompt", "x", "--tokens", "1"]))
    assert str(tmp_path / "falcon.gguf") in line and "'falcn' is not supported" in line, line


def _one_error_line(r) -> str:
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_untied_output_for_an_always_tied_model_is_one_line(tmp_path, tiny):
    """mlx-lm's gemma2 always computes its output with the token embeddings: a file with an
    output.weight of its own would silently run without it, so it is refused, naming the tensor."""
    src, _ = tiny["gemma2"]
    odd = tmp_path / "src"
    shutil.copytree(src, odd)
    weights = mx.load(str(odd / "model.safetensors"))
    weights["lm_head.weight"] = mx.random.normal(weights["model.embed_tokens.weight"].shape)
    mx.save_safetensors(str(odd / "model.safetensors"), weights)
    path = write_gguf(odd, tmp_path / "untied.gguf", "gemma2")
    line = _one_error_line(_run(["sample", str(path), "--prompt", "x", "--tokens", "1"]))
    assert str(path) in line and "output.weight" in line and "gemma2" in line and "ties" in line, line


def test_tensor_that_does_not_fit_is_named(tmp_path, tiny):
    """A tensor of the wrong shape: the one line names the parameter and the GGUF tensor."""
    src, _ = tiny["llama"]
    odd = tmp_path / "src"
    shutil.copytree(src, odd)
    weights = mx.load(str(odd / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"][:32]
    mx.save_safetensors(str(odd / "model.safetensors"), weights)
    path = write_gguf(odd, tmp_path / "narrow.gguf", "llama")
    line = _one_error_line(_run(["sample", str(path), "--prompt", "x", "--tokens", "1"]))
    assert str(path) in line and "model.norm.weight (GGUF output_norm.weight)" in line, line
    assert "(32,)" in line and "(64,)" in line, line


def test_truncated_gguf_is_one_line(tmp_path, tiny):
    _, path = tiny["llama"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    r = _run(["sample", str(cut), "--prompt", "x", "--tokens", "1"])
    assert r.exit_code == 1
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and str(cut) in lines[0] and "Traceback" not in r.output, r.output


def test_unsupported_tensor_type_is_one_line(tmp_path, tiny):
    src, _ = tiny["llama"]
    path = write_gguf(src, tmp_path / "q81.gguf", "llama", quant="Q8_0")
    data = bytearray(path.read_bytes())
    # retype one tensor's descriptor from Q8_0 (8) to Q8_1 (9): same name, no reader supports it
    name = b"blk.0.ffn_down.weight"
    at = data.index(name) + len(name)
    dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == 8
    data[type_at:type_at + 4] = (9).to_bytes(4, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=r"blk\.0\.ffn_down\.weight.*Q8_1|Q8_1.*blk\.0\.ffn_down"):
        load(tmp_path / "bad.gguf")


def test_serve_an_ollama_name_as_ollama_would(tmp_path, monkeypatch, tiny):
    """A GGUF served by its ollama name: /api/tags lists it under that name, format gguf, its
    architecture and main tensor type, and the ollama client chats with it by name."""
    ollama = pytest.importorskip("ollama")
    from tests.test_resolve import make_ollama_store
    from tinygpt_mlx.server.app import create_app, serve_in_thread

    src, _ = tiny["llama"]
    path = write_gguf(src, tmp_path / "q8.gguf", "llama", quant="Q8_0")
    make_ollama_store(tmp_path / "store", path, "tiny", "1b")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "store"))
    with load("tiny:1b") as loaded:
        srv, thread, url = serve_in_thread(create_app(loaded, CacheConfig(), prefill_chunk=64))
        try:
            client = ollama.Client(host=url)
            tags = client.list().models
            assert [m.model for m in tags] == ["tiny:1b"]
            d = tags[0].details
            assert (d.format, d.family, d.quantization_level) == ("gguf", "llama", "Q8_0")
            assert tags[0].size == path.stat().st_size
            for name in ("tiny:1b", "tiny"):
                r = client.chat(name, [{"role": "user", "content": "hi"}], options={"temperature": 0,
                                                                                    "num_predict": 4})
                assert r.done and r.eval_count <= 4
        finally:
            srv.should_exit = True
            thread.join(timeout=10)


def test_serve_several_models_one_resident(tmp_path, monkeypatch, tiny):
    """`serve a b`: both listed from their files, the second loaded on its first request in place
    of the first (answers equal a fresh server's), then the first swapped back."""
    ollama = pytest.importorskip("ollama")
    from tests.test_resolve import make_ollama_store
    from tinygpt_mlx.resolve import resolve
    from tinygpt_mlx.server.app import create_app, serve_in_thread

    make_ollama_store(tmp_path, tiny["llama"][1], "tiny", "1b")
    make_ollama_store(tmp_path, tiny["qwen2"][1], "qwen", "2b")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    msgs = [{"role": "user", "content": "hello there"}]
    opts = {"temperature": 0, "num_predict": 6}

    def answers(loaded, others=()):
        srv, thread, url = serve_in_thread(create_app(loaded, CacheConfig(), prefill_chunk=64, others=others))
        try:
            client = ollama.Client(host=url)
            tags = {m.model: m for m in client.list().models}
            out = {name: client.chat(name, msgs, options=opts).message.content for name in ("qwen:2b", "tiny:1b")
                   if name in tags}
            return tags, out, client.ps().models[0].model, httpx_get(url + "/api/slots")["model_swaps"]
        finally:
            srv.should_exit = True
            thread.join(timeout=10)

    with load("tiny:1b") as first:
        tags, both, resident, swaps = answers(first, [resolve("qwen:2b")])
    assert set(tags) == {"tiny:1b", "qwen:2b"}
    q = tags["qwen:2b"].details
    assert (q.format, q.family, q.quantization_level) == ("gguf", "qwen2", "F32")
    assert tags["qwen:2b"].size == tiny["qwen2"][1].stat().st_size
    assert resident == "tiny:1b" and swaps == 2      # qwen swapped in, then tiny back
    with load("qwen:2b") as alone:
        _, fresh, _, _ = answers(alone)
    assert both["qwen:2b"] == fresh["qwen:2b"]


def httpx_get(url):
    import httpx
    return httpx.get(url).json()


def test_serve_refuses_an_unknown_second_model_before_loading(tmp_path, monkeypatch):
    from tinygpt_mlx.cli.main import app

    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    r = CliRunner().invoke(app, ["serve", "models/tinygpt-base.tinygpt", "nosuch:7b", "--port", "1"])
    assert r.exit_code == 1
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "nosuch:7b" in lines[0], r.stderr


def test_sentencepiece_tokenizer_from_gguf_metadata(tmp_path):
    """A SentencePiece (llama-type) vocabulary as llama.cpp's converter writes it from
    tokenizer.model (pieces, scores, token types, byte fallback, add-BOS) encodes like the source
    SentencePiece model through transformers' own Llama tokenizer."""
    spm = pytest.importorskip("sentencepiece")

    from tinygpt_mlx.ggml.tokenizer import tokenizer_from_metadata

    corpus = tmp_path / "corpus.txt"
    corpus.write_text((TEXT + "def f(x):\n    return x ** 2\n") * 5, encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=420,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   bos_id=1, eos_id=2, unk_id=0, minloglevel=2,
                                   # as Llama's tokenizer.model: no normalisation, spaces kept
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   split_digits=True, allow_whitespace_only_pieces=True)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    types = []
    for i in range(sp.get_piece_size()):
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1)
    md = {"general.architecture": "llama", "tokenizer.ggml.model": "llama",
          "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
          "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.get_piece_size())],
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
          "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    ours = tokenizer_from_metadata(md, "test")
    # (a text that starts with spaces is split one '▁' short by transformers' Metaspace, as
    # transformers documents for its GGUF converter; not tested here)
    text = "The quick brown fox, naïve café 東京 🙂\n    return x ** 2 = 0123\n\n\tend  two"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)            # the SentencePiece model itself
    assert any(sp.is_byte(i) for i in ids)   # byte fallback was exercised (the newline)
    assert ours.encode(text)[0] == 1         # llama.cpp adds BOS to a SentencePiece vocabulary
    assert ours.decode(ids) == sp.decode(ids) == text


def test_bad_weights_mode_is_one_line(tiny):
    """A bad --weights is a usage error (exit 2, checked as click parses it, before the model
    loads: cli/common.py `_weights`, session 44; it exited 1 from the loader before)."""
    _, path = tiny["llama"]
    r = _run(["info", str(path), "--weights", "fast"])
    assert r.exit_code == 2
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert lines == ["error: Invalid value for '--weights': choose one of auto, packed, dense, got 'fast' "
                     "(see 'posttrainllm info --help')"], r.stderr


def test_tags_quantization_level_is_the_files_type_as_ollama_reports_it(tmp_path, tiny):
    """/api/tags' quantization_level is the GGUF's file type (`general.file_type`), as ollama
    reports it: Gemma 3 270M's Q4_K_M file said Q5_0, the type most of its tensors have, before
    session 44. A file without one keeps the main tensor type."""
    from tinygpt_mlx.resolve import resolve
    from tinygpt_mlx.server.models import describe

    src, _ = tiny["llama"]
    plain = write_gguf(src, tmp_path / "q8.gguf", "llama", quant="Q8_0")
    typed = write_gguf(src, tmp_path / "km.gguf", "llama", quant="Q8_0", extra_md={"general.file_type": 15})
    unknown = write_gguf(src, tmp_path / "odd.gguf", "llama", quant="Q8_0", extra_md={"general.file_type": 999})
    assert describe(resolve(str(plain))).details["quantization_level"] == "Q8_0"
    assert describe(resolve(str(typed))).details["quantization_level"] == "Q4_K_M"
    assert describe(resolve(str(unknown))).details["quantization_level"] == "Q8_0"
