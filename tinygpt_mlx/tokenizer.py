"""One tokenizer interface over a native `.tinygpt` tokenizer (HF `tokenizers` byte-level BPE)
and an mlx-lm `TokenizerWrapper`, with incremental detokenization that never splits a
multi-byte character.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from tokenizers import Tokenizer as HFTokenizer

from .chat_template import render

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>")


class ByteDetokenizer:
    """Streams text from a byte-level BPE: holds tokens back while they end mid-character."""

    def __init__(self, decode):
        self._decode = decode
        self._pending: list[int] = []

    def add(self, token: int) -> str:
        self._pending.append(token)
        text = self._decode(self._pending)
        if text.endswith("\ufffd"):
            return ""
        self._pending = []
        return text

    def finalize(self) -> str:
        text = self._decode(self._pending) if self._pending else ""
        self._pending = []
        return text


class MlxDetokenizer:
    """Adapter over mlx-lm's streaming detokenizer (handles SentencePiece spacing)."""

    def __init__(self, detok):
        self._d = detok
        self._d.reset()

    def add(self, token: int) -> str:
        self._d.add_token(token)
        return self._d.last_segment

    def finalize(self) -> str:
        self._d.finalize()
        return self._d.last_segment


class Tokenizer:
    """encode / decode / eos_ids / detokenizer() / chat prompt, whatever the model kind."""

    def __init__(self, native: Any = None, wrapper: Any = None):
        if (native is None) == (wrapper is None):
            raise TypeError("give exactly one of native= or wrapper=")
        self._native, self._wrapper = native, wrapper
        if native is not None:
            vocab = native.get_vocab()
            self.eos_ids = {vocab[n] for n in EOS_NAMES if n in vocab}
            self.vocab_size = native.get_vocab_size()
        else:
            self.eos_ids = set(wrapper.eos_token_ids)
            self.vocab_size = len(wrapper.vocab) if hasattr(wrapper, "vocab") else None

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        return cls(native=HFTokenizer.from_str(text))

    @property
    def splices_exactly(self) -> bool:
        """Whether decoding is exact and encoding adds no special tokens, so that a text may be
        encoded piecewise at any point where a decoded token sequence ends (the server extends a
        warm slot this way): true for the native byte-level BPE, not assumed for mlx-lm's."""
        return self._native is not None

    @property
    def kind(self) -> str:
        return "byte-level BPE (tokenizers)" if self._native is not None else type(self._wrapper._tokenizer).__name__

    def encode(self, text: str) -> list[int]:
        if self._native is not None:
            return self._native.encode(text, add_special_tokens=False).ids
        return list(self._wrapper.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        if self._native is not None:
            return self._native.decode(ids, skip_special_tokens=False)
        return self._wrapper.decode(ids)

    def detokenizer(self):
        if self._native is not None:
            return ByteDetokenizer(self.decode)
        return MlxDetokenizer(self._wrapper.detokenizer)

    def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt text for a chat: the model's own template, or the documented plain one
        (`tinygpt_mlx.chat`, the helper `sample`, `chat` and the server share)."""
        return render(self, messages)

    @property
    def eos_id(self) -> Optional[int]:
        return min(self.eos_ids) if self.eos_ids else None
