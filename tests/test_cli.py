"""The CLI through typer's CliRunner: banner/report on stderr, only text on stdout, clear errors."""

import json
import socket
import time

import pytest
import typer
from typer.testing import CliRunner

from tinygpt_mlx.cli import common
from tinygpt_mlx.cli.main import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_sample_streams_text_and_reports(native_path, tmp_path):
    out = tmp_path / "r.json"
    r = run("sample", native_path, "--prompt", "The quick", "--tokens", 12, "--temperature", 0,
            "--report-json", out)
    assert r.exit_code == 0, r.output
    assert "posttrainllm" in r.stderr and "cache policy: fp32" in r.stderr and "report" in r.stderr
    assert "posttrainllm" not in r.stdout and "report" not in r.stdout
    rep = json.loads(out.read_text())
    for key in ("prompt_tokens", "generated_tokens", "current_length", "stored_count", "cache_bytes",
                "prefill_tokens_per_s", "decode_tokens_per_s", "policy"):
        assert key in rep
    assert rep["generated_tokens"] == 12 and rep["current_length"] == rep["stored_count"]
    assert rep["cache_bytes"] > 0 and rep["policy"]["storage"] == "fp32"


def test_sample_is_deterministic_at_temperature_zero(native_path):
    a = run("sample", native_path, "-p", "In the beginning", "-n", 10, "--temperature", 0)
    b = run("sample", native_path, "-p", "In the beginning", "-n", 10, "--temperature", 0)
    assert a.exit_code == 0 and a.stdout == b.stdout and a.stdout.strip()


def test_sample_seeded_sampling_is_reproducible(native_path):
    args = ("sample", native_path, "-p", "word", "-n", 10, "--temperature", 1.0, "--top-p", 0.9, "--seed", 7)
    assert run(*args).stdout == run(*args).stdout


def test_streaming_report_shows_cap(native_path, tmp_path):
    out = tmp_path / "r.json"
    r = run("sample", native_path, "-p", "The quick brown fox", "-n", 40, "--temperature", 0,
            "--streaming-llm-sink", 4, "--streaming-llm-window", 16, "--report-json", out)
    assert r.exit_code == 0, r.output
    assert "stored 20 (StreamingLLM cap)" in r.stderr.replace("\n", " ")
    rep = json.loads(out.read_text())
    assert rep["stored_count"] == 20 and rep["current_length"] > 20
    assert rep["policy"]["streaming_llm"] == {"sink": 4, "window": 16, "rope_mode": "shifted"}


def test_info(native_path):
    r = run("info", native_path, "--json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["config"]["n_layers"] == 2


def test_mlx_lm_directory(llama_dir):
    r = run("sample", llama_dir, "-p", "The quick", "-n", 5, "--temperature", 0, "--kv-quantize", "bf16")
    assert r.exit_code == 0, r.output
    assert "mlx-lm" in r.stderr and "bf16" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--kv-quantize", "int3"], "'--kv-quantize': must be one of"),
    (["--streaming-llm-sink", "4"], "needs --streaming-llm-window"),
    (["--streaming-llm-sink", "-1", "--streaming-llm-window", "8"], "'--streaming-llm-sink': must be"),
    (["--streaming-llm-window", "0"], "'--streaming-llm-window': must be"),
    (["--streaming-llm-window", "8", "--streaming-llm-rope", "sideways"], "'--streaming-llm-rope'"),
    (["--streaming-llm-rope", "absolute"], "needs --streaming-llm-window"),
    (["--temperature", "-1"], "'--temperature'"),
    (["--top-p", "0"], "'--top-p'"),
    (["--tokens", "-5"], "'--tokens'"),
    (["--prefill-chunk", "0"], "'--prefill-chunk'"),
    (["--kiv-cold-ram", "512"], "'--kiv-cold-ram': bounds the RAM of retrieval's ram cold store: it needs --kiv-hot-budget"),
    (["--kiv-hot-budget", "64", "--kiv-cold-ram", "0"], "'--kiv-cold-ram': must be an integer >= 1, got 0"),
    (["--kiv-hot-budget", "64", "--kiv-cold-ram", "8", "--kiv-cold-store", "disk"], "and --kiv-cold-store ram"),
])
def test_bad_flags_exit_nonzero_with_one_clear_line(native_path, args, message):
    r = run("sample", native_path, "-p", "hi", *args)
    assert r.exit_code != 0
    assert message in r.output


