"""glibc's heap kept for MLX's large temporaries on Linux, set by `posttrainllm` at its start.

MLX's CPU backend allocates every array with `malloc`; on Linux it keeps freed buffers in its
cache only up to a size (MLX 0.32.4: a freed 8 MB array stayed in `mx.get_cache_memory()`, a
71 MB one did not; serve's runs held 9.7-32 MiB there, docs/server.md, which its idle worker
empties). glibc serves a request above its mmap threshold
(dynamic, at most 32 MiB) with a fresh `mmap` and unmaps it on `free`, so every such temporary
is faulted in again, a zeroed 4 KiB page at a time, each time it is made: a 71 MB
`mx.zeros` took 45-50 ms here, 5-6 ms from the heap. A retrieval prefill chunk at
`sink4/hot1024` makes several of that size per layer (its pool's scores, [2 x 512, 4,360] fp32
per KV head of the shipped model), StreamingLLM's none, so retrieval paid most of it
(docs/retrieval.md, "Prefill against StreamingLLM").

`keep_large_blocks()` raises the mmap threshold to 256 MiB and the trim threshold to 512 MiB
(`mallopt`): blocks up to 256 MiB come from the heap and are reused there, and up to 512 MiB
freed at the heap's top stay mapped (so the process's RSS keeps its peak working set, less
what lies above that). It also keeps every thread on the main heap (one arena): a thread's own
arena is at most 64 MiB, so a larger block made on a thread (`serve` runs MLX on its worker
thread) is mmapped whatever the threshold (a 71 MB `mx.zeros` 39 ms there, 5-6 ms on one arena). It does nothing off Linux/glibc, or with POSTTRAINLLM_NO_HEAP_TUNE=1
(or true/yes/on). Standard library only: the CLI calls it before MLX loads, as `blas`.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Mapping, Optional

from . import switches

OFF_VAR = "POSTTRAINLLM_NO_HEAP_TUNE"
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8     # glibc's malloc.h


def _libc() -> Optional[Any]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


#: whether `keep_large_blocks` set them in this process (cache/cpu_softmax.py takes its compiled
#: softmax only then: its kernels' intermediates are faulted in afresh otherwise, slower than
#: `mx.softmax`)
KEPT = False


def keep_large_blocks(environ: Mapping[str, str] = os.environ, platform: str = sys.platform) -> bool:
    """Set glibc's mmap and trim thresholds and one arena (module doc); True where all were set."""
    global KEPT
    if not platform.startswith("linux") or switches.flag(OFF_VAR, environ):
        return False
    libc = _libc()
    if libc is None:
        return False
    kept = (bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
            and bool(libc.mallopt(_M_ARENA_MAX, 1)))
    KEPT = KEPT or kept
    return kept


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def usage() -> Optional[dict]:
    """glibc's heap in MiB (`mallinfo2`): `heap` obtained from the OS for the main heap (arena),
    `in_use` by live blocks, `free` held in free blocks (glibc's; some of it may already have been
    handed back by `trim`), `mmapped` in blocks mapped on their own; None off glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return {name: round(value / 2 ** 20, 1) for name, value in
            (("heap", m.arena), ("in_use", m.uordblks), ("free", m.fordblks), ("mmapped", m.hblkhd))}


def trim() -> bool:
    """Hand the heap's free pages back to the OS (`malloc_trim(0)`: every whole free page, not only
    those at the heap's top past the trim threshold); False off glibc. `serve`'s worker calls it,
    after emptying MLX's cache of freed buffers, when it goes idle (server/worker.py)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True
