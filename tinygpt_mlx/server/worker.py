"""The generation worker: one thread that owns the model and schedules the requests on it.

Continuous batching: jobs arrive in a FIFO queue and are admitted into the running set between
model calls, up to `parallel` at once (`serve --parallel`) and while the memory the OS reports
available holds what their caches may grow to (`Admission`); a job past either limit waits in
the queue (logged once, never dropped). Each running request (`Stream`) holds its own slot and
cache of the server's policy (a warm slot, or a scratch cache), its own sampler, seed, stop
strings, limits and log-probabilities. Each scheduler step:

1. retires the cancelled requests (a client that went away frees its place at once);
2. feeds one prefill chunk (at most `prefill_chunk` tokens: the step's prompt budget) of the
   request with the fewest prompt tokens left to prefill (the oldest of those), so a long prompt
   never stalls the streams in flight, and a short request sent during a long answer, or during
   a long document's prefill, gets its first token after one chunk and one step;
3. runs one decode step for every request with a token to feed: one batched model call
   (batch.py: the projections and the MLP over all rows, attention batched across the
   sequences where their caches allow it, else per sequence over its own cache; compiled for
   full caches, StreamingLLM rings, KIVI's quiet steps and retrieval) where the caches allow it,
   else one call each;
   and samples each request's next token (a greedy one's argmax evaluated with the step's logits).

Decode steps run OpenBLAS on one thread, prefill chunks on its own count (`blas.Threads`): a
decode step's products are a few rows, which OpenBLAS's threads slow down. An idle or stopped
worker leaves OpenBLAS at its own count.

A job whose prompt continues a running request's prompt (its next turn, or the same request
again) waits for that request's slot instead (`SlotPool.waits_for`): extended or restored from
its checkpoint there, it prefills nothing it need not.

A job reports to its HTTP handler through an asyncio queue on the server's loop: ("text", str)
pieces as they are detokenized (stop strings held back, never sent), then ("done", Result) or
("error", message). The worker hands a scheduler phase's events to the loop at once (`_flush`:
after the prefill chunk and first tokens, after the decode step), one `call_soon_threadsafe`
per loop rather than one per token and stream (each wakes the loop: about 4% of the worker's
time with four streams on the shipped model), in the order they were emitted.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from .. import blas, heap
from .. import generate as engine
from ..config import CacheConfig
from ..sampling import make_sampler
from ..textstream import TextStream
from . import batch
from . import logprobs as lp
from .config import ServerConfig
from .slots import SlotPool, held_bytes

log = logging.getLogger("posttrainllm.server")

_EMPTY = object()     # the queue had nothing


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
    waiting: str = ""                   # why it waits in the queue (logged once per reason)
    # The worker's outbox (set by `Worker.submit`): events wait there, in order, until the
    # worker hands them all to their loops at once (`Worker._flush`), one call per loop and
    # scheduler phase instead of one per token and stream. None: each event is sent at once.
    outbox: Optional[list] = None
    # A streamed request's (set by its route before it is queued; None otherwise): set by its HTTP
    # handler once its first text is written to the connection (`streams.render`). The worker
    # waits for it, at most `FIRST_OUT_S`, before the decode step that follows a first token
    # (`Worker._first_out`).
    shown: Optional[threading.Event] = None

    def emit(self, kind: str, payload: Any) -> None:
        if self.loop is None or self.events is None:
            return
        if self.outbox is not None:
            self.outbox.append((self, (kind, payload)))
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:         # the event loop is gone (server shutting down)
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


def _deliver(items: list) -> None:
    """On the event loop: each (queue, event) of a worker's flush put in its queue, in order."""
    for events, event in items:
        events.put_nowait(event)


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


