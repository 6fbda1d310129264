"""The tokenizer a GGUF file describes, as a Hugging Face fast tokenizer inside mlx-lm's wrapper.

A GGUF has no `tokenizer.json`: the vocabulary, merges or scores, token types, special ids, the
add-BOS flag and the chat template are metadata under llama.cpp's key names. transformers'
GGUF tokenizer converter (`convert_gguf_tokenizer`) rebuilds the fast tokenizer each kind
describes, GPT-2 byte-level BPE with the pre-tokenizer the file names (`tokenizer.ggml.pre`) and
SentencePiece / llama with byte fallback included; we feed it the metadata MLX already read
(so the file is parsed once) and wrap the result the way mlx-lm wraps a tokenizer directory.
The converter's result is kept in the process and on disk (`tokenizer_cache.py`): a file's
tokenizer is converted once, not at every load (Gemma 3's 262,144 tokens took most of a
`sample`'s start-up; docs/gguf.md, "Start-up").
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Optional

from ..errors import ModelFormatError
from . import tokenizer_cache
from .arch import scalar

_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
# Ids that end a turn besides EOS (llama.cpp's end-of-turn / end-of-message tokens).
_END_IDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def tokenizer_from_metadata(md: dict, source: str, gguf: Optional[Path] = None):
    """mlx-lm's `TokenizerWrapper` over the fast tokenizer this metadata describes; `gguf`, the
    file it was read from, lets the converted tokenizer be kept on disk (`tokenizer_cache`)."""
    import tokenizers   # noqa: PLC0415 (heavy, as transformers)
    import transformers   # noqa: PLC0415
    from mlx_lm import tokenizer_utils as tu   # noqa: PLC0415 (heavy: transformers)
    from transformers import PreTrainedTokenizerFast   # noqa: PLC0415
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping   # noqa: PLC0415

    if "tokenizer.ggml.tokens" not in md:
        raise ModelFormatError(f"{source}: the GGUF holds no tokenizer (no tokenizer.ggml.tokens)")
    values = {k: scalar(v) for k, v in md.items() if k.startswith("tokenizer.")}
    groups = {group: {name: values[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in values}
              for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()}
    tok_dict, tok_config = groups["tokenizer"], groups["tokenizer_config"]
    if tok_dict.get("tokenizer_type") == "llama":
        tok_config.setdefault("add_bos_token", True)   # llama.cpp's default for SentencePiece files
    tokens = tok_dict["tokens"]
    for name, key in _SPECIAL.items():
        token_id = values.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            tok_config[name] = tokens[int(token_id)]
    architecture = str(scalar(md.get("general.architecture", "")))

    def convert():
        try:
            return mapping.convert_gguf_tokenizer(architecture, tok_dict)
        except (KeyError, ValueError, TypeError, NotImplementedError) as e:
            raise ModelFormatError(f"{source}: cannot build its tokenizer "
                                   f"({tok_dict.get('tokenizer_type')!r}: {e})") from None

    versions = f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}"
    got = tokenizer_cache.converted(architecture, tok_dict, versions, convert, gguf)
    hf = None
    if got.file is not None:   # read by tokenizers itself: no copy of a Tokenizer object made
        try:
            hf = PreTrainedTokenizerFast(tokenizer_file=str(got.file), **tok_config, **got.extra)
        except Exception:      # noqa: BLE001 (removed since it was checked: from the bytes below)
            hf = None
    if hf is None:
        backend = got.backend if got.backend is not None else tokenizers.Tokenizer.from_str(got.json.decode("utf-8"))
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config, **got.extra)
    eos = sorted({int(values[k]) for k in _END_IDS if values.get(k) is not None})
    decoder = hf.backend_tokenizer.decoder
    decoder = json.loads(decoder.__getstate__()) if decoder is not None else None
    return tu.TokenizerWrapper(hf, streaming_detokenizer(decoder), eos_token_ids=eos)


def streaming_detokenizer(decoder: Optional[dict]):
    """mlx-lm's streaming detokenizer class for a fast tokenizer's decoder (its JSON form), as
    mlx-lm chooses one for a tokenizer directory."""
    from mlx_lm import tokenizer_utils as tu   # noqa: PLC0415 (heavy: transformers)

    if tu._is_spm_decoder(decoder):
        return tu.SPMStreamingDetokenizer
    if tu._is_spm_decoder_no_space(decoder):
        return partial(tu.SPMStreamingDetokenizer, trim_space=False)
    if tu._is_bpe_decoder(decoder):
        return tu.BPEStreamingDetokenizer
    return tu.NaiveStreamingDetokenizer
