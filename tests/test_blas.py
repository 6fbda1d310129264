"""OpenBLAS on Linux (tinygpt_mlx/blas.py): when `posttrainllm` re-executes itself with it
preloaded, that it is then what MLX's matmuls call, and the one-line note when it is missing."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tinygpt_mlx import blas

ROOT = Path(__file__).resolve().parents[1]
DEBIAN = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
ARCH = ["x86_64-linux-gnu"]


def plan(args=("sample",), env=None, platform="linux", files=(DEBIAN,)):
    return blas.plan(list(args), env or {}, platform, exists=set(files).__contains__, multiarch=ARCH)


def test_plan_preloads_the_first_openblas_found():
    assert plan().library == DEBIAN
    alternatives = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
    assert plan(files=[alternatives, DEBIAN]).library == DEBIAN                   # the pthread build first
    assert plan(files=[alternatives]).library == alternatives
    assert plan(files=["/usr/lib64/libopenblas.so.0", "/usr/lib64/libopenblasp.so.0"]).library \
        == "/usr/lib64/libopenblasp.so.0"                                          # Fedora: threaded first
    assert plan(files=["/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0"]).library is None
    assert blas.plan(["sample"], {}, "linux", exists={"/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0"}
                     .__contains__, multiarch=["aarch64-linux-gnu"]).library is not None
    assert plan(files=[]) == blas.Plan(None, "no OpenBLAS found")


@pytest.mark.parametrize("args, env, platform, why", [
    (["sample"], {}, "darwin", "not Linux (darwin)"),
    (["sample"], {blas.OFF_VAR: "1"}, "linux", f"{blas.OFF_VAR} is set"),
    (["sample"], {blas.OFF_VAR: "yes"}, "linux", f"{blas.OFF_VAR} is set"),
    (["sample"], {blas.MARK_VAR: DEBIAN}, "linux", f"already re-executed with {DEBIAN}"),
    (["sample"], {"LD_PRELOAD": f"/x/libfoo.so {DEBIAN}"}, "linux", "LD_PRELOAD already names an OpenBLAS"),
    ([], {}, "linux", "no work to do (help)"),
    (["--help"], {}, "linux", "no work to do (help)"),
    (["sample", "--help"], {}, "linux", "no work to do (help)"),
])
def test_plan_does_not_preload(args, env, platform, why):
    assert plan(args, env, platform) == blas.Plan(None, why)


def test_plan_preloads_despite_unrelated_settings():
    assert plan(env={blas.OFF_VAR: "0"}).library == DEBIAN
    # numpy's bundled OpenBLAS renames its symbols: MLX cannot use it
    numpy_blas = "/venv/lib/numpy.libs/libscipy_openblas64_-32a4b2a6.so"
    assert plan(env={"LD_PRELOAD": numpy_blas}).library == DEBIAN
    env = blas.preload_environ({"LD_PRELOAD": numpy_blas, "HOME": "/h"}, DEBIAN)
    assert env == {"LD_PRELOAD": f"{DEBIAN}:{numpy_blas}", "HOME": "/h", blas.MARK_VAR: DEBIAN}
    assert blas.preload_environ({}, DEBIAN)["LD_PRELOAD"] == DEBIAN


def test_only_the_command_itself_reexecutes(monkeypatch):
    assert blas.started_as_command("__main__")                      # python -m tinygpt_mlx.cli.main
    monkeypatch.setattr(sys, "argv", ["/venv/bin/posttrainllm", "sample"])
    assert blas.started_as_command("tinygpt_mlx.cli.main")          # the console script
    monkeypatch.setattr(sys, "argv", ["/venv/bin/pytest", "tests"])
    assert not blas.started_as_command("tinygpt_mlx.cli.main")      # a test or a program importing the CLI


def test_reexec_replaces_the_process_with_the_same_command_line(monkeypatch):
    calls = []
    monkeypatch.setattr(blas, "find_openblas", lambda *a, **k: DEBIAN)
    monkeypatch.setattr(blas.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(sys, "platform", "linux")
    for var in (blas.OFF_VAR, blas.MARK_VAR, "LD_PRELOAD"):
        monkeypatch.delenv(var, raising=False)
    blas.reexec_with_openblas(["sample", "-p", "x"])
    [(exe, argv, env)] = calls
    assert exe == sys.executable and argv == sys.orig_argv
    assert env["LD_PRELOAD"] == DEBIAN and env[blas.MARK_VAR] == DEBIAN
    monkeypatch.setenv(blas.MARK_VAR, DEBIAN)
    blas.reexec_with_openblas(["sample", "-p", "x"])                   # the re-executed process: no loop
    assert len(calls) == 1


def test_hint_names_the_speedup_and_the_install_command(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /venv/lib/numpy.libs/libscipy_openblas64_-32a4b2a6.so\n"
                    "7f02-7f03 r-xp 00000000 08:01 2 /venv/lib/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0\n")
    debian = {"/etc/debian_version"}.__contains__
    line = blas.hint({}, "linux", debian, str(maps))
    assert line == (f"note: MLX runs its reference BLAS here; with OpenBLAS prefill is {blas.PREFILL_SPEEDUP} faster "
                    "(posttrainllm preloads it once installed): sudo apt-get install libopenblas0-pthread")
    assert blas.hint({}, "linux", lambda p: False, str(maps)).endswith(
        ": install OpenBLAS (libopenblas.so.0) with your package manager")
    assert blas.hint({}, "darwin", debian, str(maps)) is None
    assert blas.hint({blas.OFF_VAR: "1"}, "linux", debian, str(maps)) is None       # turned off on purpose
    assert blas.hint({}, "linux", {DEBIAN}.__contains__, str(maps)) is None           # installed, not loaded here
    maps.write_text(f"7f00-7f01 r-xp 00000000 08:01 1 {Path(DEBIAN).parent}/libopenblasp-r0.3.21.so\n")
    assert blas.hint({}, "linux", debian, str(maps)) is None                          # loaded


def test_blas_note_prints_only_on_a_terminal(monkeypatch, capsys):
    from tinygpt_mlx.cli import common

    class Stream:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

    monkeypatch.setattr(blas, "hint", lambda: "note: the [hint]")
    common.blas_note(Stream(False))
    assert capsys.readouterr().err == ""
    common.blas_note(Stream(True))
    assert capsys.readouterr().err == "note: the [hint]\n"
    monkeypatch.setattr(blas, "hint", lambda: None)
    common.blas_note(Stream(True))
    assert capsys.readouterr().err == ""


def _sgemm_bindings(tmp_path: Path, **env) -> list[str]:
    """Run `sample` as a user does and return, from the dynamic loader's own log
    (LD_DEBUG=bindings), the library each binding of libmlx's `cblas_sgemm` went to."""
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARK_VAR, blas.OFF_VAR)}
    log = tmp_path / ("ld" + "".join(f"-{k}" for k in env)) / "bindings"    # a folder per run: runs side by side
    log.parent.mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "tinygpt_mlx.cli.main", "sample", "-n", "2", "-p", "And God said",
                        "--seed", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**clean, "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(log), **env})
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
    found = []
    for f in log.parent.iterdir():
        with open(f, errors="replace") as lines:
            found += [line.split(" to ", 1)[1].split(" [")[0] for line in lines
                      if "libmlx.so" in line.split(" to ", 1)[0] and line.rstrip().endswith("`cblas_sgemm'")]
        f.unlink()
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux") or blas.find_openblas() is None,
                    reason="no OpenBLAS on this machine (sudo apt-get install libopenblas0-pthread)")