def release_thread_state() -> None:
    """Drop the calling thread's MLX state while it still runs Python: its compile cache (every
    trace it made, each entry holding Python objects: the output structure), its random key and
    its streams (`mx.clear_streams`). The worker's thread calls it as its last act (`Worker._run`).

    Those are C++ thread-locals, destroyed after the thread's Python state is gone, and each takes
    the GIL to drop its Python objects; an interpreter finalizing meanwhile ended the thread
    inside that destructor and the process aborted ("terminate called without an active
    exception", exit status 134: most bench_server_parallel runs after writing their JSON, and a
    server's shutdown could). Emptied here, nothing is left for them to drop, on any OS; the
    compiled functions themselves stay valid (a call on another thread traces anew there). The
    thread's queued work is waited for first (`mx.synchronize`), so no stream is ended with work
    still on it (on a GPU the last step may still be running)."""
    mx.synchronize()
    mx.clear_streams()


def run_released(fn: Any, name: str) -> tuple[concurrent.futures.Future, threading.Thread]:
    """`fn()` on a thread of its own, named `name`, that drops its MLX state (`release_thread_state`)
    as its last act, before it hands `fn`'s result or error to the returned future: (that future,
    the thread). For MLX work off the worker's thread (`Models`' swap: a model loaded and probed,
    which traces `nn.silu`'s compiled function on the thread that runs it). asyncio's default
    executor (`asyncio.to_thread`) kept that trace in its thread's compile cache until the thread
    ended, when `asyncio.run` shuts the executor down as the server stops: destroyed there as the
    interpreter finalized, the process aborted ("terminate called without an active exception",
    the same race as the worker's, `release_thread_state`). Not a daemon: an interpreter exiting
    waits for it (as it waited for the executor's threads) rather than ending it inside MLX. Its
    streams are gone after it: what `fn` builds for another thread must be evaluated by `fn`
    (an array left lazy there could not be evaluated elsewhere, with the streams kept or not)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_running_or_notify_cancel()     # (running: a caller cancelled does not cancel it)

    def body() -> None:
        try:
            settle, value = done.set_result, fn()
        except BaseException as e:  # noqa: BLE001 — handed to the caller
            settle, value = done.set_exception, e
        try:
            release_thread_state()
        except Exception:  # noqa: BLE001 — the result is still handed back
            log.exception("dropping the MLX state of thread %s", name)
        settle(value)

    thread = threading.Thread(target=body, name=name)
    thread.start()
    return done, thread


def wait_os_thread(tid: Optional[int], timeout: float) -> bool:
    """Wait until the OS thread `tid` of this process has ended, at most `timeout` seconds
    (Linux: while /proc/self/task/`tid` exists; elsewhere not waited for). Whether it ended.

    `Thread.join` returns once the thread's Python state is gone; the thread's C++ thread-local
    objects are destroyed after that, MLX's compile cache among them (each thread its own), whose
    entries take the GIL to drop their Python objects. An interpreter that starts finalizing
    meanwhile ends the thread inside that destructor, and the process aborts ("terminate called
    without an active exception", exit status 134: every bench_server_parallel run did so after
    writing its JSON, as a server's shutdown could). Waited for here (the GIL released while
    sleeping), the worker's caches are gone before `stop` returns. (The portable guard is
    `release_thread_state`, which empties them on the thread before it ends; this wait, Linux
    only, is kept beside it.)"""
    path = f"/proc/self/task/{tid}"
    if tid is None or not os.path.isdir("/proc/self/task"):
        return False
    deadline = time.monotonic() + timeout
    while os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def name_os_thread(name: str) -> bool:
    """Give the calling thread `name` (its first 15 bytes: the kernel's limit) at the OS level, as
    `top -H`, `ps -L` and /proc/<pid>/task/<tid>/comm show it: Python 3.11's thread names stay
    in Python (every thread of the process is "python" there). Linux only (`prctl(PR_SET_NAME)`);
    False where it was not set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(15, name.encode()[:15], 0, 0, 0) == 0     # PR_SET_NAME (truncates at 15)
    except (OSError, AttributeError):
        return False


def available_memory() -> Optional[int]:
    """The memory the OS could give this process now (MemAvailable, bytes), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_bytes(loaded: Any) -> tuple[int, list[tuple[int, int]]]:
    """(bytes per token over the layers that keep every token, [(window, bytes per token)] of each
    sliding-window layer, which holds at most its window whatever the policy: Gemma 3's 15 of 18)."""
    with engine.make_cache(loaded.model, CacheConfig()) as cache:
        engine.prefill(loaded.model, [0], cache, 1)
        total, sliding = 0, []
        for c in cache.distinct():
            k, v = c.fetch() if hasattr(c, "fetch") else c.state
            per = (k.nbytes + v.nbytes) // max(1, k.shape[-2])
            window = getattr(c, "sliding", None)
            if window:
                sliding.append((window, per))
            else:
                total += per
        return total, sliding


def padded_held() -> int:
    """Bytes of the joined runs kept now for the next stacked KIVI step (`batch.kept_nbytes`, made
    and dropped by this thread's steps: read on the worker thread)."""
    return batch.kept_nbytes()


class Admission:
    """Whether one more request may start now, by memory: its cache's worst case (the tokens
    its policy holds at its longest, `held`, at the model's compute precision: an upper bound
    for KIVI) and what the running requests' caches may still grow by must fit in the memory
    the OS reports available, less `RESERVE`. A request that does not fit waits in the queue
    until running ones finish; with nothing running it always starts (as one request at a time
    always did)."""

    RESERVE = 512 * 2**20

    def __init__(self, loaded: Any, cache_config: Any):
        self.config = cache_config
        self.per_token, self.sliding = kv_bytes(loaded)
        self.available = available_memory       # tests put a smaller machine here

    def nbytes(self, tokens: int) -> int:
        """Bytes a cache of the policy may hold after `tokens`: the global layers' `held` tokens and
        each sliding layer's window at most."""
        return self.held(tokens) * self.per_token + sum(min(tokens, w) * b for w, b in self.sliding)

    def held(self, tokens: int) -> int:
        """Tokens a cache of the policy holds after `tokens` (retrieval's cold store counted)."""
        c = self.config
        return min(tokens, c.sink + c.window) if c.streaming else tokens

    def worst(self, job: Job) -> int:
        """Bytes a job's cache may reach: its prompt and its reply, within its context."""
        return self.nbytes(self.tokens(job))

    @staticmethod
    def tokens(job: Job) -> int:
        """Tokens a job's cache may reach: its prompt and its reply, within its context."""
        tokens = len(job.ids) + job.max_tokens
        return tokens if job.max_context is None else min(tokens, job.max_context)

    def padded(self, tokens: list[int]) -> int:
        """Bytes the joined runs of stacked KIVI rows may hold, of rows whose caches may reach
        `tokens` (server/batch.py `_joined_runs`: the rows' packed runs and near tiers joined along
        the rows, each padded to the longest row's, and kept between steps): one copy per row, each
        at most the longest row's frozen tokens, and those at most `batch.STACK_TOKENS` (past it the
        rows attend one by one, nothing joined); counted at the compute precision, as `nbytes`
        counts a KIVI cache (an upper bound of the packed bytes). 0 for a policy without KIVI's
        compiled batched step (not quantised, or retrieval) and for one row."""
        c = self.config
        if len(tokens) < 2 or not c.quantised or c.retrieval:
            return 0
        return len(tokens) * min(max(self.held(t) for t in tokens), batch.STACK_TOKENS) * self.per_token

    def growth(self, s: "Stream") -> int:
        """Bytes a running request's cache may still grow by."""
        return max(0, self.worst(s.job) - self.nbytes(len(s.slot.tokens)))

    def fits(self, job: Job, running: list["Stream"]) -> tuple[bool, str]:
        if not running:
            return True, ""
        free = self.available()
        if free is None:
            return True, ""
        need, grow = self.worst(job), sum(self.growth(s) for s in running)
        # the stacked KIVI rows' padded runs, less the copies held now (in what the OS counts used)
        pad = max(0, self.padded([self.tokens(job)] + [self.tokens(s.job) for s in running]) - padded_held())
        if need + grow + pad <= free - self.RESERVE:
            return True, ""
        padding = f", their padded KIVI runs {pad / 2**20:.1f} MiB" if pad else ""
        return False, (f"its cache may need {need / 2**20:.1f} MiB, the {len(running)} running request(s)' may "
                       f"grow by {grow / 2**20:.1f} MiB{padding}, and {free / 2**20:.0f} MiB are available "
                       f"(less a {self.RESERVE // 2**20} MiB reserve)")


class Stream:
    """One running request: its job, its slot, the prompt tokens still to prefill, its sampler,
    text (stop strings), result and timings."""

    def __init__(self, job: Job, ids: list[int], lease: Any, chunk: int, tokenizer: Any, t_start: float):
        self.job, self.ids, self.slot = job, ids, lease.slot
        self.tail = ids[lease.reused:]
        self.pos = 0                      # tail tokens fed so far
        self.chunk = chunk
        self.progress = PrefillLog(self.slot.index) if len(self.tail) > chunk else None
        self.sampler = make_sampler(job.temperature, job.top_p, job.top_k, job.seed)
        self.text = TextStream(tokenizer, tuple(job.stop))
        self.eos = frozenset(tokenizer.eos_ids)
        self.r = Result(prompt_tokens=len(ids), prompt_ids=ids, queue_ns=int((t_start - job.created) * 1e9),
                        slot=self.slot.index, slot_action=lease.action, reused_tokens=lease.reused,
                        restored_tokens=lease.restored, prefilled_tokens=len(ids) - lease.reused)
        self.out: list[str] = []
        self.logits: Optional[mx.array] = None if self.tail else lease.logits   # to sample from
        self.token: Optional[int] = None        # sampled, to feed in the next decode step
        self.generated = 0
        self.t_start = t_start
        self.t_decode: Optional[float] = None if self.tail else t_start   # the prompt is in the cache
        self.finish_reason = "length"

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.tail)

    def say(self, piece: str) -> None:
        if piece:
            self.out.append(piece)
            self.job.emit("text", piece)


#: how long the worker waits, at most, for the HTTP handlers to write the first tokens it has just
#: sent before it runs the next decode step (`Worker._first_out`). That step may trace a new batch
#: layout or build an eager step's graph: tens of ms of Python that hold the GIL, which the event
#: loop needs at each of the several loop iterations that take a token to the socket
FIRST_OUT_S = 0.05


class Worker:
    def __init__(self, loaded: Any, pool: SlotPool, prefill_chunk: int = ServerConfig().prefill_chunk,
                 stop_loops: int = 0, parallel: int = ServerConfig().parallel, prefill_tail: int = 0):
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.loaded, self.pool, self.prefill_chunk = loaded, pool, prefill_chunk
        self.prefill_tail = prefill_tail  # a prompt's last tokens as a pass of their own (`engine.pass_end`)
        self._outbox: list = []         # (job, event) emitted on this thread, not yet sent (`_flush`)
        self.stop_loops = stop_loops      # 0: off; else stop a reply whose last N tokens loop
        self.parallel = parallel
        self.queue: "queue.Queue[Any]" = queue.Queue()
        self.waiting: "collections.deque[Job]" = collections.deque()   # taken off the queue, not admitted
        self.running: list[Stream] = []
        self.completed = 0
        self.recent: "collections.deque[dict]" = collections.deque(maxlen=32)   # for /api/slots
        self.steps = 0                    # scheduler steps run
        self.batched_steps = 0            # of them, decode steps that ran several requests in one call
        self.batches = batch.batches(loaded.model)
        #: OpenBLAS on one thread for the decode steps, on its own count for prefill (blas.Threads)
        self.blas = blas.Threads()
        self.admission = Admission(loaded, pool.cache_config)
        self._held: Any = _EMPTY          # an item taken off the queue to wait on, handled next
        self._ran = False                 # a step ran since the worker was last idle (`_idle`)
        self._thread = threading.Thread(target=self._run, name="posttrainllm-generate", daemon=True)
        self._thread.start()

    def trace_counts(self) -> dict:
        """The compiled steps' traces made and held for this model (`batch.trace_counts`; /api/slots)."""
        return batch.trace_counts(self.loaded.model)

    def submit(self, job: Job) -> None:
        job.outbox = self._outbox
        self.queue.put(job)

    def _flush(self) -> None:
        """Hand the events the jobs emitted since the last flush to their event loops: one
        `call_soon_threadsafe` per loop (each a wake-up of the loop) for all of them, in the order
        they were emitted (`Job.outbox`). A loop that is gone (server shutting down) cancels its jobs."""
        if not self._outbox:
            return
        box = self._outbox[:]
        del self._outbox[:]
        by_loop: dict = {}
        for job, event in box:
            by_loop.setdefault(job.loop, []).append((job, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, [(job.events, event) for job, event in items])
            except RuntimeError:
                for job, _ in items:
                    job.cancelled.set()

    def call(self, fn: Any) -> Any:
        """Run `fn()` on the worker thread (its MLX stream) between scheduler steps and return its
        result or raise its error: what the worker's jobs will use (pre-warmed slot caches) is made there."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.queue.put((fn, done))
        return done.result()

    @property
    def pending(self) -> int:
        """Jobs not running yet."""
        return self.queue.qsize() + len(self.waiting)

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def stop(self) -> None:
        """Cancel the running and queued jobs, then end the thread (server shutdown)."""
        for s in list(self.running):
            s.job.cancel()
        for job in list(self.waiting):
            job.cancel()
        with self.queue.mutex:
            for job in self.queue.queue:
                if isinstance(job, Job):
                    job.cancel()
        self.queue.put(None)
        self._thread.join(timeout=10)
        wait_os_thread(self._thread.native_id, 10)

    def _run(self) -> None:
        # MLX streams are thread-local (mlx >= 0.31.2): the main thread's default GPU stream does
        # not exist here, so this thread makes its own and runs every job on it.
        try:
            with mx.stream(mx.new_stream(mx.default_device())):
                # The OS-level name (top -H, /proc/<pid>/task/<tid>/comm: the bench's per-thread CPU)
                # is set once this stream has run something: MLX starts a CPU stream's thread, where
                # its kernels run, at its first use, and a new thread takes the OS name of the thread
                # that starts it. Named first, that thread carried the worker's name and the bench
                # counted MLX's kernels as the worker's CPU. (Nothing runs outside this stream: on a
                # GPU this thread has no default stream of its own.)
                mx.eval(mx.zeros((1,), mx.int32) + 1)
                name_os_thread(self._thread.name)
                self._loop()
        finally:
            # (this thread's compile cache, random key and streams dropped while it runs Python:
            # their destructors at its end then have nothing to take the GIL for, on any OS)
            release_thread_state()

    def _loop(self) -> None:
        while True:
            # block for work only when nothing runs or waits; else take what arrived and step on
            item = self._next()
            if item is _EMPTY and not self.running and not self.waiting:
                self._idle()
                item = self.queue.get()
            while item is not _EMPTY:
                if item is None:
                    self._shutdown()
                    self._flush()
                    return
                if isinstance(item, tuple):            # call(): a function for this thread
                    fn, done = item
                    self.blas.for_prefill()
                    try:
                        done.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 — handed to the caller
                        done.set_exception(e)
                else:
                    self.waiting.append(item)
                item = self._next()
            self._admit()
            ran = bool(self.running)
            if ran:
                self._step()
            self._flush()
            if not ran and self.waiting:    # nothing could start (not expected): wait for the next arrival
                self._held = self.queue.get()

    def _idle(self) -> None:
        """Nothing runs or waits: OpenBLAS back to its own count for the process, and, once per busy
        spell, the memory the finished requests' steps left free handed back to the OS: MLX's cache
        of freed buffers emptied (`mx.clear_cache`), then glibc's free heap pages (`heap.trim`),
        which `heap.keep_large_blocks` keeps mapped up to 512 MiB for the next large temporary.
        Without it the RSS of a busy server climbs to the largest mix of requests it has met and
        stays there (docs/server.md: the retrieval load run); with it an idle server holds its
        caches, slots and model, not that high-water mark. A request arriving at an idle server
        faults its first temporaries in again (measured in docs/server.md). The padded runs kept for
        stacked int4 rows are dropped first (`batch.drop_kept`)."""
        self.blas.for_prefill()
        if self._ran:
            self._ran = False
            batch.drop_kept()
            mx.clear_cache()
            heap.trim()

    def _next(self) -> Any:
        if self._held is not _EMPTY:
            item, self._held = self._held, _EMPTY
            return item
        try:
            return self.queue.get_nowait()
        except queue.Empty:
            return _EMPTY

    def _shutdown(self) -> None:
        self.blas.for_prefill()
        for s in list(self.running):
            self._retire(s, "cancel")
        for job in self.waiting:
            self._skip(job)
        self.waiting.clear()

    # ----- admission ----------------------------------------------------------------------------
    def _skip(self, job: Job) -> None:
        """A job cancelled before it ran: answered as cancelled, nothing computed."""
        r = Result(prompt_tokens=len(job.ids), prompt_ids=job.ids, done_reason="cancel", slot_action="skipped")
        self._record(r)
        job.emit("done", r)
        self.completed += 1

    def _wait(self, job: Job, why: str) -> None:
        if job.waiting != why:
            job.waiting = why
            log.info("request of %d prompt tokens waits in the queue: %s", len(job.ids), why)

    def _admit(self) -> None:
        """Start waiting jobs, in order, while the limits allow (module doc); a job that must
        wait for a running request's slot lets the jobs behind it pass."""
        for job in list(self.waiting):
            if job.cancelled.is_set():
                self.waiting.remove(job)
                self._skip(job)
                continue
            if len(self.running) >= self.parallel:
                self._wait(job, f"{len(self.running)} requests are running (--parallel {self.parallel})")
                return
            tok = self.loaded.tokenizer
            held = self.pool.waits_for(job.ids, job.text, tok if tok.splices_exactly else None)
            if held is not None:
                self._wait(job, f"it continues the prompt running on slot {held}, whose cache it will reuse")
                continue
            ok, why = self.admission.fits(job, self.running)
            if not ok:
                self._wait(job, why)
                return
            self.waiting.remove(job)
            try:
                self._start(job)
            except Exception as e:  # noqa: BLE001 — nothing may kill the worker
                log.exception("generation failed")
                job.emit("error", f"generation failed: {e}")
                self.completed += 1

    def _start(self, job: Job) -> None:
        t_start = time.perf_counter()
        ids = self._prompt_ids(job)
        lease = self.pool.acquire(ids, hold=True)
        slot = lease.slot
        try:
            chunk = slot.cache.config.fitted_chunk(self.prefill_chunk, self.loaded.context_length,
                                                   slot.cache.current_length + len(ids) - lease.reused)
            s = Stream(job, ids, lease, chunk, self.loaded.tokenizer, t_start)
        except BaseException:
            self.pool.invalidate(slot)
            self.pool.release(slot)
            raise
        s.r.load_ns = int((time.perf_counter() - t_start) * 1e9)
        self.running.append(s)

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

    # ----- one scheduler step -------------------------------------------------------------------
    def _step(self) -> None:
        self.steps += 1
        self._ran = True
        for s in list(self.running):
            if s.job.cancelled.is_set():
                self._retire(s, "cancel")
        # the prompt with the fewest tokens left goes first (a title request passes a long document)
        pre = min((s for s in self.running if s.prefilling), key=lambda s: len(s.tail) - s.pos, default=None)
        if pre is not None:
            self._guarded([pre], lambda: self._prefill(pre))
        ready = [s for s in self.running if not s.prefilling and s.token is None and s.logits is not None]
        for s in ready:                                # a prompt just prefilled, or restored
            self._guarded([s], lambda s=s: self._sample(s))
        self._flush()                                  # (a first token goes out before the decode step)
        feeding = [s for s in self.running if s.token is not None]
        if feeding:
            self._first_out(ready)
            self._guarded(feeding, lambda: self._decode(feeding))

    def _first_out(self, started: list[Stream]) -> None:
        """Wait until the HTTP handlers of `started` (the streams whose first token was just sampled
        and sent: `_flush`) have written that token's text to their connections (`Job.shown`), at
        most `FIRST_OUT_S` in all; a request not streamed, one whose first token made no text, or
        one already written, is not waited for. The decode step that follows (a new batch
        layout traced, an eager step's graph built) is Python that holds the GIL, and the event loop
        needs it at every iteration of the several that take a token from the worker's flush to
        the socket: run first, that step delayed the first token by a switch interval (5 ms) per
        iteration. Blocked here, this thread leaves the loop the GIL; the streams in flight wait
        for one such round trip, once per request started."""
        deadline = None
        for s in started:
            shown = s.job.shown
            if shown is None or not s.out or shown.is_set():
                continue
            if deadline is None:
                deadline = time.perf_counter() + FIRST_OUT_S
            left = deadline - time.perf_counter()
            if left <= 0 or not shown.wait(left):
                return

    def _guarded(self, streams: list[Stream], fn: Any) -> None:
        """Run `fn`; an error fails only `streams` (their slots forgotten: their caches' state is
        unknown), and the worker keeps serving the rest."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 — nothing may kill the worker
            log.exception("generation failed")
            for s in streams:
                if s in self.running:
                    self.pool.invalidate(s.slot)
                    self._drop(s)
                    s.job.emit("error", f"generation failed: {e}")
                    self.completed += 1

    def _prefill(self, s: Stream) -> None:
        """One chunk of `s`'s prompt into its cache (the prompt's last `prefill_tail` tokens apart:
        `engine.pass_end`); after the last, a checkpoint of the slot (SlotPool.checkpoint) and the
        first token."""
        fed = s.tail[s.pos:engine.pass_end(s.pos, len(s.tail), s.chunk, self.prefill_tail)]
        self.blas.for_prefill()
        logits = engine.call(self.loaded.model, fed, s.slot.cache)
        s.pos += len(fed)
        s.slot.tokens.extend(fed)
        if s.progress is not None:
            s.progress(s.pos, len(s.tail))
        if not s.prefilling:
            self.pool.checkpoint(s.slot, logits)
            s.logits, s.t_decode = logits, time.perf_counter()

    def _decode(self, feeding: list[Stream]) -> None:
        """Feed each stream its sampled token (one batched call where the caches allow it), then
        sample each one's next token."""
        model = self.loaded.model
        caches = [s.slot.cache for s in feeding]
        self.blas.for_decode()
        greedy: list = [None] * len(feeding)
        wants = [s.job.temperature == 0 for s in feeding]
        if len(feeding) > 1 and self.batches and all(batch.batchable(c) for c in caches):
            # every greedy row's token from the step's own evaluation (a second one costs ~0.5 ms)
            out = batch.decode_step(model, [s.token for s in feeding], caches, argmax=any(wants))
            logits, greedy = out if any(wants) else (out, greedy)
            rows = [logits[i] for i in range(len(feeding))]
            self.batched_steps += 1
        else:
            # (one call each; a greedy request's token evaluated with its logits, as above)
            rows = [engine.call(model, [s.token], s.slot.cache, wait=False) for s in feeding]
            picks = [mx.argmax(row) if want else None for row, want in zip(rows, wants)]
            mx.eval(rows, [p for p in picks if p is not None])
            greedy = [None if p is None else p.item() for p in picks]
        for s, row in zip(feeding, rows):
            s.slot.tokens.append(s.token)
            s.token, s.logits = None, row
        for s, g in zip(feeding, greedy):
            self._guarded([s], lambda s=s, g=g: self._sample(s, g if s.job.temperature == 0 else None))

    def _sample(self, s: Stream, greedy: Optional[int] = None) -> None:
        """`s`'s next token from its logits (`greedy`: its argmax, already taken for a greedy
        request in a batched step): sent as text, or the request retired (EOS, a stop string, a
        loop, its length or context)."""
        job, r = s.job, s.r
        if s.generated >= job.max_tokens:
            self._retire(s, "length")
            return
        token = greedy if greedy is not None else int(s.sampler(s.logits[None])[0].item())
        s.generated += 1
        if token in s.eos:
            self._retire(s, "stop")
            return
        r.tokens.append(token)
        if job.logprobs is not None:
            r.logprobs.append(lp.of(s.logits, token, job.logprobs))
        s.say(s.text.add(token))
        if s.text.stopped:
            self._retire(s, "stop")
            return
        if self.stop_loops and len(r.tokens) % 8 == 0 and looping(r.tokens, self.stop_loops):
            log.info("slot %d: reply stopped after %d tokens: its last %d tokens repeat one n-gram "
                     "(--stop-loops)", s.slot.index, len(r.tokens), self.stop_loops)
            self._retire(s, "stop")
            return
        if job.max_context is not None and len(s.slot.tokens) + 1 >= job.max_context:
            self._retire(s, "length")      # prompt + reply fill the context (the last token is never fed)
            return
        if s.generated >= job.max_tokens:
            self._retire(s, "length")
            return
        s.token = token

    # ----- retiring -----------------------------------------------------------------------------
    def _drop(self, s: Stream) -> None:
        self.running.remove(s)
        self.pool.release(s.slot)

    def _record(self, r: Result) -> None:
        self.recent.append({"slot": r.slot, "action": r.slot_action, "prompt_tokens": r.prompt_tokens,
                            "prefilled": r.prefilled_tokens, "generated": len(r.tokens),
                            "done_reason": r.done_reason})

    def _retire(self, s: Stream, reason: str) -> None:
        """`s` is over (`reason`: "stop", "length" or "cancel"): its text's held-back end sent, its
        slot released (warm for the next request), its result reported and logged."""
        now = time.perf_counter()
        r, slot = s.r, s.slot
        s.say(s.text.finish())
        r.text, r.done_reason = "".join(s.out), reason
        t_decode = s.t_decode if s.t_decode is not None else now
        r.prompt_eval_ns, r.eval_ns = int((t_decode - s.t_start) * 1e9), int((now - t_decode) * 1e9)
        r.total_ns = int((now - s.job.created) * 1e9)
        held = held_bytes(slot.cache)
        kept, checkpoints = slot.checkpoint_bytes, len(slot.checkpoints)
        self._drop(s)
        self._record(r)
        s.job.emit("done", r)
        self.completed += 1
        total, disk = held["cache_bytes"], held["cache_disk_bytes"]
        cold = sum(v for k, v in held["cache_bytes_breakdown"].items() if k.startswith("cold"))
        restored = " restored from a checkpoint" if r.restored_tokens else ""
        log.info("slot %d %s: prompt %d tokens (reused %d%s, prefilled %d), generated %d (%s); cache %.1f MiB%s%s",
                 r.slot, r.slot_action, r.prompt_tokens, r.reused_tokens, restored, r.prefilled_tokens,
                 len(r.tokens), r.done_reason, total / 2**20,
                 f" (cold store {cold / 2**20:.1f} MiB, {disk / 2**20:.1f} MiB memory-mapped on disk)" if cold else "",
                 f"; {checkpoints} checkpoint(s) {kept / 2**20:.1f} MiB" if checkpoints else "")

