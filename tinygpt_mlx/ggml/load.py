"""A GGUF file into mlx-lm's own, unmodified model classes.

The architecture table (`arch.py`) gives the config; each parameter of the mlx-lm model is found
in the file through ggml's own Hugging Face -> GGUF tensor-name map (`gguf.get_tensor_name_map`),
llama.cpp's conventions are undone (Q/K permutation, Gemma's 1 + w norms, rope_freqs), and the
block-quantised tensors MLX holds natively either stay packed (`QuantizedLinear`,
`QuantizedEmbedding`) or are dequantised to the compute dtype, by `weights`:

  auto    packed on a GPU (Metal, CUDA: the quantised kernels read 4-8x fewer bytes), dense on
          the CPU backend, where MLX's quantised matmul is slower than a BLAS matmul
          (docs/gguf.md measures both)
  packed  keep them packed: the Q4_0, Q4_1 and Q8_0 tensors of a file MLX's reader reads; a file
          with a type it refuses (Q5_0, Q3_K...) is dequantised whole, and `info` and `sample`
          say so (`weights_note`)
  dense   dequantise everything to the compute dtype
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import ModelFormatError
from .arch import Arch, arch_for, config_from_metadata, llama3_rope_scaling, scalar
from .header import FLOAT_TYPES, read_header
from .tensors import GGUFContents, Packed, read

WEIGHT_MODES = ("auto", "packed", "dense")


def compute_dtype() -> mx.Dtype:
    """float32 on the CPU backend (its fp16/bf16 matmuls are ~50x slower), float16 on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.float16


def resolve_weights_mode(mode: str) -> str:
    """"packed" or "dense" for `mode` (auto: by backend); a mode not in WEIGHT_MODES is a
    one-line error naming what was given."""
    if mode not in WEIGHT_MODES:
        raise ModelFormatError(f"--weights {mode!r}: choose one of {', '.join(WEIGHT_MODES)}")
    if mode == "auto":
        return "dense" if mx.default_device() == mx.cpu else "packed"
    return mode


def load_gguf_model(path: Path, weights: str = "auto",
                    before_tensors: Optional[Callable[[dict], None]] = None) -> tuple[nn.Module, dict, dict, dict]:
    """(model, config, info, metadata) for a GGUF file; info says how each tensor type is held.
    `before_tensors(metadata)` runs before the tensors are dequantised (`tensors.read`)."""
    mode = resolve_weights_mode(weights)
    header = read_header(path)    # exact tensor types; an unsupported architecture fails before any tensor is read
    arch = arch_for(header.metadata, str(path))
    contents = read(path, before_tensors)
    md = contents.metadata
    config = config_from_metadata(md, arch, set(contents.tensors), str(path))
    if "rope_freqs.weight" in contents.tensors:
        freqs = np.array(_dense(contents.tensors["rope_freqs.weight"], mx.float32))
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        config["rope_scaling"] = llama3_rope_scaling(freqs, head_dim, config.get("rope_theta", 10000.0),
                                                     str(path))
    module = importlib.import_module(f"mlx_lm.models.{arch.model_type}")
    try:
        model = module.Model(module.ModelArgs.from_dict(config))
    except (TypeError, ValueError, KeyError) as e:
        raise ModelFormatError(f"{path}: mlx-lm cannot build a {arch.model_type} model from this "
                               f"GGUF's metadata ({e})") from None
    params, sources = _gguf_params(model, contents, arch, config, mode, str(path))
    _quantize_packed(model, params)
    model.eval()
    try:
        model.load_weights(list(params.items()), strict=True)
    except ValueError as e:
        raise ModelFormatError(f"{path}: tensors do not fit mlx-lm's {arch.model_type} model "
                               f"({_one_line(str(e), sources)})") from None
    mx.eval(model.parameters())
    dtype_name = str(compute_dtype()).rsplit(".", 1)[-1]
    held = {t: _held(t, mode, contents.reader, dtype_name) for t in header.type_counts}
    info = {"format": "gguf", "architecture": arch.gguf, "model_type": arch.model_type,
            "weights": mode, "reader": contents.reader,
            "tensor_types": {t: {"count": n, "held": held[t]} for t, n in sorted(header.type_counts.items())},
            "gguf_name": scalar(md.get("general.name", "")),
            "file_type": scalar(md.get("general.file_type", -1))}
    unpacked = sorted(t for t in held if t not in FLOAT_TYPES and not held[t].startswith("packed"))
    if mode == "packed" and unpacked:
        asked = "--weights packed" if weights == "packed" else f"--weights {weights} (packed on this backend)"
        info["weights_note"] = _not_packed_note(asked, contents.reader, unpacked, header.type_counts, dtype_name)
    return model, config, info, md


