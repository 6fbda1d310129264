"""The warm slot pool: KV caches kept between requests, keyed by the tokens they hold.

A slot's `tokens` are exactly the tokens whose K/V its cache has seen (prompt + generated,
minus the last sampled token, which is never fed). For a new prompt the pool picks:

1. **extend** — a slot whose tokens are a prefix of the prompt: only the new tail is prefilled.
2. **roll back** — a slot sharing a prefix of at least `MIN_REUSE` tokens with the prompt
   (regenerate, edited last message): the cache is trimmed to the shared prefix where it can
   be (`KVCache.trimmable`: a full cache, KIVI's exact residual), else it is **restored** from
   its latest checkpoint within the shared prefix (StreamingLLM, KIVI, retrieval: see below),
   and only the rest is prefilled, when the rollback discards no more than it reuses (what is
   kept covers >= half the slot, `ROLLBACK_KEEP`). A request that only shares a chat-template
   header therefore never destroys a long conversation.
3. **new** — otherwise a free slot.
4. With no free slot, a request that is mostly one slot's conversation (prefix >= half of the
   prompt: regenerate after a long answer) rolls that slot back rather than evicting another.
5. **evict** — the least-recently-used slot, except that the slot holding the longest context
   (the main chat) is protected while there is another slot.
6. **Small-request rule:** a prompt of fewer than `small_tokens` tokens (UI background work:
   titles, tags, follow-up suggestions) never evicts a slot holding `small_tokens` or more
   (a real conversation); when every evictable slot is such a conversation it runs in a
   scratch cache that is dropped afterwards (prefilling a short prompt is cheap anyway).

7. **Pre-warmed slots** (`serve --prompt-cache FILE`): a slot loaded from a prompt-cache file
   holds the file's tokens and cache and is *reserved* for that document: it is never a victim
   of eviction (so no request, small or large, evicts it; requests about other things use the
   other slots, or a scratch cache when every slot is reserved). A prompt that starts with the
   slot's tokens extends it (rule 1). Once a conversation has extended it, a prompt that starts
   with the file's tokens but not with the slot's (another question about the document) rolls a
   slot back when that reuses more than the file holds (trimmable caches), else reloads the
   document's slot from the file (`reload`: one file load, no prefill of the document).

**Checkpoints.** A cache that cannot be trimmed that far (a window or hot window has evicted
what it held; KIVI's frozen blocks cannot be cut token by token) keeps checkpoints instead:
at the end of each prompt the slot takes `KVCache.checkpoint()` (the bounded parts held in
memory, append-only parts as lengths: cache/checkpoint.py) with the logits after the prompt, the
last `checkpoints` of them. A request that diverges after one restores it and prefills only from
there; a request equal to a checkpointed prompt (regenerate) restores it and samples from its
logits with nothing prefilled. A request that diverges from a slot with no checkpoint to restore
is prefilled in a free, scratch or evicted slot, never in place of the conversation it diverged
from.

Otherwise at least one prompt token is prefilled (the logits for the first new token come from
it), so a prompt equal to a slot's tokens rolls back one token (or rebuilds).
**Busy slots.** The server runs several requests at once (worker.py); each holds its slot
(`acquire(hold=True)`) until `release`, and no other request picks a busy slot for any rule
above: with every slot busy a request runs in a scratch cache. A request that continues a busy
slot's running prompt waits for it instead (`waits_for`); one that starts with a busy pre-warmed
slot's document gets the file loaded again into a scratch cache (`reload`, slot -1).

All methods run on the single generation worker; `describe` may be read from other threads.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..cache import make_cache
from .config import ServerConfig

_DEFAULTS = ServerConfig()

MIN_REUSE = 4
ROLLBACK_KEEP = 0.5


@dataclass
class Slot:
    index: int                       # -1 for a scratch slot
    cache: Any = None
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0
    uses: int = 0
    source: Optional["Source"] = None   # a pre-warmed slot's file: the slot is reserved for it
    # (KVCache.checkpoint(), logits after its last token), oldest first, at most the pool's
    # `checkpoints`; each at a length where `tokens` has not changed since it was taken
    checkpoints: list = field(default_factory=list)
    #: the prompt of the request running on this slot now (`acquire(hold=True)`), None when idle:
    #: a busy slot is no one else's to extend, roll back or evict until `release`
    running: Optional[list[int]] = None

    @property
    def busy(self) -> bool:
        return self.running is not None

    @property
    def checkpoint_bytes(self) -> int:
        return sum(cp.nbytes for cp, _ in self.checkpoints)

    @property
    def free(self) -> bool:
        return self.cache is None


@dataclass(frozen=True)
class Source:
    """The prompt-cache file a pre-warmed slot was loaded from, and the tokens it holds."""
    path: str
    tokens: tuple[int, ...]


@dataclass
class Lease:
    """What `acquire` decided: the slot, how many prompt tokens its cache already holds."""
    slot: Slot
    reused: int
    action: str                      # "extend", "rollback", "restore", "reload", "new", "evict", "scratch"
    restored: int = 0                # of `reused`, the tokens a checkpoint restored
    logits: Any = None               # restored with the whole prompt: sample from these, prefill nothing


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def held_bytes(cache: Any) -> dict:
    """A cache's bytes from one walk of its stores: total, per part, and memory-mapped on disk
    (the parts ending in "_disk"; `KVCache.nbytes` and `disk_nbytes` each walk them again)."""
    parts = cache.nbytes_breakdown()
    return {"cache_bytes": sum(parts.values()), "cache_bytes_breakdown": parts,
            "cache_disk_bytes": sum(v for k, v in parts.items() if k.endswith("_disk"))}


class SlotPool:
    def __init__(self, model: Any, cache_config: Any, max_slots: int = _DEFAULTS.max_slots,
                 small_tokens: int = _DEFAULTS.small_request, loader: Any = None,
                 checkpoints: int = _DEFAULTS.slot_checkpoints):
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.model, self.cache_config = model, cache_config
        self.small_tokens = small_tokens
        self.slots = [Slot(i) for i in range(max_slots)]
        self.loader = loader             # path -> (cache, tokens): reloads a pre-warmed slot
        self.checkpoints = checkpoints   # kept per slot (module doc); 0: none
        self.scratch: list[Slot] = []    # scratch slots of running requests (their bytes count in `memory`)
        self._lock = threading.Lock()

    def prewarm(self, path: str, cache: Any, tokens: list[int]) -> Slot:
        """Reserve a free slot for a prompt-cache file: it holds `cache` (loaded from `path`)
        and the file's `tokens`. Raises ValueError when no free slot is left."""
        with self._lock:
            slot = self._free_slot()
            if slot is None:
                raise ValueError(f"{path}: no slot left for this prompt cache ({len(self.slots)} slot(s), "
                                 "one per --prompt-cache file; raise --max-slots)")
            slot.cache, slot.tokens, slot.source = cache, list(tokens), Source(str(path), tuple(tokens))
            return slot

    def restore(self, cache: Any, tokens: list[int]) -> Optional[Slot]:
        """Put a saved conversation (`serve --slot-dir`) in a free slot, as if it had just been
        served there (an ordinary slot: evictable, extendable). None when no slot is free."""
        with self._lock:
            slot = self._free_slot()
            if slot is None:
                return None
            slot.cache, slot.tokens = cache, list(tokens)
            self._touch(slot)
            return slot

    def conversations(self) -> list[Slot]:
        """The slots holding a conversation of their own (not pre-warmed documents, not empty):
        what `serve --slot-dir` saves at shutdown."""
        with self._lock:
            return [s for s in self.slots if s.cache is not None and s.tokens and s.source is None]

    def _free_slot(self) -> Optional[Slot]:
        """The first slot holding nothing and reserved for no prompt-cache file."""
        return next((s for s in self.slots if s.free and s.source is None and not s.busy), None)

    def _fresh(self, slot: Slot) -> None:
        """Give `slot` a new cache (an evicted slot's cache is closed: disk stores removed)."""
        self._drop(slot)
        slot.cache = make_cache(self.model, self.cache_config)

    @staticmethod
    def _drop(slot: Slot) -> None:
        if slot.cache is not None:
            slot.cache.close()
        slot.cache, slot.tokens, slot.checkpoints = None, [], []

    def _touch(self, slot: Slot) -> None:
        slot.last_used = time.monotonic()
        slot.uses += 1

    def acquire(self, prompt: list[int], hold: bool = False) -> Lease:
        """The slot for `prompt` (module doc). With `hold` (the server's scheduler, which runs
        several requests at once) the slot is the request's until `release`: no other request
        extends, rolls back, restores or evicts it meanwhile."""
        with self._lock:
            lease = self._choose(prompt)
            self._touch(lease.slot)
            if hold:
                lease.slot.running = list(prompt)
                if lease.slot.index < 0:
                    self.scratch.append(lease.slot)
            return lease

    def waits_for(self, prompt: list[int], text: Optional[str] = None, tokenizer: Any = None) -> Optional[int]:
        """The busy slot whose running prompt `prompt` begins with (the conversation's next turn,
        or the same request again), or whose text `text` begins with (see `splice`; with the
        `tokenizer`), or None: such a request is better served by that slot's cache once it is
        released (extended, or restored from its checkpoint) than by a cold prefill elsewhere now."""
        with self._lock:
            for s in self.slots:
                if not s.busy or len(s.running) < MIN_REUSE:
                    continue
                if prompt[:len(s.running)] == s.running:
                    return s.index
                if text is not None and tokenizer is not None:
                    done = tokenizer.decode(s.running)
                    if "\ufffd" not in done and text.startswith(done):
                        return s.index
            return None

    def _choose(self, prompt: list[int]) -> Lease:
        limit = len(prompt) - 1           # keep at least one token to prefill
        best, best_n = None, 0
        for s in self.slots:
            if s.free or s.busy:
                continue
            n = common_prefix(s.tokens, prompt)
            if n > best_n:
                best, best_n = s, n
        keep = min(best_n, limit)
        if best is not None and keep >= MIN_REUSE and keep == len(best.tokens):
            return Lease(best, keep, "extend")
        # a prompt that starts with a pre-warmed document whose slot has moved on: roll a slot back
        # if that reuses more than the file holds, else reload the document's slot from its file
        src = max((s for s in self.slots if s.source is not None and self.loader is not None and not s.busy
                   and len(s.source.tokens) <= limit and tuple(prompt[:len(s.source.tokens)]) == s.source.tokens),
                  key=lambda s: len(s.source.tokens), default=None)
        if best is not None and keep >= MIN_REUSE and (src is None or keep > len(src.source.tokens)):
            lease = self._roll_back(best, best_n, prompt, ROLLBACK_KEEP * len(best.tokens))
            if lease is not None:
                return lease
        if src is not None:
            self._drop(src)
            src.cache, tokens = self.loader(src.source.path)
            src.tokens = list(tokens)
            return Lease(src, len(src.tokens), "reload")
        # the document's slot is busy with another request: load the file again into a scratch cache
        # (one file load, no prefill of the document) rather than prefilling it cold
        busy_src = max((s for s in self.slots if s.source is not None and self.loader is not None and s.busy
                        and len(s.source.tokens) <= limit and tuple(prompt[:len(s.source.tokens)]) == s.source.tokens),
                       key=lambda s: len(s.source.tokens), default=None)
        if busy_src is not None and len(busy_src.source.tokens) >= MIN_REUSE:
            scratch = Slot(-1)
            scratch.cache, tokens = self.loader(busy_src.source.path)
            scratch.tokens = list(tokens)
            return Lease(scratch, len(scratch.tokens), "reload")
        free = self._free_slot()
        if free is not None:
            self._fresh(free)
            return Lease(free, 0, "new")
        # no free slot: a request that is mostly this slot's conversation (regenerate after a long
        # answer) rolls it back rather than evicting another conversation
        if best is not None:
            lease = self._roll_back(best, best_n, prompt, ROLLBACK_KEEP * len(prompt))
            if lease is not None:
                return lease
        open_ = [s for s in self.slots if s.source is None]       # pre-warmed slots are reserved
        victims = sorted((s for s in open_ if not s.busy), key=lambda s: s.last_used)
        if len(open_) > 1:
            longest = max(open_, key=lambda s: len(s.tokens))
            victims = [s for s in victims if s is not longest]
        if len(prompt) < self.small_tokens:
            victims = [s for s in victims if len(s.tokens) < self.small_tokens]
        if not victims:
            scratch = Slot(-1)
            self._fresh(scratch)
            return Lease(scratch, 0, "scratch")
        victim = victims[0]
        self._fresh(victim)
        return Lease(victim, 0, "evict")

    def _roll_back(self, slot: Slot, common: int, prompt: list[int], least: float) -> Optional[Lease]:
        """Roll `slot` back to reuse what it shares with `prompt` (`common` tokens), keeping at
        least `least` tokens: trimmed where its cache can forget that many (`trimmable`), else
        restored from its latest checkpoint within the shared prefix. None when neither can."""
        keep = min(common, len(prompt) - 1)
        n = len(slot.tokens) - keep
        fits = [c for c in slot.checkpoints if c[0].length <= min(common, len(prompt))]
        # a checkpoint that reuses as much as trimming would is restored instead (it is the
        # slot's exact state then, where a trimmed KIVI residual froze differently)
        if keep >= max(least, MIN_REUSE) and n <= slot.cache.trimmable() and not (fits and fits[-1][0].length >= keep):
            if n > 0 and slot.cache.trim(n) != n:   # not expected: its state is unknown now
                self._drop(slot)
                return None
            del slot.tokens[keep:]
            slot.checkpoints = [c for c in slot.checkpoints if c[0].length <= keep]
            return Lease(slot, keep, "rollback")
        if not fits or fits[-1][0].length < max(least, MIN_REUSE):
            return None
        cp, logits = fits[-1]
        slot.cache.restore(cp)
        del slot.tokens[cp.length:]
        slot.checkpoints = fits
        return Lease(slot, cp.length, "restore", cp.length, logits if cp.length == len(prompt) else None)

    def checkpoint(self, slot: Slot, logits: Any) -> None:
        """`slot`'s cache holds exactly its prompt now (with `logits` after it): keep a checkpoint
        of it when its cache could not be rolled back here otherwise (module doc)."""
        if self.checkpoints <= 0 or slot.index < 0 or slot.cache.trimmable() >= len(slot.tokens):
            return
        cp = slot.cache.checkpoint()
        if cp is None:
            return
        with self._lock:
            kept = [c for c in slot.checkpoints if c[0].length < cp.length] + [(cp, logits)]
            slot.checkpoints = kept[-self.checkpoints:]

    def splice(self, text: str, tokenizer: Any) -> Optional[list[int]]:
        """Prompt ids that extend a slot: its own tokens + the encoding of the rest of `text`.

        Re-encoding a conversation rarely reproduces the exact tokens the model generated (BPE
        merges differ at the answer's edges, a stop string ends mid-token), and a cache that
        cannot be trimmed (StreamingLLM, KIVI, retrieval) could then not be reused at all. When
        the text of a slot's tokens begins the prompt text, the prompt is that slot's tokens
        followed by the rest, so the slot is extended. Only for tokenizers whose decoding is
        exact and whose encoding adds no special tokens (native byte-level BPE).
        """
        with self._lock:
            best: Optional[tuple[int, list[int]]] = None
            held = [s.tokens for s in self.slots if not s.free and s.tokens and not s.busy]
            held += [list(s.source.tokens) for s in self.slots if s.source is not None and not s.busy]
            for tokens in held:
                done = tokenizer.decode(tokens)
                if "\ufffd" in done or not text.startswith(done):
                    continue
                if best is None or len(done) > best[0]:
                    best = (len(done), tokens)
            if best is None:
                return None
            return list(best[1]) + (tokenizer.encode(text[best[0]:]) if text[best[0]:] else [])

    def invalidate(self, slot: Slot) -> None:
        """Forget a slot whose cache state is unknown (an error in the middle of a step)."""
        with self._lock:
            self._drop(slot)

    def release(self, slot: Slot) -> None:
        """The job on `slot` is over: a scratch slot's cache is closed, a pool slot stays warm
        (and is free for other requests again)."""
        with self._lock:
            slot.running = None
            if slot.index < 0:
                self._drop(slot)
                self.scratch = [s for s in self.scratch if s is not slot]

    def close(self) -> None:
        """Close every slot's cache (server shutdown: disk stores removed)."""
        with self._lock:
            for s in self.slots:
                self._drop(s)

    def describe(self) -> list[dict]:
        with self._lock:
            out = []
            for s in self.slots:
                d = {"slot": s.index, "tokens": len(s.tokens), "uses": s.uses, "busy": s.busy}
                if s.source is not None:
                    d["prompt_cache"] = s.source.path
                if s.cache is not None:
                    d.update(stored=s.cache.stored_count, **held_bytes(s.cache))
                if s.checkpoints:
                    d.update(checkpoints=[cp.length for cp, _ in s.checkpoints], checkpoint_bytes=s.checkpoint_bytes)
                out.append(d)
            return out

    @property
    def cache_bytes(self) -> int:
        return sum(d.get("cache_bytes", 0) for d in self.describe())

    def memory(self) -> dict:
        """Bytes the slots' caches hold, all slots together (and the scratch caches of requests
        running now): total, memory-mapped on disk, in RAM,
        and per part (sink, body, residual, cold, cold_summary...; "_disk" parts are mapped); and
        what the slots' checkpoints hold besides (in RAM)."""
        parts: dict[str, int] = {}
        total = disk = checkpoints = 0
        with self._lock:
            scratch = [held_bytes(s.cache) for s in self.scratch if s.cache is not None]
        for d in self.describe() + scratch:
            total += d.get("cache_bytes", 0)
            disk += d.get("cache_disk_bytes", 0)
            checkpoints += d.get("checkpoint_bytes", 0)
            for k, v in d.get("cache_bytes_breakdown", {}).items():
                parts[k] = parts.get(k, 0) + v
        return {"cache_bytes": total, "cache_disk_bytes": disk, "cache_ram_bytes": total - disk,
                "cache_bytes_breakdown": parts, "checkpoint_bytes": checkpoints}
