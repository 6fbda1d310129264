"""Incremental detokenization with stop strings: the one helper `sample`, the API and the
server share (`generate.stream_generate`, `server.worker`)."""

from __future__ import annotations

from typing import Any, Sequence


def partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that could begin a stop string (to hold back)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """Feed token ids, get the text that can be shown now.

    `add(token)` returns new text (never a split character: the tokenizer's detokenizer holds
    incomplete ones), holding back only the longest end that may still begin a stop string.
    When a stop string appears, `stopped` becomes true and `add` returns the text before it;
    the stop string and anything after it are never returned. `finish()` returns what is
    still held (nothing after a stop). The pieces joined are the whole text up to the stop.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()):
        self._detok = tokenizer.detokenizer()
        self.stops = tuple(stops)
        self.stopped = False
        self._held = ""

    def add(self, token: int) -> str:
        if self.stopped:
            raise RuntimeError("TextStream.add after a stop string")
        held = self._held + self._detok.add(token)
        hit = min((held.find(s) for s in self.stops if s in held), default=-1)
        if hit >= 0:
            self._held, self.stopped = "", True
            return held[:hit]
        cut = len(held) - partial_stop(held, self.stops)
        self._held = held[cut:]
        return held[:cut]

    def finish(self) -> str:
        if self.stopped:
            return ""
        tail, self._held = self._held + self._detok.finalize(), ""
        return tail