@pytest.mark.slow
def test_the_command_runs_with_openblas_preloaded_and_mlx_calls_it(tmp_path):
    """`posttrainllm sample` re-executes itself once, before MLX loads, with the OpenBLAS found
    preloaded: the loader binds MLX's `cblas_sgemm` to it, once (one process image loaded MLX);
    with POSTTRAINLLM_NO_BLAS_PRELOAD=1 it binds MLX's own reference BLAS."""
    library = blas.find_openblas()
    with ThreadPoolExecutor(max_workers=2) as pool:      # the two runs side by side: two processes
        preloaded = pool.submit(_sgemm_bindings, tmp_path)
        reference = pool.submit(_sgemm_bindings, tmp_path, **{blas.OFF_VAR: "1"})
    assert preloaded.result() == [library]
    [own] = reference.result()
    assert Path(own).name.startswith("libblas") and "mlx" in own, own


NO_OPENBLAS = """
import sys
from tinygpt_mlx import blas
blas.find_openblas = lambda *a, **k: None       # as on a Linux without OpenBLAS
sys.argv = ["posttrainllm", *sys.argv[1:]]
from tinygpt_mlx.cli.main import app
app()
"""


def _stderr_on_a_terminal(command: list[str], env: dict) -> list[str]:
    master, slave = pty.openpty()
    p = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:      # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert p.wait(timeout=300) == 0
    # a terminal gets colours and the transient `loading NAME ...` spinner (its frames, then
    # cursor-up/erase-line sequences that clear it): drop every control sequence and the frames
    text = re.sub(r"\x1b\[[0-9;?]*[ -/]*[@-~]", "", b"".join(chunks).decode())
    return [line for line in text.splitlines() if line.strip() and not LOADING_FRAME.match(line.strip())]


