"""tinygpt_mlx/heap.py: glibc's thresholds that keep MLX's large temporaries on the heap."""

from __future__ import annotations

import json
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


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._libc() is None, reason="glibc on Linux only")
def test_kept_records_that_the_thresholds_were_set():
    """`heap.KEPT` (cache/cpu_softmax.py's `use_here` reads it): False until `keep_large_blocks`
    set the thresholds, True after; False with the opt-out."""
    code = "from tinygpt_mlx import heap; a = heap.KEPT; b = heap.keep_large_blocks(); print(a, b, heap.KEPT)"
    env = {k: v for k, v in os.environ.items() if k != heap.OFF_VAR}
    for given, want in ((env, ["False", "True", "True"]), ({**env, heap.OFF_VAR: "1"}, ["False", "False", "False"])):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=given, check=True)
        assert out.stdout.split() == want


def test_nothing_is_set_off_linux_or_when_turned_off():
    assert heap.keep_large_blocks({}, "darwin") is False
    for value in ("1", "true", " YES ", "on"):
        assert heap.keep_large_blocks({heap.OFF_VAR: value}, "linux") is False


# a 64 MiB block written (resident), a small one after it (the large one is then not the heap's
# top), the large one freed, then `heap.trim`: glibc's heap and the RSS after each
RELEASE_PROBE = """
import ctypes, json
from tinygpt_mlx import heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
assert heap.keep_large_blocks()
out = {"start": heap.usage()}
big = libc.malloc(64 << 20)
libc.memset(big, 1, 64 << 20)
small = libc.malloc(1024)
out["held"], out["rss_held"] = heap.usage(), rss()
libc.free(big)
out["freed"], out["rss_freed"] = heap.usage(), rss()
out["trimmed_ok"] = heap.trim()
out["trimmed"], out["rss_trimmed"] = heap.usage(), rss()
libc.free(small)
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._libc() is None
                    or not hasattr(heap._libc(), "mallinfo2"), reason="glibc on Linux only")
def test_usage_counts_the_heap_and_trim_hands_free_pages_back():
    """`heap.usage` (serve's /api/slots `heap_mib`): a live 64 MiB block counts as in use, freed
    it counts as free and stays resident (the heap kept, `keep_large_blocks`); `heap.trim`
    (serve's idle worker) then hands its pages back though it is not the heap's top (a live block
    after it). Fails with the fields mapped wrong or `trim` doing nothing."""
    env = {k: v for k, v in os.environ.items() if k != heap.OFF_VAR}
    run = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, env=env, check=True)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(got["start"]) == {"heap", "in_use", "free", "mmapped"}
    assert got["held"]["in_use"] - got["start"]["in_use"] >= 63.9, got
    assert got["held"]["heap"] >= got["held"]["in_use"] and got["held"]["mmapped"] < 64, got   # on the heap
    assert got["freed"]["free"] - got["held"]["free"] >= 63.9 and got["freed"]["in_use"] <= got["start"]["in_use"] + 1, got
    assert got["rss_held"] - got["rss_freed"] < 16, got           # freed, still mapped: the heap kept
    assert got["trimmed_ok"] is True
    assert got["rss_freed"] - got["rss_trimmed"] >= 56, got       # trimmed: the pages handed back
