"""OpenBLAS under MLX's CPU backend on Linux, preloaded by `posttrainllm` itself.

MLX's Linux wheel (`mlx[cpu]`, the only MLX this project installs on Linux) carries the reference
BLAS (netlib's, in `mlx_cpu.libs/`): its matrix products, the whole of a prefill, run many times
slower than OpenBLAS's (docs/results.md, "BLAS on Linux"). MLX binds `cblas_sgemm` when its
library loads, so OpenBLAS must be in the process from its start: `posttrainllm` re-executes
itself once, before MLX is imported, with the system's OpenBLAS in `LD_PRELOAD`
(`reexec_with_openblas`, called at the top of tinygpt_mlx/cli/main.py when the process is the
command, never when a test or a program imports the CLI). It does not when:

    the platform is not Linux (macOS has Accelerate, MLX's BLAS there);
    POSTTRAINLLM_NO_BLAS_PRELOAD=1 (or true/yes/on) is set;
    LD_PRELOAD already names an OpenBLAS;
    POSTTRAINLLM_BLAS_PRELOADED is set (the re-executed process: it never loops);
    the command does no work (`--help`, no arguments): they stay as fast as before;
    no OpenBLAS is found (`find_openblas`: Debian/Ubuntu's, Fedora's, Arch's, /usr/local, /opt).

Without an OpenBLAS, the commands that compute (sample, chat, serve, bench) print `hint()`, one
line with the measured speed-up and the command that installs it, beside their banner.
Everything here is the standard library: it runs before MLX, numpy or typer load.
"""

from __future__ import annotations

import ctypes
import os
import platform as _platform
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from . import switches

OFF_VAR = "POSTTRAINLLM_NO_BLAS_PRELOAD"
MARK_VAR = "POSTTRAINLLM_BLAS_PRELOADED"
DEBIAN_PACKAGE = "libopenblas0-pthread"
# SmolLM2-135M's prefill at 2,048 tokens (fp32 cache), OpenBLAS against MLX's reference BLAS in
# the same run: docs/results.md, "BLAS on Linux" (python -m benchmarks.blas_prefill).
PREFILL_SPEEDUP = "~11x"


def _multiarch() -> list[str]:
    """Debian's multiarch triplets to look under: Python's own, then the machine's `-linux-gnu`."""
    names = [sysconfig.get_config_var("MULTIARCH") or "", f"{_platform.machine()}-linux-gnu"]
    return [n for n in dict.fromkeys(names) if n]


def candidates(multiarch: Sequence[str]) -> list[str]:
    """Where OpenBLAS is found, best first: Debian/Ubuntu's pthread build (libopenblas0-pthread),
    its OpenMP and serial builds and the alternatives link; Fedora's threaded and plain builds;
    Arch / Alpine; a source build's /usr/local and /opt/OpenBLAS."""
    found = []
    for arch in multiarch:
        found += [f"/usr/lib/{arch}/openblas-pthread/libopenblas.so.0",
                  f"/usr/lib/{arch}/openblas-openmp/libopenblas.so.0",
                  f"/usr/lib/{arch}/openblas-serial/libopenblas.so.0",
                  f"/usr/lib/{arch}/libopenblas.so.0"]
    return found + ["/usr/lib64/libopenblasp.so.0", "/usr/lib64/libopenblas.so.0", "/usr/lib/libopenblas.so.0",
                    "/usr/local/lib/libopenblas.so.0", "/opt/OpenBLAS/lib/libopenblas.so.0"]


def find_openblas(exists: Callable[[str], bool] = os.path.isfile,
                  multiarch: Optional[Sequence[str]] = None) -> Optional[str]:
    """The first OpenBLAS of `candidates` that exists, or None."""
    return next((p for p in candidates(_multiarch() if multiarch is None else multiarch) if exists(p)), None)


def _names_openblas(preload: str) -> bool:
    return any(_is_openblas(p) for p in preload.replace(" ", ":").split(":") if p)


def _is_openblas(path: str) -> bool:
    """libopenblas*.so* (not numpy's bundled libscipy_openblas64_, whose symbols are renamed)."""
    name = Path(path).name
    return name.startswith("libopenblas") and ".so" in name


@dataclass(frozen=True)
class Plan:
    """What to do at start: `library` to preload by re-executing, or None and `why` not."""
    library: Optional[str]
    why: str


