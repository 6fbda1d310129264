"""The environment switches (tinygpt_mlx/switches.py): each keeps the values it took, and any
other value is refused in one line naming the variable and the value, at start-up, where before
it silently meant off (or on: POSTTRAINLLM_COMPILE)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tinygpt_mlx import blas, distributed, heap, switches
from tinygpt_mlx.cache import make_cache
from tinygpt_mlx.cache import cpu_softmax
from tinygpt_mlx.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
BAD = ["maybe", "2", "enable", "-1", "onn"]


@pytest.mark.parametrize("name", list(switches.FLAGS))
def test_each_flag_takes_the_words_it_took_and_its_default_unset(name):
    default = switches.FLAGS[name]
    assert switches.flag(name, {}) is default and switches.flag(name, {name: ""}) is default
    assert switches.flag(name, {name: "  "}) is default
    for word in ("1", "true", "yes", "on", "ON", " True "):
        assert switches.flag(name, {name: word}) is True, word
    for word in ("0", "false", "no", "off", "OFF", " No "):
        assert switches.flag(name, {name: word}) is False, word


@pytest.mark.parametrize("name", list(switches.FLAGS))
@pytest.mark.parametrize("value", BAD)
def test_any_other_value_is_refused_naming_the_variable_and_the_value(name, value):
    with pytest.raises(switches.SwitchError) as e:
        switches.flag(name, {name: value})
    assert str(e.value).startswith(f"{name}={value!r}: must be one of 1, true, yes, on (on) or 0, false, no, off")
    assert switches.problem({name: value}) == str(e.value)


@pytest.mark.parametrize("env, says", [
    ({"POSTTRAINLLM_QMATMUL": "fast"}, "POSTTRAINLLM_QMATMUL='fast': must be one of packed, dequantise"),
    ({"POSTTRAINLLM_RANK_TIMEOUT": "soon"}, "POSTTRAINLLM_RANK_TIMEOUT='soon': must be a positive number"),
    ({"POSTTRAINLLM_RANK_TIMEOUT": "0"}, "POSTTRAINLLM_RANK_TIMEOUT='0': must be a positive number"),
])
def test_the_other_switches_are_checked_too(env, says):
    assert switches.problem(env).startswith(says)


@pytest.mark.parametrize("value, seconds", [(None, 300.0), ("", 300.0), ("  ", 300.0), ("2.5", 2.5), (" 7 ", 7.0)])
def test_a_rank_reads_the_timeout_the_start_up_check_passed(value, seconds, monkeypatch):
    """What passes the start-up check is what a rank's guard takes: unset or empty the default
    (an empty value passed the check and then failed in the rank, float(''), until session 43);
    a refused value is refused by the guard too, naming it."""
    monkeypatch.delenv(switches.RANK_TIMEOUT, raising=False)
    if value is not None:
        monkeypatch.setenv(switches.RANK_TIMEOUT, value)
    assert switches.problem(os.environ) is None
    assert distributed.Guard(0).timeout == seconds == switches.rank_timeout()
    assert distributed.DEFAULT_RANK_TIMEOUT == 300.0
    for bad in ("soon", "0", "-3", "nan"):
        monkeypatch.setenv(switches.RANK_TIMEOUT, bad)
        with pytest.raises(switches.SwitchError) as e:
            distributed.Guard(0)
        assert str(e.value) == switches.problem(os.environ), bad
        assert str(e.value).startswith(f"{switches.RANK_TIMEOUT}={bad!r}: must be a positive number"), bad


def test_a_fine_environment_has_no_problem():
    env = {"POSTTRAINLLM_COMPILE": "0", "POSTTRAINLLM_STAGE_SPILLS": "yes", "POSTTRAINLLM_NO_FAST_EXP": "1",
           "POSTTRAINLLM_QMATMUL": "dequantise", "POSTTRAINLLM_RANK_TIMEOUT": "2.5", "POSTTRAINLLM_CACHE": "/x"}
    assert switches.problem(env) is None and switches.problem({}) is None


def test_the_library_reads_each_switch_through_it(native, monkeypatch):
    """A new cache's compile and staging defaults, the BLAS plan, the heap's tuning and the fast
    softmax each follow their switch, and refuse a value it does not take."""
    for name in switches.FLAGS:
        monkeypatch.delenv(name, raising=False)
    assert make_cache(native.model).compile_decode is True and make_cache(native.model).stage_spills is False
    monkeypatch.setenv("POSTTRAINLLM_COMPILE", "off")
    monkeypatch.setenv("POSTTRAINLLM_STAGE_SPILLS", "on")
    cache = make_cache(native.model)
    assert cache.compile_decode is False and cache.stage_spills is True
    for name in ("POSTTRAINLLM_COMPILE", "POSTTRAINLLM_STAGE_SPILLS"):
        monkeypatch.setenv(name, "maybe")
        with pytest.raises(switches.SwitchError, match=f"{name}='maybe'"):
            make_cache(native.model)
        monkeypatch.delenv(name)
    exists = {"/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"}.__contains__
    assert blas.plan(["sample"], {blas.OFF_VAR: "no"}, "linux", exists=exists,
                     multiarch=["x86_64-linux-gnu"]).library is not None
    with pytest.raises(switches.SwitchError, match=blas.OFF_VAR):
        blas.plan(["sample"], {blas.OFF_VAR: "please"}, "linux", exists=exists, multiarch=["x86_64-linux-gnu"])
    with pytest.raises(switches.SwitchError, match=heap.OFF_VAR):
        heap.keep_large_blocks({heap.OFF_VAR: "please"}, "linux")
    monkeypatch.setattr(cpu_softmax.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_softmax.shutil, "which", lambda name: "/usr/bin/g++")
    monkeypatch.setenv("POSTTRAINLLM_NO_FAST_EXP", "0")
    assert cpu_softmax.wanted()
    monkeypatch.setenv("POSTTRAINLLM_NO_FAST_EXP", "x")
    with pytest.raises(switches.SwitchError, match="POSTTRAINLLM_NO_FAST_EXP='x'"):
        cpu_softmax.wanted()


@pytest.mark.parametrize("name", [*switches.FLAGS, "POSTTRAINLLM_QMATMUL"])
def test_the_cli_refuses_it_in_one_line_before_any_work(name, monkeypatch, tmp_path):
    """Through the app (as a test or a program calls it) and as the command itself, which checks
    before its re-execution with OpenBLAS: one `error:` line, exit code 2, nothing on stdout."""
    monkeypatch.setenv(name, "maybe")
    r = CliRunner().invoke(app, ["info"])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip() == switches.problem({name: "maybe"}).join(["error: ", ""]) and not r.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSTTRAINLLM_")}
    p = subprocess.run([sys.executable, "-m", "tinygpt_mlx.cli.main", "sample", "-p", "hi", "-n", "2"],
                       capture_output=True, text=True, cwd=ROOT, env={**env, name: "maybe"}, timeout=120)
    assert p.returncode == 2 and not p.stdout, p.stderr
    assert p.stderr.strip().splitlines() == [f"error: {switches.problem({name: 'maybe'})}"], p.stderr