@pytest.mark.parametrize("args, typed", [
    (["sample", "-p", "hi", "-nabc"], "abc"),                           # an attached short option
    (["sample", "-p", "hi", "--tokens=abc"], "abc"),
    (["sample", "-p", "hi", "--tokens", "5", "--tokens", "abc"], "abc"),  # click keeps the last
    (["sample", "-p", "--tokens", "--tokens", "abc"], "abc"),          # '--tokens' is -p's value
    (["sample", "-p", "hi", "--temperature", "hot", "-n", "5"], "hot"),
    (["cache-report", "-l", "5", "-l", "abc", "-l", "7x"], "abc"),      # the first that fails
    (["cache-report", "-l5", "-l", "7x"], "7x"),
])
def test_a_conversion_error_names_the_value_click_rejected(args, typed):
    """click's own conversion errors ("Input should be a valid integer") get `, got '...'`: the
    value click converted, parsed again by click's parsers (cli/main.py `typed_value`), not the
    first string after the option's name."""
    r = run(*args)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Invalid value for" in lines[0], r.stderr
    assert f"got {typed!r}" in lines[0] and lines[0].count(" got ") == 1, lines[0]


def test_bad_model_and_prompt_errors(native_path, tmp_path):
    r = run("sample", tmp_path / "missing.tinygpt", "-p", "hi")
    assert r.exit_code == 1 and "error:" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    junk = tmp_path / "junk.tinygpt"
    junk.write_bytes(b"\x00" * 64)
    r = run("sample", junk, "-p", "hi")
    assert r.exit_code == 1 and "not a safetensors file" in r.stderr
    long_prompt = "word " * 400  # the tiny model's context is 256
    r = run("sample", native_path, "-p", long_prompt, "-n", 2)
    assert r.exit_code == 1 and "context" in r.stderr
    r = run("sample", native_path, "-p", long_prompt, "-n", 2, "--temperature", 0,
            "--streaming-llm-sink", 4, "--streaming-llm-window", 64)
    assert r.exit_code == 0, r.output
    r = run("sample", native_path, "-p", "a", "--prompt-file", native_path)
    assert r.exit_code != 0 and "not both" in r.output


def test_ignore_eos_generates_every_token(native_path, tmp_path):
    out = tmp_path / "r.json"
    r = run("sample", native_path, "-p", "The", "-n", 300, "--temperature", 1.0, "--seed", 0,
            "--ignore-eos", "--streaming-llm-sink", 4, "--streaming-llm-window", 32, "--report-json", out)
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert rep["generated_tokens"] == 300 and rep["stored_count"] == 36 and rep["current_length"] == 300


def test_train_bad_flags_give_one_line_errors(tmp_path):
    """A missing --init-from checkpoint and a row mix over 100% fail fast, before any data
    is read, with one red line and exit code 1."""
    pytest.importorskip("torch")
    base = ("train", "--data", tmp_path / "nothing", "--out", tmp_path / "m.tinygpt", "--steps", 1)
    r = run(*base, "--init-from", tmp_path / "missing.pt")
    assert r.exit_code == 1 and "no checkpoint at" in r.output and len(r.output.strip().splitlines()) == 1
    r = run(*base, "--needle-fraction", 0.8, "--copy-fraction", 0.5)
    assert r.exit_code == 1 and "--copy-fraction" in r.output and "sum to at most 1, got 0.8 + 0.5" in r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, said", [
    (["--precision", "fp8"], "Invalid value for '--precision': 'fp8' is not one of 'bf16', 'fp32'"),
    (["--d-model", 0], "--d-model must be an integer >= 1, got 0"),
    (["--n-heads", 5], "--d-model 256 is not divisible by --n-heads 5"),
    (["--n-kv-heads", 3], "--n-heads 8 is not divisible by --n-kv-heads 3"),
    (["--d-model", 24, "--n-heads", 8], "the head dimension (--d-model / --n-heads) must be even"),
    (["--seq-len", 64, "--n-layers", 1, "--yoco"], "--yoco needs at least 2 layers")])
