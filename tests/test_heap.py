"""tinygpt_mlx/heap.py: glibc's thresholds that keep MLX's large temporaries on the heap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tinygpt_mlx import heap

# a 64 MiB block (above glibc's own mmap ceiling, 32 MiB): mmapped (mallinfo2's hblkhd) or not
PROBE = """
import ctypes, sys
from tinygpt_mlx import heap
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
print(heap.keep_large_blocks())
p = libc.malloc(64 << 20)
print(libc.mallinfo2().hblkhd >= 64 << 20)
libc.free(p)
# a 96 MiB block made on another thread (serve's worker runs MLX there): past a thread arena's 64 MiB
import threading
seen = []
def other():
    q = libc.malloc(96 << 20)
    seen.append(libc.mallinfo2().hblkhd >= 96 << 20)
    libc.free(q)
t = threading.Thread(target=other)
t.start(); t.join()
print(seen[0])
"""


def _probe(env: dict) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._libc() is None
                    or not hasattr(heap._libc(), "mallinfo2"), reason="glibc on Linux only")
def test_a_large_block_comes_from_the_heap_once_set(monkeypatch):
    """After `keep_large_blocks` a 64 MiB block is not mmapped, nor a 96 MiB one made on another
    thread; with the opt-out (and so by glibc's own rule) both are. Fails with the thresholds left
    at glibc's, the opt-out ignored, or threads left to arenas of their own."""
    env = {k: v for k, v in os.environ.items() if k != heap.OFF_VAR}
    assert _probe(env) == ["True", "False", "False"]
    assert _probe({**env, heap.OFF_VAR: "1"}) == ["False", "True", "True"]


def test_nothing_is_set_off_linux_or_when_turned_off():
    assert heap.keep_large_blocks({}, "darwin") is False
    for value in ("1", "true", " YES ", "on"):
        assert heap.keep_large_blocks({heap.OFF_VAR: value}, "linux") is False
