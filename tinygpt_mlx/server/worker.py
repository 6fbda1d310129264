"""The generation worker: one thread, a FIFO queue of jobs, warm slots, cancellation.

Every job runs to completion (or cancellation) before the next starts; jobs are never
dropped. A job reports to its HTTP handler through an asyncio queue on the server's loop:
("text", str) pieces as they are detokenized (stop strings held back, never sent),
then ("done", Result) or ("error", message).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from ..generate import forward, prefill
from ..sampling import make_sampler
from .config import ServerConfig
from .slots import SlotPool

log = logging.getLogger("posttrainllm.server")


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could begin a stop string (held back)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class _Cancelled(Exception):
    """Raised between prefill chunks when the client has gone away."""


@dataclass
class Result:
    prompt_tokens: int = 0           # the whole prompt
    prefilled_tokens: int = 0        # only the tokens prefilled for this request
    reused_tokens: int = 0           # prompt tokens served from a warm slot
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as fed (see Job.text)
    tokens: list[int] = field(default_factory=list)   # generated ids (stop/eos excluded)
    text: str = ""
    done_reason: str = "length"      # "stop" or "length" ("cancel" internally)
    slot: int = -1
    slot_action: str = ""
    queue_ns: int = 0
    load_ns: int = 0
    prompt_eval_ns: int = 0
    eval_ns: int = 0
    total_ns: int = 0


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    max_context: Optional[int] = None   # stop with "length" when the context reaches this
    max_prompt: Optional[int] = None    # the prompt budget (context - reserve), for the splice below
    # The prompt's text, when `ids` is its plain encoding: a slot whose decoded tokens begin the
    # text is extended with its own tokens (see SlotPool.splice) instead of the re-encoding.
    text: Optional[str] = None
    loop: Optional[asyncio.AbstractEventLoop] = None
    events: Optional[asyncio.Queue] = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.perf_counter)

    def emit(self, kind: str, payload: Any) -> None:
        if self.loop is None or self.events is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:         # the event loop is gone (server shutting down)
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class Worker:
    def __init__(self, loaded: Any, pool: SlotPool, prefill_chunk: int = ServerConfig().prefill_chunk):
        self.loaded, self.pool, self.prefill_chunk = loaded, pool, prefill_chunk
        self.queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.busy = False
        self.current: Optional[Job] = None
        self.completed = 0
        self.recent: "collections.deque[dict]" = collections.deque(maxlen=32)   # for /api/slots
        self._thread = threading.Thread(target=self._run, name="posttrainllm-generate", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.queue.put(job)

    @property
    def pending(self) -> int:
        return self.queue.qsize()

    def stop(self) -> None:
        """Cancel the running and queued jobs, then end the thread (server shutdown)."""
        if self.current is not None:
            self.current.cancel()
        with self.queue.mutex:
            for job in self.queue.queue:
                if job is not None:
                    job.cancel()
        self.queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        # MLX streams are thread-local (mlx >= 0.31.2): the main thread's default GPU stream does
        # not exist here, so this thread makes its own and runs every job on it.
        with mx.stream(mx.new_stream(mx.default_device())):
            self._loop()

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            self.busy, self.current = True, job
            try:
                if job.cancelled.is_set():
                    result = Result(prompt_tokens=len(job.ids), prompt_ids=job.ids, done_reason="cancel",
                                    slot_action="skipped")
                else:
                    result = self._generate(job)
                self.recent.append({"slot": result.slot, "action": result.slot_action,
                                    "prompt_tokens": result.prompt_tokens, "prefilled": result.prefilled_tokens,
                                    "generated": len(result.tokens), "done_reason": result.done_reason})
                job.emit("done", result)
            except Exception as e:  # noqa: BLE001 — nothing may kill the worker
                log.exception("generation failed")
                job.emit("error", f"generation failed: {e}")
            finally:
                self.busy, self.current = False, None
                self.completed += 1

    def _generate(self, job: Job) -> Result:
        t_start = time.perf_counter()
        ids = self._prompt_ids(job)
        r = Result(prompt_tokens=len(ids), prompt_ids=ids, queue_ns=int((t_start - job.created) * 1e9))
        lease = self.pool.acquire(ids)
        slot = lease.slot
        r.slot, r.slot_action, r.reused_tokens = slot.index, lease.action, lease.reused
        tail = ids[lease.reused:]
        r.prefilled_tokens = len(tail)
        t0 = time.perf_counter()
        r.load_ns = int((t0 - t_start) * 1e9)

        def progress(done: int, total: int) -> None:
            slot.tokens = ids[:lease.reused + done]     # what the cache holds so far
            if job.cancelled.is_set() and done < total:
                raise _Cancelled()

        try:
            try:
                logits = prefill(self.loaded.model, tail, slot.cache, self.prefill_chunk, progress)
            except _Cancelled:
                r.done_reason = "cancel"
                return r
            t1 = time.perf_counter()
            r.prompt_eval_ns = int((t1 - t0) * 1e9)
            self._decode(job, slot, logits, r)
            r.eval_ns = int((time.perf_counter() - t1) * 1e9)
        except BaseException:
            self.pool.invalidate(slot)
            raise
        r.total_ns = int((time.perf_counter() - job.created) * 1e9)
        log.info("slot %d %s: prompt %d tokens (reused %d, prefilled %d), generated %d (%s)",
                 r.slot, r.slot_action, r.prompt_tokens, r.reused_tokens, r.prefilled_tokens,
                 len(r.tokens), r.done_reason)
        return r

    def _prompt_ids(self, job: Job) -> list[int]:
        if job.text is None or self.loaded.kind != "tinygpt":
            return job.ids
        spliced = self.pool.splice(job.text, self.loaded.tokenizer)
        if spliced is None:
            return job.ids
        room = job.max_prompt if job.max_prompt is not None else (
            job.max_context - 1 if job.max_context is not None else None)
        if room is not None and len(spliced) > room:
            return job.ids
        return spliced

    def _decode(self, job: Job, slot: Any, logits: mx.array, r: Result) -> None:
        tok = self.loaded.tokenizer
        eos = frozenset(tok.eos_ids)
        sampler = make_sampler(job.temperature, job.top_p, job.top_k, job.seed)
        detok = tok.detokenizer()
        stops = job.stop
        held, out, cut_by_stop = "", [], False
        r.done_reason = "length"
        for i in range(job.max_tokens):
            if job.cancelled.is_set():
                r.done_reason = "cancel"
                break
            token = int(sampler(logits[None])[0].item())
            if token in eos:
                r.done_reason = "stop"
                break
            r.tokens.append(token)
            held += detok.add(token)
            if stops:
                hit = min((held.find(s) for s in stops if s in held), default=-1)
                if hit >= 0:
                    held, cut_by_stop = held[:hit], True
                    r.done_reason = "stop"
                    break
            cut = len(held) - _partial_stop(held, stops)
            if cut > 0:
                out.append(held[:cut])
                job.emit("text", held[:cut])
                held = held[cut:]
            if i + 1 == job.max_tokens:
                break
            if job.max_context is not None and len(slot.tokens) + 1 >= job.max_context:
                break           # prompt + reply fill the context (the last token is never fed)
            logits = forward(self.loaded.model, mx.array([[token]]), slot.cache)[0, -1].astype(mx.float32)
            slot.tokens.append(token)
        tail = held if cut_by_stop else held + detok.finalize()
        if tail:
            out.append(tail)
            job.emit("text", tail)
        r.text = "".join(out)