def test_train_shape_and_precision_errors_name_the_flags_before_any_work(tmp_path, flags, said):
    """The model's shape and --precision are checked before the corpus is read or a tokenizer
    trained, in the flags' names (they said `d_model 256 is not divisible by n_heads 5` or
    `precision must be bf16 or fp32`, exit code 1, some after training the tokenizer)."""
    work = tmp_path / "work"
    r = run("train", "--data", tmp_path / "nothing", "--out", tmp_path / "m.tinygpt", "--steps", 1,
            "--work-dir", work, *flags)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], r.stderr
    assert not work.exists()


def test_atomic_writes_get_the_mode_a_plain_open_gives(tmp_path):
    """write_atomic goes through a mkstemp file (mode 0600); the file it leaves has the mode a
    plain `open()` would give it (0666 less the umask), so others can read a --json report."""
    import os

    from tinygpt_mlx.cli.common import write_atomic
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a.json", "{}")
        (tmp_path / "b.json").write_text("{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == (tmp_path / "b.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "a.json").read_text() == "{}" and not list(tmp_path.glob(".*.tmp"))


def test_serve_reads_ollama_host_and_a_bad_one_is_one_line(native_path, monkeypatch):
    """`serve` listens where OLLAMA_HOST says, as `ollama serve` does (where it does listen is
    checked by test_readme's serve run); a value it cannot read is one line naming it, before
    anything is loaded. --host/--port win over it."""
    monkeypatch.setenv("OLLAMA_HOST", "127.0.0.1:port")
    r = run("serve", native_path)
    assert r.exit_code == 2 and r.stderr.strip() == "error: OLLAMA_HOST='127.0.0.1:port': port 'port' is not a " \
        "number in 1-65535", r.output
    r = run("serve", native_path, "--host", "127.0.0.1", "--port", "0")   # both flags: OLLAMA_HOST is not read

    assert r.exit_code != 0 and "'--port'" in r.output


def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(native_path, monkeypatch):
    """`serve` where something already listens: one line naming the address, exit 1, and no model
    loaded, no banner (uvicorn said so only after loading, below the banner, and exited 3); an
    unknown host likewise."""
    monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run("serve", native_path, "--host", "127.0.0.1", "--port", port)
        assert r.exit_code == 1, r.output
        assert r.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: the port is in use (another " \
            "server listens there: stop it, or give another --port)", r.stderr
        monkeypatch.setenv("OLLAMA_HOST", f"127.0.0.1:{port}")
        r = run("serve", native_path)
        assert r.exit_code == 1 and r.stderr.strip().startswith(f"error: cannot listen on 127.0.0.1:{port}:"), r.stderr
    r = run("serve", native_path, "--host", "nothost.invalid", "--port", port)
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cannot listen on nothost.invalid:" in r.stderr and "host 'nothost.invalid' is not known" in r.stderr


def test_serve_checks_every_address_of_its_host_as_uvicorn_binds_them(monkeypatch, capsys):
    """A host with several addresses (localhost: ::1 and 127.0.0.1) is refused only where uvicorn
    would fail: asyncio's create_server binds each address and skips one not available here (::1
    with IPv6 off), so the check does too, and still refuses a port in use at any of them or a host
    with no address it can bind. Before, only the first address was tried: refused on ::1."""
    from tinygpt_mlx.cli import serve as serve_cmd

    def addresses(*hosts):
        infos = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (h, port)) for h in hosts]
        monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: infos)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    addresses("192.0.2.1", "127.0.0.1")          # (TEST-NET-1: no interface of this machine has it)
    serve_cmd.check_listen("both", port)
    addresses("192.0.2.1")
    with pytest.raises(typer.Exit):
        serve_cmd.check_listen("neither", port)
    assert capsys.readouterr().err.strip().startswith(f"error: cannot listen on neither:{port}: ")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        addresses("192.0.2.1", "127.0.0.1")
        with pytest.raises(typer.Exit):
            serve_cmd.check_listen("both", port)
    assert "the port is in use" in capsys.readouterr().err


