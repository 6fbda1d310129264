"""Tensor-parallel sampling with mlx.distributed: one generation across the ranks that
`mlx.launch` starts (docs/distributed.md).

    mlx.launch -n 2 --backend ring -- posttrainllm sample MODEL --prompt ... [cache flags]

Each rank loads the model, shards it (`model.shard(group)`: the native TinyGPT's
`Model.shard`, an mlx-lm model's own) so that it computes `n_heads / N` query heads and
`n_kv_heads / N` KV heads, and builds its cache with the ordinary `make_cache`: the cache sees
K/V tensors [B, Hkv/N, L, D] and holds 1/N of the K/V under every policy. The outputs of the
attention and of the MLP are all-summed (sharded-to-all linears), so every rank ends each
layer with the same residual stream and the same logits, samples the same token from the same
seed (`agree_seed`), and feeds it back.

Heads are independent in attention, so the cache needs no communication of its own. Where the
cache relies on that (keep it so; a test shards and compares tokens, tests/test_distributed.py):
  - KIVI (cache/kivi.py): keys are quantised per channel over blocks of G tokens, values per
    token over groups of G channels of one head; no group spans two heads.
  - KIVI's exact top-k shadow (cache/kivi.py, `top_k_indices`): each query head picks its own
    K tokens from its own KV head's scores.
  - retrieval (cache/cold.py): pages, summaries and the selection are per KV head (G = batch x
    KV heads); a page is scored by the max over the query heads of that KV head's GQA group,
    and the contiguous split keeps a whole group on one rank.
  - StreamingLLM (cache/layer.py, positions.py): eviction and positions depend on token
    counts only, the same on every rank.
A policy that mixed heads (a page chosen by all heads together, a quantisation group across
heads, a global top-k) would need an all-reduce of its own here.

What stays whole on every rank: the embedding, the norms, the output head and the logits
(each rank holds the full vocabulary's logits; they are all-reduced inside the model).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

import mlx.core as mx

from . import switches
from .config import random_seed
from .errors import PosttrainError

#: seconds one model call (a prefill chunk or a decode step) may take before a rank gives up
#: on the others (a peer that hangs without closing its socket); override with this variable.
RANK_TIMEOUT_ENV = "POSTTRAINLLM_RANK_TIMEOUT"
DEFAULT_RANK_TIMEOUT = 300.0


class DistributedError(PosttrainError):
    """A run under several ranks that cannot start or cannot go on: one line. `everywhere`:
    every rank finds the same (a refusal of the model), so rank 0 alone says it."""

    def __init__(self, message: str, everywhere: bool = False):
        super().__init__(message)
        self.everywhere = everywhere


#: the commands that run under several ranks; every other one refuses (tinygpt_mlx/cli/main.py)
COMMANDS = ("sample",)


def launched() -> bool:
    """Whether this process was started by `mlx.launch` (or with its environment)."""
    return "MLX_RANK" in os.environ


def launched_ranks() -> int:
    """The world size `mlx.launch` announced, without importing MLX (1 when not launched):
    the ring backend's hostfile lists one entry per rank; other backends set MLX_WORLD_SIZE."""
    if not launched():
        return 1
    if os.environ.get("MLX_WORLD_SIZE"):
        return int(os.environ["MLX_WORLD_SIZE"])
    path = os.environ.get("MLX_HOSTFILE")
    if path:
        try:
            with open(path) as f:
                return max(1, len(json.load(f)))
        except (OSError, ValueError):
            return 2  # launched with a hostfile we cannot read: at least two ranks
    return 1


def init() -> Optional[Any]:
    """The world group when this process is one of several ranks, else None."""
    if not launched():
        return None
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise DistributedError(f"rank {os.environ.get('MLX_RANK')}: cannot join the distributed group "
                               f"({str(e).splitlines()[0]})") from None
    return group if group.size() > 1 else None


def _attention(layer: Any) -> Any:
    for name in ("attn", "self_attn", "attention"):
        if hasattr(layer, name):
            return getattr(layer, name)
    return None


def head_counts(model: Any) -> tuple[Optional[int], Optional[int]]:
    """(query heads, KV heads) of a model, native or mlx-lm; None where it does not say."""
    attn = _attention(model.layers[0]) if getattr(model, "layers", None) else None
    args = getattr(model, "args", None) or getattr(model, "config", None)
    n_heads = getattr(attn, "n_heads", None) or getattr(args, "num_attention_heads", None) \
        or getattr(args, "n_heads", None)
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(args, "num_key_value_heads", None) \
        or getattr(args, "n_kv_heads", None) or n_heads
    return n_heads, n_kv


def check_shardable(model: Any, n: int, name: str = "the model") -> None:
    """Refuse, in one line, a model that cannot be split over `n` ranks by KV head."""
    if not callable(getattr(model, "shard", None)):
        raise DistributedError(f"{name} ({getattr(model, 'model_type', type(model).__name__)}) has no `shard` "
                               f"method, so it cannot run over {n} ranks; run it on one (without mlx.launch)", everywhere=True)
    n_heads, n_kv = head_counts(model)
    if n_kv is None:
        raise DistributedError(f"{name}: cannot tell its KV head count, so it cannot be split over {n} ranks",
                               everywhere=True)
    if n_kv % n or (n_heads and n_heads % n):
        raise DistributedError(f"{name} has {n_kv} KV heads ({n_heads} query heads), which {n} ranks do not "
                               f"divide: launch a number of ranks that divides {n_kv}", everywhere=True)