#: the block types MLX's GGUF reader (`mx.load`, MLX 0.32) gives as packed triples, which can
#: stay packed; the other types it reads it dequantises itself, to float16 (BF16 too); a file
#: with a type it does not read (Q5_0, Q5_1, Q3_K, Q5_K, IQ*...) it refuses whole, and ggml's
#: reader dequantises every tensor of it (tensors.py). tests/test_gguf.py checks both lists
#: against the installed MLX.
MLX_PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
MLX_READER_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q4_K", "Q6_K", "I8", "I32")


def _held(gtype: str, mode: str, reader: str, dtype_name: str) -> str:
    """How the loader holds a tensor of GGML type `gtype`: what `info` reports per type."""
    if gtype in FLOAT_TYPES:
        return dtype_name
    if reader == "mlx" and gtype in MLX_PACKED_TYPES:
        return "packed (MLX affine, group 32)" if mode == "packed" else f"dequantised to {dtype_name}"
    if reader == "mlx":
        return f"dequantised to {dtype_name} (by MLX's reader, through float16)"
    return f"dequantised to {dtype_name}"


def _not_packed_note(asked: str, reader: str, unpacked: list, type_counts: dict, dtype_name: str) -> str:
    """Why some (or all) of a file's block types are not held packed although packed was asked."""
    if reader == "mlx":
        return (f"{asked}: this file's {', '.join(unpacked)} tensors cannot stay packed: MLX packs only "
                f"{', '.join(MLX_PACKED_TYPES)} and its GGUF reader dequantises {', '.join(unpacked)} "
                f"itself (to float16, then {dtype_name})")
    refused = sorted(t for t in type_counts if t not in MLX_READER_TYPES)
    why = (f"MLX's GGUF reader cannot read its {', '.join(refused)} tensors" if refused
           else "MLX's GGUF reader refused the file")
    packable = sorted(t for t in type_counts if t in MLX_PACKED_TYPES)
    too = f", its {', '.join(packable)} ones too," if packable else ""
    return (f"{asked}: none of this file's tensors can stay packed: {why}, so ggml's reader reads "
            f"the whole file and every tensor{too} is dequantised to {dtype_name}")


def _dense(t: Any, dtype) -> mx.array:
    return t.dense(dtype) if isinstance(t, Packed) else t.astype(dtype)