def test_every_option_of_every_command_says_what_it_does():
    """`posttrainllm CMD --help` explains each flag: no option without a help text (train's model
    shape, batch size and intervals had none before session 43)."""
    group = typer.main.get_command(app)
    bare = [f"{name} {p.opts[0]}" for name, cmd in group.commands.items() for p in cmd.params
            if p.param_type_name == "option" and not (getattr(p, "help", None) or "").strip()]
    assert bare == []


def test_version_is_the_installed_packages(monkeypatch):
    """`posttrainllm --version`: the version in the installed package's metadata; where the package
    is not installed (a checkout run with `python -m`), pyproject.toml's."""
    import tomllib
    from importlib import metadata
    from pathlib import Path

    from tinygpt_mlx.cli import main

    r = run("--version")
    assert r.exit_code == 0 and r.stdout == f"posttrainllm {metadata.version('posttrainllm')}\n", r.output
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(main.metadata, "version", not_installed)
    r = run("--version")
    assert r.exit_code == 0 and r.stdout == f"posttrainllm {project['version']}\n", r.output
    assert "--version" in run("--help").stdout


@pytest.mark.parametrize("terminal", [True, False])
def test_a_terminal_is_told_what_is_loading(monkeypatch, terminal):
    """While the model loads (a GGUF: seconds, minutes on a busy CPU, before the banner) a terminal
    shows `loading NAME ...`, erased once loaded; captured stderr gets nothing."""
    import io
    from pathlib import Path

    from rich.console import Console

    buf = io.StringIO()
    monkeypatch.setattr(common, "err", Console(file=buf, force_terminal=terminal, width=80))
    during = []

    def load(model, weights):   # a load of a second at most: the spinner draws its first frame within 0.1 s
        for _ in range(20):
            if "loading" in buf.getvalue():
                break
            time.sleep(0.05)
        during.append(buf.getvalue())
        return "loaded"
    monkeypatch.setattr("tinygpt_mlx.loading.load", load)
    model = common.resolve_model(str(Path(__file__).resolve().parents[1] / "models" / "tinygpt-base.tinygpt"))
    assert common.load_model(model, compute=False) == "loaded"
    if terminal:
        assert f"loading {model.name} ..." in during[0], during
    else:
        assert during == [""] and buf.getvalue() == ""


@pytest.mark.parametrize("args, named", [(["--log-level", "bogus"], "'--log-level': choose one of critical"),
                                         (["--name", "a", "--name", "b"], "--name given 2 times for 1 model"),
                                         (["--parallel", "0"], "'--parallel': must be an integer >= 1, got 0"),
                                         (["--slot-checkpoints", "-1"], "'--slot-checkpoints'")])
def test_serve_bad_values_are_usage_errors_before_the_model_loads(native_path, monkeypatch, args, named):
    """serve's own bad values: one line naming the flag, exit 2, before the model loads (before
    session 44 --log-level and --name failed after loading it, exit 1; --parallel 0 and
    --slot-checkpoints -1 named the config's field, not the flag)."""
    monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    r = run("serve", native_path, "--port", 1, *args)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and named in lines[0], r.output


def test_serve_log_level_trace_is_uvicorns(native_path, monkeypatch):
    """`--log-level trace`, uvicorn's own level below debug, runs (it failed after loading the
    model: `logging` has no TRACE until uvicorn's config is imported); any case is taken."""
    import uvicorn

    import logging

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    # as in the command, where uvicorn's config (which names level 5 TRACE) is not imported yet
    monkeypatch.delitem(logging._nameToLevel, "TRACE", raising=False)
    monkeypatch.setattr(logging.root, "handlers", [])   # (pytest's make basicConfig a no-op)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run("serve", native_path, "--port", port, "--log-level", "TRACE")
    assert r.exit_code == 0, r.output
    served, kw = calls[0]
    served.state.server.worker.stop()
    assert kw["log_level"] == "trace"
