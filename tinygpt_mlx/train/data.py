"""Training data: the tokenized corpus plus synthetic needle documents, batch by batch.

Each batch row is `seq_len + 1` tokens. With probability `needle_fraction` a row starts with a
needle document (`tinygpt_mlx.corpus.make_needle_doc_tokens`, random template, value, depth
and length, sometimes with distractor facts) followed by its answer and then real text;
otherwise it is a random window of the tokenized corpus. A batch depends only on
(seed, step), so a resumed run sees exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from .. import corpus


@dataclass
class TrainData:
    tokens: np.ndarray          # training corpus token ids (uint16/uint32)
    filler: str                 # training text, the haystack for needle documents
    encode: object              # str -> list[int]
    eot_id: int

    def window(self, rng: random.Random, n: int) -> list[int]:
        start = rng.randrange(0, len(self.tokens) - n)
        return self.tokens[start:start + n].tolist()

    def needle_row(self, rng: random.Random, seq_len: int) -> tuple[list[int], tuple[int, int]]:
        """A needle document + answer + real text; also the answer's token span in the row."""
        n_doc = rng.randint(min(48, seq_len // 2), max(min(48, seq_len // 2), seq_len - 12))
        distractors = 0 if rng.random() < 0.5 else rng.randint(1, 3)
        n_doc = min(max(n_doc, 48 + 24 * distractors), seq_len - 12)  # room for the extra facts
        try:
            prompt, answer = corpus.make_needle_doc_tokens(
                rng, self.filler, self.encode, n_doc, distractors=distractors)
        except ValueError:  # the context is too short for this template: plain text instead
            return self.window(rng, seq_len + 1), (0, 0)
        return self._doc_row(rng, seq_len, prompt, answer, ".\n\n")

    def _doc_row(self, rng: random.Random, seq_len: int, prompt: str, answer: str,
                 end: str) -> tuple[list[int], tuple[int, int]]:
        """prompt + " " + answer + end, then real text to fill the row; the answer's span."""
        p = list(self.encode(prompt))
        a = list(self.encode(" " + answer))
        row = p + a + list(self.encode(end))
        rest = seq_len + 1 - len(row)
        if rest > 0:
            row += self.window(rng, rest)
        return row[:seq_len + 1], (len(p), min(len(p) + len(a), seq_len + 1))

    def keyed_row(self, rng: random.Random, seq_len: int) -> tuple[list[int], tuple[int, int]]:
        """One of KIV's limits as a training row (`corpus.make_task_doc`), 48 to seq_len - 64
        tokens: 2-6 keyed facts asked for one (35%), 2-4 asked for all (35%), or a phone book
        (30%); answers of 3-6 digits."""
        u = rng.random()
        task = "keyed" if u < 0.35 else "keyed-all" if u < 0.7 else "phonebook"
        facts = rng.randint(2, 6) if task == "keyed" else rng.randint(2, 4)
        template = rng.choice(sorted(corpus.ALL_QUESTIONS))
        n_doc = rng.randint(min(96, seq_len // 2), max(min(96, seq_len // 2), seq_len - 64))
        try:
            prompt, answer = corpus.fit_tokens(
                lambda n: corpus.make_task_doc(rng, self.filler, n, task, facts=facts, template=template,
                                               digits=rng.randint(3, 6)),
                rng, self.encode, n_doc)
        except ValueError:
            return self.window(rng, seq_len + 1), (0, 0)
        return self._doc_row(rng, seq_len, prompt, answer, "\n\n")

    def chat_row(self, rng: random.Random, seq_len: int) -> tuple[list[int], tuple[int, int]]:
        """A conversation in the plain chat format whose last question asks for a fact stated in
        an earlier user turn (`corpus.make_chat_doc`); the reply is the answer."""
        n_doc = rng.randint(min(96, seq_len // 2), max(min(96, seq_len // 2), seq_len - 32))
        try:
            prompt, answer = corpus.fit_tokens(
                lambda n: corpus.make_chat_doc(rng, self.filler, n), rng, self.encode, n_doc)
        except ValueError:
            return self.window(rng, seq_len + 1), (0, 0)
        return self._doc_row(rng, seq_len, prompt, answer, ".\n\n")

    def packed_needle_row(self, rng: random.Random, seq_len: int) -> tuple[list[int], list]:
        """Several short needle documents (24-192 tokens) with their answers, separated by
        <|endoftext|>, filling the row: many retrieval examples per row (a curriculum)."""
        row: list[int] = []
        spans = []
        tries = 0
        while len(row) < seq_len - 48 and tries < 40:
            tries += 1
            room = seq_len - len(row) - 10
            n_doc = min(room, rng.randint(40, 192))
            try:
                prompt, answer = corpus.make_needle_doc_tokens(rng, self.filler, self.encode, n_doc)
            except ValueError:  # too long a template for the room left: draw another
                continue
            p = list(self.encode(prompt))
            a = list(self.encode(" " + answer))
            spans.append((len(row) + len(p), len(row) + len(p) + len(a)))
            row += p + a + list(self.encode(".")) + [self.eot_id]
        row += self.window(rng, max(0, seq_len + 1 - len(row)))
        return row[:seq_len + 1], [(a, min(b, seq_len + 1)) for a, b in spans if a < seq_len + 1]

    def copy_row(self, rng: random.Random, seq_len: int, vocab_size: int,
                 max_span: int = 0) -> tuple[list[int], int]:
        """A span repeated until the row is full: every token after the first copy is predictable
        only by looking back one span length (the dense signal that forms induction heads).
        Half the spans are real text, half uniformly random tokens. Returns the row and the
        length of the first copy (whose targets, unpredictable for random spans, weigh 0)."""
        n = rng.randint(8, max(8, min(max_span or seq_len // 2, seq_len // 2)))
        if rng.random() < 0.5:
            span = self.window(rng, n)
        else:
            span = [rng.randrange(vocab_size) for _ in range(n)]
            span = [t if t != self.eot_id else (t + 1) % vocab_size for t in span]
        row = (span * (seq_len // n + 2))[:seq_len + 1]
        return row, n

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int,
              needle_fraction: float, answer_weight: float = 1.0,
              pack_fraction: float = 0.0, copy_fraction: float = 0.0,
              vocab_size: int = 0, copy_span: int = 0, keyed_fraction: float = 0.0,
              chat_fraction: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """(rows [B, seq_len+1], loss weights [B, seq_len] for the targets rows[:, 1:]).

        Targets that are needle answers weigh `answer_weight`, all others 1. Of the needle
        rows, `pack_fraction` are packed with several short needle documents. A further
        `copy_fraction` of the rows are repeated spans (`copy_row`) of 8 to `copy_span` tokens
        (0: up to half the row), `keyed_fraction` are several keyed facts or a phone book
        (`keyed_row`) and `chat_fraction` conversations that ask for an earlier turn's fact
        (`chat_row`)."""
        rng = random.Random(seed * 1_000_003 + step)
        rows = []
        weights = np.ones((batch_size, seq_len), dtype=np.float32)
        for i in range(batch_size):
            u = rng.random()
            if copy_fraction and u >= 1.0 - copy_fraction:
                row, n = self.copy_row(rng, seq_len, vocab_size or int(self.tokens.max()) + 1, copy_span)
                rows.append(row)
                weights[i, :n - 1] = 0.0
            elif u < needle_fraction + keyed_fraction + chat_fraction:
                if u >= needle_fraction + keyed_fraction:
                    row, span = self.chat_row(rng, seq_len)
                    spans = [span]
                elif u >= needle_fraction:
                    row, span = self.keyed_row(rng, seq_len)
                    spans = [span]
                elif pack_fraction and rng.random() < pack_fraction:
                    row, spans = self.packed_needle_row(rng, seq_len)
                else:
                    row, span = self.needle_row(rng, seq_len)
                    spans = [span]
                rows.append(row)
                for a, b in spans:
                    if b > a:
                        weights[i, a - 1:b - 1] = answer_weight
            else:
                rows.append(self.window(rng, seq_len + 1))
        return np.asarray(rows, dtype=np.int64), weights


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Non-overlapping windows of `seq_len + 1` tokens from the start of `tokens`."""
    n = min(max_windows, (len(tokens) - 1) // seq_len)
    if n < 1:
        raise ValueError(f"held-out text too short: {len(tokens)} tokens for seq_len {seq_len}")
    return np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64)


def needle_eval_rows(filler: str, encode, seq_len: int, n: int, seed: int = 1234):
    """`n` pass-key documents on held-out filler: (rows [n, seq_len+1], answer spans)."""
    rng = random.Random(seed)
    rows, spans = [], []
    for i in range(n):
        try:
            prompt, answer = corpus.make_needle_doc_tokens(
                rng, filler, encode, seq_len - 8, depth=i / max(1, n - 1),
                template=corpus.PASSKEY_TEMPLATE, value=corpus.random_value(rng, 5))
        except ValueError:  # context too short for a pass-key document
            return np.zeros((0, seq_len + 1), dtype=np.int64), []
        p = list(encode(prompt))
        a = list(encode(" " + answer))
        row = (p + a + [0] * (seq_len + 1))[:seq_len + 1]
        rows.append(row)
        spans.append((len(p), len(p) + len(a)))
    return np.asarray(rows, dtype=np.int64), spans


def unigram_loss(train_tokens: np.ndarray, heldout_tokens: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of an add-one unigram model fitted on the training tokens."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout_tokens].mean())