def _gguf_params(model: nn.Module, contents: GGUFContents, arch: Arch, config: dict, mode: str,
                 source: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    """(mlx-lm parameter name -> array, parameter name -> the GGUF tensor it came from); packed
    parameters as .weight/.scales/.biases.

    A file without `output.weight` ties its output to the token embeddings (llama.cpp's rule for
    every architecture). A model built with an `lm_head` all the same (its config has no tie flag)
    is first tied by mlx-lm's own rule, its `sanitize` of a checkpoint without `lm_head.weight`
    (gemma3_text drops its lm_head and uses the embedding); one that still has it gets
    `token_embd.weight` there, the same arrays as its embedding. A file
    with an `output.weight` for a model that has no `lm_head` (mlx-lm's gemma2 always ties) loads
    only if that tensor equals the embeddings; otherwise one line says the two do not fit.
    """
    import gguf   # noqa: PLC0415 (the name map; imported only when a GGUF is loaded)

    arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch.gguf]
    names = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    dtype = compute_dtype()
    tied_file = "output.weight" not in contents.tensors
    if tied_file and "lm_head" in model and hasattr(model, "sanitize"):
        model.sanitize({})
    flat = tree_flatten(model.parameters())
    if not tied_file and not any(p.startswith("lm_head.") for p, _ in flat):
        _check_output_is_embedding(contents, arch, source)
    out: dict[str, mx.array] = {}
    sources: dict[str, str] = {}
    done: dict[str, Any] = {}   # GGUF key -> the tensor after conversion (a tied pair shares it)
    for pname, _ in flat:
        base, suffix = pname.rsplit(".", 1)
        gname = names.get_name(base)
        key = f"{gname}.{suffix}" if gname else None
        if base == "lm_head" and tied_file:
            key = f"token_embd.{suffix}"
        if key not in done and key not in contents.tensors:
            raise ModelFormatError(f"{source}: no tensor for {pname} (looked for {key or 'a GGUF name'})")
        sources[pname] = key
        if key in done:
            t = done[key]
        else:
            t = contents.tensors.pop(key)    # the file's tensor goes once converted (not held twice)
            if arch.permute_qk and suffix in ("weight", "bias") and base.endswith(("q_proj", "k_proj")):
                heads = config["num_attention_heads"] if base.endswith("q_proj") else config["num_key_value_heads"]
                t = _unpermute(t, heads)
            if arch.norm_offset and "norm" in base and suffix == "weight":
                t = _dense(t, mx.float32) - arch.norm_offset
            if not (isinstance(t, Packed) and mode == "packed"):
                t = _dense(t, dtype)
            mx.eval([t.weight, t.scales, t.biases] if isinstance(t, Packed) else t)   # one tensor's temporaries at a time
            done[key] = t
        if isinstance(t, Packed):
            # scales and biases in the compute dtype: a float32 activation on the CPU backend
            # keeps the matmul in float32 (fp16 scales would make it an fp16 matmul)
            out[f"{base}.weight"] = t.weight
            out[f"{base}.scales"], out[f"{base}.biases"] = t.scales.astype(dtype), t.biases.astype(dtype)
            sources[f"{base}.scales"] = sources[f"{base}.biases"] = key
        else:
            out[pname] = t
    return out, sources


def _check_output_is_embedding(contents: GGUFContents, arch: Arch, source: str) -> None:
    """mlx-lm's model computes its output with the token embeddings: a file's own output.weight
    must be those embeddings, or the model would silently run without it."""
    output, embd = contents.tensors["output.weight"], contents.tensors.get("token_embd.weight")
    same = embd is not None and bool(mx.array_equal(_dense(output, mx.float32), _dense(embd, mx.float32)))
    if not same:
        raise ModelFormatError(f"{source}: the GGUF has its own output.weight (an untied output), but "
                               f"mlx-lm's {arch.model_type} model always ties its output to "
                               "token_embd.weight; this file cannot run as it was made")


def _one_line(message: str, sources: dict[str, str]) -> str:
    """mlx's load_weights message on one line, each parameter it names followed by the GGUF
    tensor it was read from."""
    text = " ".join(part.strip() for part in message.splitlines() if part.strip())
    return re.sub(r"[A-Za-z0-9_.]+\.(?:weight|bias|scales|biases)\b",
                  lambda m: (f"{m.group(0)} (GGUF {sources[m.group(0)]})" if m.group(0) in sources
                             else m.group(0)), text)


def _unpermute(t: Any, heads: int) -> Any:
    """Undo llama.cpp's Q/K row permutation: within each head, rows were interleaved
    (pairs for its RoPE); put the two halves back in Hugging Face's order."""
    rows = (t.weight if isinstance(t, Packed) else t).shape[0]
    half = rows // heads // 2
    order = np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(-1)
    if isinstance(t, Packed):
        return t.take_rows(order)
    return t[mx.array(order)]


def _quantize_packed(model: nn.Module, params: dict) -> None:
    """Turn the layers whose weights stay packed into their quantised kind, with the file's bits."""
    packed = {k[: -len(".scales")]: params[k[: -len(".scales")] + ".weight"].shape[-1] * 32
              // (params[k].shape[-1] * 32) for k in params if k.endswith(".scales")}
    if not packed:
        return

    def predicate(path: str, module: nn.Module):
        if path in packed and hasattr(module, "to_quantized"):
            return {"group_size": 32, "bits": packed[path]}
        return False

    nn.quantize(model, class_predicate=predicate)