def shard(loaded: Any, group: Any) -> None:
    """Split `loaded.model` over `group` by KV head (checked first), weights evaluated."""
    check_shardable(loaded.model, group.size(), loaded.name)
    try:
        loaded.model.shard(group)
    except ValueError as e:
        raise DistributedError(f"{loaded.name}: cannot shard over {group.size()} ranks ({e})",
                               everywhere=True) from None
    mx.eval(loaded.model.parameters())


def gather_ints(value: int, group: Any) -> list[int]:
    """Every rank's `value`, in rank order (an all-gather)."""
    out = mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=group)
    return [int(v) for v in out.tolist()]


def agree_seed(seed: Optional[int], group: Any) -> int:
    """A seed every rank shares: `seed`, or rank 0's random one (so that sampling with a
    temperature draws the same token on every rank)."""
    if seed is None:
        seed = random_seed()
    return gather_ints(seed, group)[0]


def fingerprint(tokens: list[int]) -> int:
    """A 62-bit digest of a token sequence, for checking that the ranks agree."""
    h = 1469598103934665603
    for t in tokens:
        h = ((h ^ (t + 1)) * 1099511628211) % (1 << 62)
    return h


def peer_lost(e: BaseException) -> bool:
    """Whether an exception is a backend's report that another rank is gone."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(b in text for b in ("[ring]", "[jaccl]", "[mpi]", "[nccl]"))


def lost_message(rank: int, e: BaseException) -> str:
    return (f"rank {rank}: lost the connection to another rank ({str(e).splitlines()[0]}): a rank failed or "
            "was killed, so the run stops on every rank")


class Guard:
    """The bounded waits of one rank (`with Guard(rank):` around the run).

    - a watchdog thread: when no `beat()` came for `timeout` seconds (a peer that hangs
      without closing its socket leaves a collective waiting forever; MLX releases the GIL
      while it waits, so the thread runs), it writes one line and ends the process (exit 124);
    - SIGTERM (what `mlx.launch` sends the other ranks when one fails): one line, exit 143,
      at once, even while the main thread waits inside a collective (the signal's wake-up fd
      is read by a thread).
    A peer that dies closes its sockets: the ring backend then raises in the main thread
    (`peer_lost`), which the caller turns into one line.
    """

    def __init__(self, rank: int, timeout: Optional[float] = None,
                 write: Callable[[str], None] = lambda s: (sys.stderr.write(s + "\n"), sys.stderr.flush()),
                 cleanup: Callable[[], Any] = lambda: None):
        self.rank = rank
        self.cleanup = cleanup      # run before os._exit, which skips finalizers (disk stores)
        self.timeout = timeout if timeout is not None else switches.rank_timeout(default=DEFAULT_RANK_TIMEOUT)
        self.write = write
        self.last = time.monotonic()
        self._done = threading.Event()
        self._said = threading.Lock()
        self._old_term: Any = None
        self._old_fd: Optional[int] = None
        self._pipe: Optional[tuple[int, int]] = None

    def beat(self, *_: Any) -> None:
        self.last = time.monotonic()

    def _end(self, message: str, code: int) -> None:
        if self._said.acquire(blocking=False):
            self.write(f"error: {message}")
            self.cleanup()
            os._exit(code)

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout / 4)):
            if time.monotonic() - self.last > self.timeout:
                self._end(f"rank {self.rank}: no progress for {self.timeout:.0f} s: another rank is not answering; "
                          f"giving up (set {RANK_TIMEOUT_ENV} to wait longer)", 124)

    def _signals(self) -> None:
        r = self._pipe[0]
        while not self._done.is_set():
            try:
                data = os.read(r, 16)
            except OSError:
                return
            if not data or self._done.is_set():
                return
            if signal.SIGTERM in data:
                self._end(f"rank {self.rank}: stopped: another rank ended (mlx.launch sent SIGTERM)", 143)

    def __enter__(self) -> "Guard":
        self.beat()
        threading.Thread(target=self._watch, daemon=True, name="rank-watchdog").start()
        if threading.current_thread() is threading.main_thread():
            self._pipe = os.pipe()
            os.set_blocking(self._pipe[1], False)
            self._old_term = signal.signal(
                signal.SIGTERM, lambda *_: self._end(f"rank {self.rank}: stopped: another rank ended "
                                                     "(mlx.launch sent SIGTERM)", 143))
            self._old_fd = signal.set_wakeup_fd(self._pipe[1])
            threading.Thread(target=self._signals, daemon=True, name="rank-signals").start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None and peer_lost(exc):
            # Say it here, while the SIGTERM handler is still installed: mlx.launch's SIGTERM
            # (sent when the dead peer's exit is noticed) would otherwise end this rank silently
            # in the moment between restoring the default handler and printing the line.
            self._end(lost_message(self.rank, exc), 1)
        self._done.set()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_fd if self._old_fd is not None else -1)
            signal.signal(signal.SIGTERM, self._old_term or signal.SIG_DFL)
            os.write(self._pipe[1], b"\0")  # wake the reader so it returns
            os.close(self._pipe[1])
