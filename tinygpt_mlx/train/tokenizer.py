"""Training the byte-level BPE tokenizer stored in every `.tinygpt` file.

Byte-level BPE (any UTF-8 text round-trips) with digits split one per token, so that numbers
are copied digit by digit (the needle answers), and one special token, `<|endoftext|>`.
"""

from __future__ import annotations

from typing import Iterable

from ..corpus import EOT


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):
    """Train and return a `tokenizers.Tokenizer` on `texts` (an iterable of strings)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_batch(tok, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
