"""The models a server offers (`serve smollm2:135m llama3.2:1b ...`), as ollama offers them: every
one listed in /api/tags from its file alone, one resident at a time, and a request naming another
swaps it in (the resident one is unloaded once its worker is idle; the new one is loaded in a
thread so the server keeps answering meanwhile).

Only the first model gets the prompt-cache files and the slot directory (they are made for one
model); its slots are saved there when it is swapped out and restored when it comes back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import gguf
import mlx.core as mx

from ..ggml.arch import scalar
from ..ggml.header import Header, read_header
from ..resolve import Resolved
from .ollama import quant_level
from .state import ApiError, Server, names_for
from .worker import run_released, wait_os_thread

log = logging.getLogger("posttrainllm.server")


@dataclass
class Entry:
    resolved: Resolved
    names: tuple[str, str]
    size: int
    details: dict
    modified: float


def file_type(h: Header) -> str:
    """ollama's quantization_level of a GGUF: its file type as llama.cpp's quantizer wrote it
    (`general.file_type`: Q4_K_M for Gemma 3 270M's Q4_K_M file, though most of its tensors are
    Q5_0), named as ggml's `LlamaFileType` without its MOSTLY_ / ALL_; where the file has none (or
    one ggml does not know), the type most of its tensors have (`Header.main_type`)."""
    try:
        name = gguf.LlamaFileType(int(scalar(h.metadata["general.file_type"]))).name
    except (KeyError, TypeError, ValueError):
        return h.main_type
    return h.main_type if name == "GUESSED" else name.split("_", 1)[1]


def describe(resolved: Resolved) -> Entry:
    """An /api/tags row from the file alone (no weights loaded)."""
    path = resolved.path
    if resolved.format == "gguf":
        h = read_header(path)
        label = h.metadata.get("general.size_label", "")
        details = {"format": "gguf", "family": h.architecture, "parameter_size": label,
                   "quantization_level": file_type(h)}
        size = path.stat().st_size
    elif resolved.format == "mlx-lm":
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        details = {"format": "mlx", "family": config.get("model_type", ""), "parameter_size": "",
                   "quantization_level": quant_level(config)}
        size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    else:
        details = {"format": "tinygpt", "family": "tinygpt", "parameter_size": "", "quantization_level": "F32"}
        size = path.stat().st_size
    details.update(parent_model="", families=[details["family"]])
    return Entry(resolved, names_for(resolved.name), size, details, path.stat().st_mtime)


class Models:
    """The offered models and the resident `Server`."""

    def __init__(self, first: Server, others: Sequence[Resolved], make: Callable[[Resolved], Server]):
        self.resident = first
        self.entries = [describe(first.loaded.resolved)] if first.loaded.resolved else []
        seen = set(first.names)
        for r in others:
            e = describe(r)
            if seen & set(e.names):
                raise ValueError(f"{r.name}: offered twice (names {', '.join(e.names)})")
            seen |= set(e.names)
            self.entries.append(e)
        self._make = make
        self._lock = asyncio.Lock()
        self.swaps = 0
        #: the last swap's (future, thread) (`run_released`), waited for at shutdown (`settle`)
        self._swapping: Optional[tuple[concurrent.futures.Future, threading.Thread]] = None

    def entry(self, name: Any) -> Entry:
        if not isinstance(name, str) or not name:
            raise ApiError(400, "model is required")
        for e in self.entries:
            if name in e.names:
                return e
        if name in self.resident.names:      # a model without a resolution record (tests)
            return Entry(self.resident.loaded.resolved, self.resident.names, 0, {}, time.time())
        raise ApiError(404, f"model '{name}' not found")

    async def server(self, body: dict) -> Server:
        """The server for the request's model, swapping it in if another is resident. While a swap
        waits or runs, every request waits its turn behind it, its own model's too: the resident
        server then is the one being drained and closed (a request handed to it was queued on a
        stopped worker and never answered)."""
        name = body.get("model")
        self.entry(name)
        if name in self.resident.names and not self._lock.locked():
            return self.resident
        async with self._lock:
            await self._swapped()             # (a swap whose request was cancelled: still running)
            if name in self.resident.names:   # swapped in while this request waited
                return self.resident
            old = self.resident
            while old.worker.busy or old.worker.pending:
                await asyncio.sleep(0.05)
            entry = self.entry(name)
            log.info("model %s: unloading %s, loading %s", name, old.names[1], entry.names[1])
            started = time.monotonic()
            # on a thread of its own that drops its MLX state before it answers (`run_released`;
            # not asyncio's executor, whose threads kept theirs until the process exited)
            self._swapping = run_released(lambda: self._swap(old, entry.resolved), "posttrainllm-swap")
            new = await asyncio.wrap_future(self._swapping[0])
            log.info("model %s loaded in %.1f s", entry.names[1], time.monotonic() - started)
            return new

    def _swap(self, old: Server, resolved: Resolved) -> Server:
        """On the swap's thread: `old` closed, `resolved` loaded and made resident (here, not by
        the request that asked: a swap whose request is cancelled still leaves its server resident,
        for the shutdown to stop)."""
        self.close(old)
        gc.collect()
        mx.clear_cache()
        try:
            self.resident = self._make(resolved)
        except BaseException:
            self._restore(old)
            raise
        self.swaps += 1
        return self.resident

    def _restore(self, old: Server) -> None:
        """After a swap's load failed (its request gets the error): `old`'s model loaded again and
        resident, so that the server still serves it (it stayed resident closed: every later
        request for it was queued on a stopped worker). Its slots come back from --slot-dir."""
        if old.loaded.resolved is None:
            return
        try:
            self.resident = self._make(old.loaded.resolved)
        except Exception:  # noqa: BLE001 — the swap's own error is what the request reports
            log.exception("model %s: could not be loaded again after a failed swap", old.names[1])

    async def settle(self) -> None:
        """At shutdown, before the resident server stops: a swap still running (its request gone)
        finished, so that its server is the resident one stopped next, and its thread ended with
        nothing of MLX's left on it (`run_released`; on Linux the OS thread waited for too, as
        `Worker.stop` waits for the worker's) before the interpreter finalizes."""
        await self._swapped()
        if self._swapping is not None:
            thread = self._swapping[1]
            thread.join(timeout=10)
            wait_os_thread(thread.native_id, 10)

    async def _swapped(self) -> None:
        """The last swap finished, if one ran (its error, reported to its request, ignored)."""
        if self._swapping is None or self._swapping[0].done():
            return
        try:
            await asyncio.wrap_future(self._swapping[0])
        except Exception:  # noqa: BLE001
            pass

    @staticmethod
    def close(srv: Server) -> None:
        srv.worker.stop()
        try:
            srv.save_slots()
        finally:
            srv.pool.close()
            srv.loaded.close()
