"""Writes GGUF files from tiny mlx-lm model directories the way llama.cpp's converter does
(`convert_hf_to_gguf.py`), with ggml's own writer (`gguf.GGUFWriter`), for the loader's tests.

The conventions are written here independently of `tinygpt_mlx.ggml`: the Q/K permutation is
mlx-lm's own (`mlx_lm.gguf.permute_weights`, written for its GGUF exporter), Gemma's norms are
stored as 1 + w, the tokenizer as llama.cpp's `tokenizer.ggml.*` keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import gguf
import mlx.core as mx
import numpy as np
from mlx_lm.gguf import permute_weights

PERMUTED = {"llama"}                 # architectures whose Q/K rows llama.cpp permutes
NORM_PLUS_ONE = {"gemma2", "gemma3"}


def write_gguf(src: Path, out: Path, arch: str = "llama", quant: Optional[str] = None,
               quant_only: tuple = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                    "ffn_down", "token_embd"),
               tokenizer_model: str = "gpt2", pre: Optional[str] = None, extra_md: Optional[dict] = None,
               chat_template: Optional[str] = None, tied: Optional[bool] = None,
               types: Optional[dict] = None) -> Path:
    """`src`: an mlx-lm model directory (config.json, model.safetensors, tokenizer.json).

    `quant` is the block type of the 2-D tensors named in `quant_only`; `types` gives some of them
    (by the same GGUF name, e.g. {"ffn_down": "Q4_K"}) another type, as llama.cpp's mixes do.

    `tied` says whether the file has its own `output.weight`, as llama.cpp's converter decides:
    None writes what the source holds (its `lm_head.weight` if it has one), True writes no output
    tensor (the output is the token embeddings, so a source with its own lm_head becomes a different
    model), False always writes one (a copy of the embeddings when the source ties them).
    """
    config = json.loads((src / "config.json").read_text())
    weights = mx.load(str(src / "model.safetensors"))
    if tied:
        weights.pop("lm_head.weight", None)
    elif tied is False and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    w = gguf.GGUFWriter(str(out), arch)
    n_layers = config["num_hidden_layers"]
    w.add_context_length(config.get("max_position_embeddings", 2048))
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    if "head_dim" in config:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    w.add_vocab_size(config["vocab_size"])
    for key, value in (extra_md or {}).items():
        w.add_float32(key, value) if isinstance(value, float) else w.add_uint32(key, value)
    _write_tokenizer(w, src, config["vocab_size"], tokenizer_model, pre, chat_template)

    names = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], n_layers)
    qtype = getattr(gguf.GGMLQuantizationType, quant) if quant else None
    for name, value in weights.items():
        base, suffix = name.rsplit(".", 1)
        # ggml's map lists no output tensor for the architectures llama.cpp always ties (gemma2)
        gname = names.get_name(base) or ("output" if base == "lm_head" else None)
        assert gname, f"no GGUF name for {name}"
        arr = np.array(value.astype(mx.float32))
        if arch in PERMUTED and base.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads"]
            kv = config.get("num_key_value_heads", heads)
            arr = np.array(permute_weights(mx.array(arr), heads, kv if base.endswith("k_proj") else None))
        if arch in NORM_PLUS_ONE and "norm" in base:
            arr = arr + 1.0
        gname_full = f"{gname}.{suffix}"
        kind = gname.split(".")[-1]
        ttype = getattr(gguf.GGMLQuantizationType, types[kind]) if kind in (types or {}) else qtype
        if ttype is not None and arr.ndim == 2 and kind in quant_only:
            data = _k_codes(arr, ttype) if ttype in K_FP16_FIELDS else gguf.quants.quantize(arr, ttype)
            w.add_tensor(gname_full, data, raw_dtype=ttype)
        else:
            w.add_tensor(gname_full, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


#: K-quants that ggml's Python package reads but cannot write (`quants.quantize` raises
#: NotImplementedError): the byte offsets of each 256-weight block's fp16 scales (ggml's block_q4_K)
K_FP16_FIELDS = {gguf.GGMLQuantizationType.Q4_K: (0, 2)}


def _k_codes(arr: np.ndarray, qtype) -> np.ndarray:
    """A K-quant tensor of `arr`'s shape with random codes and small finite scales: NOT the
    source's values (a model written so runs, with other weights), for what only a K-quant
    tensor's type exercises (which reader reads the file, what is held packed)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = arr.shape
    assert cols % block == 0, f"a {qtype.name} row needs a multiple of {block} weights, not {cols}"
    data = np.random.default_rng(0).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in K_FP16_FIELDS[qtype]:     # d and dmin: 1e-3, so every weight is finite and small
        data[:, :, offset:offset + 2] = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
    return data.reshape(rows, -1)


def _write_tokenizer(w, src: Path, vocab_size: int, model: str, pre: Optional[str],
                     chat_template: Optional[str]) -> None:
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    tokens = [""] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, i in vocab.items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for token, i in specials.items():
        tokens[i], types[i] = token, gguf.TokenType.CONTROL
    for i, t in enumerate(tokens):
        if not t:
            tokens[i] = f"[PAD{i}]"
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = tok["model"].get("merges", [])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    cfg_file = src / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    eos = specials.get(tok_cfg.get("eos_token", "<|endoftext|>"))
    bos = specials.get(tok_cfg.get("bos_token", "<|endoftext|>"))
    if eos is not None:
        w.add_eos_token_id(eos)
    if bos is not None:
        w.add_bos_token_id(bos)
    w.add_add_bos_token(False)
    template = chat_template or tok_cfg.get("chat_template")
    if template:
        w.add_chat_template(template)
