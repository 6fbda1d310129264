"""The generation worker: one thread, a FIFO queue of jobs, warm slots, cancellation.

Every job runs to completion (or cancellation) before the next starts; jobs are never
dropped. A job reports to its HTTP handler through an asyncio queue on the server's loop:
("text", str) pieces as they are detokenized (stop strings held back, never sent),
then ("done", Result) or ("error", message).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from ..generate import GenerationStats, Reply
from . import logprobs as lp
from .config import ServerConfig
from .slots import SlotPool, held_bytes

log = logging.getLogger("posttrainllm.server")


@dataclass
class Result:
    prompt_tokens: int = 0           # the whole prompt
    prefilled_tokens: int = 0        # only the tokens prefilled for this request
    reused_tokens: int = 0           # prompt tokens served from a warm slot
    restored_tokens: int = 0         # of those, the tokens a slot checkpoint restored
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as fed (see Job.text)
    tokens: list[int] = field(default_factory=list)   # generated ids (stop/eos excluded)
    logprobs: list[lp.TokenLogprob] = field(default_factory=list)   # per token, when asked for
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
    logprobs: Optional[int] = None      # report each token's log-probability and this many alternatives
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


class PrefillLog:
    """A long prefill is logged as it goes (tokens, tok/s, ETA), every `every` seconds and at
    its end, so a multi-minute first message is not silent."""

    every = 5.0

    def __init__(self, slot: int):
        self.slot = slot
        self.start = self.last = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every and done < total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        eta = (total - done) / rate if rate > 0 else float("inf")
        log.info("slot %d prefill: %d/%d tokens, %.1f tok/s, ETA %.0f s", self.slot, done, total, rate, eta)


def looping(tokens: list[int], span: int, max_period: int = 64) -> bool:
    """Whether the last `span` tokens repeat one n-gram of at most `max_period` tokens (a reply
    caught in a loop: "the the the", or a sentence said over and over)."""
    if len(tokens) < span:
        return False
    tail = tokens[-span:]
    return any(tail[p:] == tail[:-p] for p in range(1, min(max_period, span // 2) + 1))


class Worker:
    def __init__(self, loaded: Any, pool: SlotPool, prefill_chunk: int = ServerConfig().prefill_chunk,
                 stop_loops: int = 0):
        self.loaded, self.pool, self.prefill_chunk = loaded, pool, prefill_chunk
        self.stop_loops = stop_loops      # 0: off; else stop a reply whose last N tokens loop
        self.queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.busy = False
        self.current: Optional[Job] = None
        self.completed = 0
        self.recent: "collections.deque[dict]" = collections.deque(maxlen=32)   # for /api/slots
        self._thread = threading.Thread(target=self._run, name="posttrainllm-generate", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.queue.put(job)

    def call(self, fn: Any) -> Any:
        """Run `fn()` on the worker thread (its MLX stream) and return its result or raise its
        error: what the worker's jobs will use (pre-warmed slot caches) is made there."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.queue.put((fn, done))
        return done.result()

    @property
    def pending(self) -> int:
        return self.queue.qsize()

    def stop(self) -> None:
        """Cancel the running and queued jobs, then end the thread (server shutdown)."""
        if self.current is not None:
            self.current.cancel()
        with self.queue.mutex:
            for job in self.queue.queue:
                if isinstance(job, Job):
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
            if isinstance(job, tuple):            # call(): a function for this thread
                fn, done = job
                try:
                    done.set_result(fn())
                except BaseException as e:  # noqa: BLE001 — handed to the caller
                    done.set_exception(e)
                continue
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
        r.restored_tokens = lease.restored
        r.prefilled_tokens = len(ids) - lease.reused
        r.load_ns = int((time.perf_counter() - t_start) * 1e9)
        try:
            stats = self._decode(job, slot, ids[lease.reused:], r, lease.logits)
            held = held_bytes(slot.cache)
        except BaseException:
            self.pool.invalidate(slot)
            raise
        finally:
            self.pool.release(slot)
        r.done_reason = stats.finish_reason
        r.prompt_eval_ns, r.eval_ns = int(stats.prefill_seconds * 1e9), int(stats.decode_seconds * 1e9)
        r.total_ns = int((time.perf_counter() - job.created) * 1e9)
        total, disk = held["cache_bytes"], held["cache_disk_bytes"]
        cold = sum(v for k, v in held["cache_bytes_breakdown"].items() if k.startswith("cold"))
        restored = " restored from a checkpoint" if r.restored_tokens else ""
        kept = slot.checkpoint_bytes
        log.info("slot %d %s: prompt %d tokens (reused %d%s, prefilled %d), generated %d (%s); cache %.1f MiB%s%s",
                 r.slot, r.slot_action, r.prompt_tokens, r.reused_tokens, restored, r.prefilled_tokens,
                 len(r.tokens), r.done_reason, total / 2**20,
                 f" (cold store {cold / 2**20:.1f} MiB, {disk / 2**20:.1f} MiB memory-mapped on disk)" if cold else "",
                 f"; {len(slot.checkpoints)} checkpoint(s) {kept / 2**20:.1f} MiB" if slot.checkpoints else "")
        return r

    def _prompt_ids(self, job: Job) -> list[int]:
        if job.text is None or not self.loaded.tokenizer.splices_exactly:
            return job.ids
        spliced = self.pool.splice(job.text, self.loaded.tokenizer)
        if spliced is None:
            return job.ids
        room = job.max_prompt if job.max_prompt is not None else (
            job.max_context - 1 if job.max_context is not None else None)
        if room is not None and len(spliced) > room:
            return job.ids
        return spliced

    def _decode(self, job: Job, slot: Any, tail: list[int], r: Result,
                logits: Optional[mx.array] = None) -> GenerationStats:
        """Prefill `tail` into the slot and generate; the slot's tokens follow what is fed. With
        an empty `tail`, `logits` (a restored checkpoint's) give the first token. Once the whole
        prompt is in the cache the pool may checkpoint it (SlotPool.checkpoint)."""
        out: list[str] = []
        chunk = slot.cache.config.fitted_chunk(self.prefill_chunk, self.loaded.context_length,
                                               slot.cache.current_length + len(tail))
        progress = PrefillLog(slot.index) if len(tail) > chunk else None
        prompt_len, checkpointed = len(slot.tokens) + len(tail), not tail
        reply = Reply(self.loaded.model, self.loaded.tokenizer, tail, slot.cache, job.max_tokens, chunk,
                      job.temperature, job.top_p, job.top_k, job.seed, job.stop, progress=progress,
                      should_stop=job.cancelled.is_set, first_logits=None if tail else logits)
        for step, piece in reply:
            slot.tokens.extend(step.fed)
            if not checkpointed and len(slot.tokens) == prompt_len:    # the prompt, and nothing yet
                self.pool.checkpoint(slot, step.logits)
                checkpointed = True
            if step.token is None:
                continue
            r.tokens.append(step.token)
            if job.logprobs is not None:
                r.logprobs.append(lp.of(step.logits, step.token, job.logprobs))
            if piece:
                out.append(piece)
                job.emit("text", piece)
            if reply.stopped:
                break
            if self.stop_loops and len(r.tokens) % 8 == 0 and looping(r.tokens, self.stop_loops):
                reply.stop()
                log.info("slot %d: reply stopped after %d tokens: its last %d tokens repeat one n-gram "
                         "(--stop-loops)", slot.index, len(r.tokens), self.stop_loops)
                break
            if job.max_context is not None and len(slot.tokens) + 1 >= job.max_context:
                break           # prompt + reply fill the context (the last token is never fed)
        piece = reply.finish()
        if piece:
            out.append(piece)
            job.emit("text", piece)
        r.text = "".join(out)
        return reply.stats
