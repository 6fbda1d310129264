"""The GGUF tokenizer as the loader built it before tinygpt_mlx/ggml/tokenizer_cache.py (session 45's
ggml/tokenizer.py: transformers' converter at every call), kept as the reference the cached
tokenizer is compared with (tests/test_tokenizer_cache.py, tests/test_gemma3.py), and the
comparison itself."""

from __future__ import annotations

import json

from tests.conftest import TEXT

TEXTS = ["The quick brown fox, naïve café 東京 🙂\n\tend  two", "<|endoftext|>word<|endoftext|> x",
         "  leading spaces and trailing  ", "0123456789 " * 3, TEXT[:300], ""]


def reference_tokenizer(md: dict, source: str):
    """The loader's tokenizer as it was built before the cache (session 45's ggml/tokenizer.py):
    transformers' converter every time, its Tokenizer handed over, the decoder read from it."""
    from mlx_lm import tokenizer_utils as tu
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    from tinygpt_mlx.ggml.arch import scalar
    from tinygpt_mlx.ggml.tokenizer import streaming_detokenizer

    values = {k: scalar(v) for k, v in md.items() if k.startswith("tokenizer.")}
    groups = {group: {name: values[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in values} for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tok_dict, tok_config = groups["tokenizer"], groups["tokenizer_config"]
    if tok_dict.get("tokenizer_type") == "llama":
        tok_config.setdefault("add_bos_token", True)
    tokens = tok_dict["tokens"]
    for name, key in {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                      "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}.items():
        token_id = values.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            tok_config[name] = tokens[int(token_id)]
    convert = getattr(mapping.convert_gguf_tokenizer, "real", mapping.convert_gguf_tokenizer)   # uncounted
    backend, extra = convert(str(scalar(md.get("general.architecture", ""))), tok_dict)
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config, **extra)
    eos = sorted({int(values[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                          "tokenizer.ggml.eom_token_id") if values.get(k) is not None})
    decoder = json.loads(backend.to_str()).get("decoder")
    return tu.TokenizerWrapper(hf, streaming_detokenizer(decoder), eos_token_ids=eos)


def streamed(wrapper, ids) -> str:
    d = wrapper.detokenizer
    d.reset()
    for i in ids:
        d.add_token(i)
    d.finalize()
    return d.text


def assert_same(ours, ref, texts=TEXTS):
    """Encodes, decodes, streams and describes itself as the reference does."""
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert ours.get_vocab() == ref.get_vocab() and len(ours) == len(ref)
    assert ours.all_special_tokens == ref.all_special_tokens
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "chat_template"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.eos_token_ids == ref.eos_token_ids
    assert type(ours._detokenizer) is type(ref._detokenizer)
    assert getattr(ours._detokenizer, "trim_space", None) == getattr(ref._detokenizer, "trim_space", None)
    for text in texts:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert streamed(ours, ids) == streamed(ref, ids)