LOADING_FRAME = re.compile(r"^[^\w\s]?\s*loading .+ \.\.\.$")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the note is Linux's")
@pytest.mark.slow
def test_without_openblas_a_terminal_gets_one_note_and_captured_stderr_none():
    """`sample` on a terminal: the note once, before the banner; captured (a script, a test): no
    note; `info`, which computes nothing: no note."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARK_VAR, blas.OFF_VAR)}
    command = [sys.executable, "-c", NO_OPENBLAS, "sample", "-n", "2", "-p", "And God said", "--seed", "0"]
    with ThreadPoolExecutor(max_workers=3) as pool:      # the three runs side by side: three processes
        on_terminal = pool.submit(_stderr_on_a_terminal, command, env)
        captured = pool.submit(subprocess.run, command, cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300)
        info = pool.submit(_stderr_on_a_terminal, [sys.executable, "-c", NO_OPENBLAS, "info"], env)
    lines = on_terminal.result()
    notes = [i for i, line in enumerate(lines) if "reference BLAS" in line]
    assert len(notes) == 1 and lines[notes[0]].startswith("note: MLX runs its reference BLAS here"), lines
    assert lines[notes[0] + 1].startswith("posttrainllm · model"), lines        # then the banner
    captured = captured.result()
    assert captured.returncode == 0 and "BLAS" not in captured.stderr, captured.stderr
    assert not [line for line in info.result() if "BLAS" in line]



def test_a_real_model_module_runs_under_openblas_in_a_process_of_its_own(tmp_path):
    """tests/openblas.py: a module handed to `under_openblas` runs in a pytest process that has
    OpenBLAS mapped (the module here checks it), and its failure fails the caller."""
    from tests import openblas

    if not openblas.elsewhere():
        pytest.skip("this process has OpenBLAS already, or none is found")
    module = tmp_path / "test_mapped.py"
    module.write_text("from tinygpt_mlx import blas\n\n"
                      "def test_mapped():\n    assert blas.loaded_openblas() is not None\n")
    openblas.under_openblas(str(module), timeout=300)
    module.write_text("def test_fails():\n    assert False, 'on purpose'\n")
    with pytest.raises(AssertionError, match="on purpose"):
        openblas.under_openblas(str(module), timeout=300)