def plan(args: Sequence[str], environ: Mapping[str, str], platform: str,
         exists: Callable[[str], bool] = os.path.isfile, multiarch: Optional[Sequence[str]] = None) -> Plan:
    """Whether to re-execute with OpenBLAS preloaded, from the command's arguments (after the
    program), the environment, `sys.platform` and a file test (all given, for the tests)."""
    if not platform.startswith("linux"):
        return Plan(None, f"not Linux ({platform})")
    if switches.flag(OFF_VAR, environ):
        return Plan(None, f"{OFF_VAR} is set")
    if environ.get(MARK_VAR):
        return Plan(None, f"already re-executed with {environ[MARK_VAR]}")
    if _names_openblas(environ.get("LD_PRELOAD", "")):
        return Plan(None, "LD_PRELOAD already names an OpenBLAS")
    if not args or "--help" in args:
        return Plan(None, "no work to do (help)")
    library = find_openblas(exists, multiarch)
    if library is None:
        return Plan(None, "no OpenBLAS found")
    return Plan(library, f"preload {library}")


def preload_environ(environ: Mapping[str, str], library: str) -> dict[str, str]:
    """The environment of the re-executed process: `library` first in LD_PRELOAD, and the mark."""
    env = dict(environ)
    env["LD_PRELOAD"] = ":".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)
    env[MARK_VAR] = library
    return env


def started_as_command(module_name: str) -> bool:
    """Whether this process is `posttrainllm` (its console script, or `python -m
    tinygpt_mlx.cli.main`) rather than a program or a test importing the CLI."""
    return module_name == "__main__" or Path(sys.argv[0]).name == "posttrainllm"


def reexec_with_openblas(args: Sequence[str]) -> None:
    """Re-execute this process (same interpreter, same command line: `sys.orig_argv`) with
    OpenBLAS preloaded, when `plan` says so; returns when it does not. A failed exec is not an
    error: the command then runs on the reference BLAS."""
    p = plan(args, os.environ, sys.platform)
    if p.library is None or not sys.executable or not getattr(sys, "orig_argv", None):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, preload_environ(os.environ, p.library))
    except OSError:
        return


def loaded_openblas(maps: str = "/proc/self/maps") -> Optional[str]:
    """The OpenBLAS mapped into this process (Linux), or None."""
    try:
        with open(maps) as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if _is_openblas(path):
                    return path
    except OSError:
        pass
    return None


def install_command(debian: bool) -> str:
    return f"sudo apt-get install {DEBIAN_PACKAGE}" if debian else "install OpenBLAS (libopenblas.so.0) with your package manager"


def hint(environ: Mapping[str, str] = os.environ, platform: str = sys.platform,
         exists: Callable[[str], bool] = os.path.isfile, maps: str = "/proc/self/maps") -> Optional[str]:
    """One line for a command's banner when this process runs MLX's reference BLAS because the
    system has no OpenBLAS: the speed-up it would get and the command that installs it. None on
    macOS, with OpenBLAS loaded or installed (a program importing the library preloads it itself),
    or when POSTTRAINLLM_NO_BLAS_PRELOAD turned the preload off on purpose."""
    if not platform.startswith("linux") or switches.flag(OFF_VAR, environ) or loaded_openblas(maps):
        return None
    if find_openblas(exists) is not None:
        return None
    return (f"note: MLX runs its reference BLAS here; with OpenBLAS prefill is {PREFILL_SPEEDUP} faster "
            f"(posttrainllm preloads it once installed): {install_command(exists('/etc/debian_version'))}")


class Threads:
    """OpenBLAS's thread count, switched between a decode step's and a prefill's (`serve`'s worker,
    issue 56). A decode step's products are [B, d] by [d, n] with B at most a few rows: OpenBLAS
    splits them across its threads, whose hand-off costs more than the product, and on a busy
    machine a thread waiting for a core stalls the step (docs/server.md, "Several requests at
    once": a batched step of 4 sequences ran 2.5x faster on tinygpt-base with one thread). A
    prefill chunk's products are large and gain from every thread, so they keep OpenBLAS's own
    count. Nothing happens where OpenBLAS is not in the process (`available` False) or its
    functions are not found."""

    def __init__(self, decode: int = 1, library: Optional[Any] = None):
        lib = library if library is not None else ctypes.CDLL(None)
        self._set = getattr(lib, "openblas_set_num_threads", None)
        get = getattr(lib, "openblas_get_num_threads", None)
        self.available = self._set is not None and get is not None
        self.default = int(get()) if self.available else 0
        self.decode = max(1, min(decode, self.default)) if self.available else 0
        self.now = self.default

    def _to(self, n: int) -> None:
        if self.available and n != self.now:
            self._set(n)
            self.now = n

    def for_decode(self) -> None:
        """The decode steps' count (one thread by default) from now on."""
        self._to(self.decode)

    def for_prefill(self) -> None:
        """OpenBLAS's own count from now on (a prefill chunk, anything else)."""
        self._to(self.default)
