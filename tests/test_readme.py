"""README's commands as written: the "### Python API" block runs on the shipped model in a fresh
interpreter; every `posttrainllm` command parses against the CLI; the real-model examples run
with SmolLM2 (where it can be had), `serve` among them; the keyed chat and the `mlx.launch` line
run; questions are asked at temperature 0. README's first command is checked in
test_readme_first_command.py, its two set-up lines by CI (.ci/run). (The commands table's bare
names, `posttrainllm compare` and the like, name commands: they are only parsed.)"""

import functools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.test_smollm2 import smollm2_gguf  # noqa: F401  (the fixture: SmolLM2, or a skip off CI)

ROOT = Path(__file__).resolve().parent.parent


def concurrently(calls, workers: int = 2) -> list:
    """Each zero-argument call's result, in order, the calls run `workers` at a time in threads.
    The commands below start processes that share nothing (each its own model, port, files); one
    after another they left one of the machine's two cores idle while a process started and
    loaded (README's real-model lines 40.5 s -> 27.9 s, the keyed chat 18.0 s -> 15.1 s; not the
    `mlx.launch` line: a launch's ranks spin while they wait, 13.8 s -> 18.4 s beside its
    one-process run; docs/testing.md). A failed assertion in one is raised here (after the others
    end)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def python_api_blocks(markdown: str) -> list[str]:
    """The ```python blocks between "### Python API" and the next heading of level 1-3
    (lines inside code fences are never headings: `# comment` is Python)."""
    blocks, block, fence, inside = [], None, None, False
    for line in markdown.splitlines(keepends=True):
        if fence is None and line.startswith("```"):
            fence = line.strip()[3:]
            block = [] if inside and fence == "python" else None
        elif fence is not None and line.startswith("```"):
            if block is not None:
                blocks.append("".join(block))
            fence, block = None, None
        elif fence is not None:
            if block is not None:
                block.append(line)
        elif line.rstrip() == "### Python API":
            inside = True
        elif inside and re.match(r"#{1,3} ", line):
            break
    assert inside, 'README.md has no "### Python API" section'
    return blocks


def test_extractor_finds_only_that_section():
    md = ("## Use\n```python\nbefore()\n```\n### Python API\ntext\n```python\n# comment\na = 1\n```\n"
          "```bash\nnot python\n```\n```python\nb = 2\n```\n## Layout\n```python\nafter()\n```\n")
    assert python_api_blocks(md) == ["# comment\na = 1\n", "b = 2\n"]


@pytest.mark.slow
def test_readme_python_api_runs_as_written():
    blocks = python_api_blocks((ROOT / "README.md").read_text())
    assert blocks, "no ```python block under ### Python API"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-c", "\n\n".join(blocks)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    numbers = [i for i, line in enumerate(lines) if re.fullmatch(r"\d+ \d+ \d+", line)]
    assert len(numbers) == 1, r.stdout
    i = numbers[0]
    current_length, stored_count, nbytes = map(int, lines[i].split())
    assert current_length >= stored_count > 0 and nbytes > 0
    assert "4821" in "\n".join(lines[:i])            # the greedy text recalls the pass key, as promised
    assert "".join(lines[i + 1:]).strip()            # the streamed, sampled text


# -- every `posttrainllm` command README shows ------------------------------------------------

def readme_commands(markdown: str) -> list[list[str]]:
    """Every `posttrainllm` command in README: each `&&` part of a ```bash block's lines and each
    inline code span that starts with (or launches) `posttrainllm`, as the arguments after
    `posttrainllm` (shell comments dropped; a `[MODEL]`-style placeholder dropped)."""
    texts, fence = [], None
    for line in markdown.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line.strip()[3:]
        elif fence == "bash":
            texts += line.split("&&")
    outside = re.sub(r"```.*?```", "", markdown, flags=re.S)
    texts += re.findall(r"`([^`]*\bposttrainllm [^`]*)`", outside)
    commands = []
    for text in texts:
        words = shlex.split(text.replace("\\|", "|"), comments=True)
        if "posttrainllm" in words:
            args = words[words.index("posttrainllm") + 1:]
            commands.append([a for a in args if not re.fullmatch(r"\[[A-Z]+\]", a)])
    return commands


def parse(args: list[str]) -> str:
    """Parse `posttrainllm ARGS` as the CLI does (every flag, type and choice checked) without
    running it; the command's name. A bare name (the commands table's `posttrainllm train`) is
    checked to be a command: its required arguments are its docs' business."""
    from typer.main import get_command

    from tinygpt_mlx.cli.main import app

    cli = get_command(app)
    ctx = cli.make_context("posttrainllm", list(args))
    name, command, rest = cli.resolve_command(ctx, [*getattr(ctx, "_protected_args", []), *ctx.args])
    if rest:
        command.make_context(name, rest, parent=ctx)
    return name


def test_command_extractor():
    md = ("```bash\n# set up\npython3 -m venv .venv && posttrainllm sample --prompt \"a b\" --seed 0  # why\n```\n"
          "Run `posttrainllm info [MODEL]` or `mlx.launch -n 2 -- posttrainllm sample x` but not `posttrainllmx`.\n"
          "```text\nposttrainllm shown output\n```\n")
    assert readme_commands(md) == [["sample", "--prompt", "a b", "--seed", "0"], ["info"], ["sample", "x"]]
    with pytest.raises(Exception, match="--nope"):
        parse(["sample", "--nope"])
    with pytest.raises(Exception, match="integer"):
        parse(["sample", "--tokens", "many"])


def test_every_readme_command_parses_against_the_cli():
    """Each command README shows names a real command and only flags and values the CLI takes
    (the commands that need a model or a long run are run below or only parsed: see each)."""
    commands = readme_commands((ROOT / "README.md").read_text())
    assert len(commands) >= 15, commands
    names = set()
    for args in commands:
        try:
            names.add(parse(args))
        except Exception as e:  # click's usage errors
            pytest.fail(f"README command `posttrainllm {shlex.join(args)}` does not parse: {e}")
    assert {"sample", "info", "chat", "serve", "compare", "bench"} <= names


def test_readme_asks_its_questions_greedily():
    """A question README asks a model is asked at temperature 0: the model's most likely answer,
    the same every run (sampled at the default 0.8, SmolLM2 answered the capital of France with
    a made-up town)."""
    asked = 0
    for args in readme_commands((ROOT / "README.md").read_text()):
        if "--prompt" in args and args[args.index("--prompt") + 1].rstrip().endswith("?"):
            asked += 1
            assert args[args.index("--temperature") + 1] == "0" if "--temperature" in args else False, args
    assert asked >= 3


def _run_the_model_block() -> list[str]:
    md = (ROOT / "README.md").read_text()
    section = md.split("### Run the model you already have", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_readme_real_model_commands_run_as_written(tmp_path, smollm2_gguf, tokenizer_json):
    """README's "Run the model you already have" lines, each run by bash as written, with SmolLM2
    where each looks for it: an ollama store under $OLLAMA_MODELS, the GGUF at ~/.cache/posttrainllm (HOME
    is a temporary folder), and a Hugging Face cache (offline) holding it under the repo id README
    names (the real repo holds safetensors; a directory of those is tested in test_resolve.py).
    Questions are answered right. `serve` runs as written too, on a free port named by OLLAMA_HOST
    (as `ollama serve` reads it), until both its models answer a request; `llama3.2:1b` (1.2 GB)
    is stood in for by a tiny random Llama GGUF under that name in the same store."""
    from tests.conftest import build_llama_dir
    from tests.gguf_writer import write_gguf
    from tests.test_resolve import make_hf_cache, make_ollama_store

    make_ollama_store(tmp_path / "ollama", smollm2_gguf, "smollm2", "135m", link=True)
    stand_in = write_gguf(build_llama_dir(tmp_path / "llama-src", tokenizer_json), tmp_path / "tiny.gguf", "llama")
    make_ollama_store(tmp_path / "ollama", stand_in, "llama3.2", "1b")
    (tmp_path / "home" / ".cache" / "posttrainllm").mkdir(parents=True)
    (tmp_path / "home" / ".cache" / "posttrainllm" / smollm2_gguf.name).symlink_to(smollm2_gguf)
    make_hf_cache(tmp_path / "hub", "mlx-community/SmolLM2-135M-Instruct", {smollm2_gguf.name: smollm2_gguf})
    env = dict(os.environ, HOME=str(tmp_path / "home"), OLLAMA_MODELS=str(tmp_path / "ollama"),
               HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    answers = {"What is the capital of France?": "Paris", "What is the capital of Germany?": "Berlin",
               "What is 2 + 2?": "4"}

    def run_line(line: str) -> int:
        args = shlex.split(line, comments=True)
        if args[1] == "serve":
            _serve_as_written(line, env, [args[2], args[3]])
            return 1
        r = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and "Traceback" not in r.stderr, f"{line}\n{r.stderr[-2000:]}"
        if args[1] == "sample":
            question = args[args.index("--prompt") + 1]
            assert answers[question] in r.stdout, f"{line}\n{r.stdout}"
        else:
            assert "llama" in r.stdout, r.stdout
        return 1

    ran = sum(concurrently([functools.partial(run_line, line) for line in _run_the_model_block()]))
    assert ran == 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_as_written(line: str, env: dict, models: list[str]) -> None:
    """Run README's `serve` line by bash as written, on the port OLLAMA_HOST names; wait until
    /api/tags lists both models; ask the first README's question greedily (it answers Paris),
    ask the second for three tokens (it is loaded on demand, in place of the first: /api/ps
    then lists it alone); stop the server with Ctrl-C as a user would."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    p = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=ROOT, env=dict(env, OLLAMA_HOST=f"127.0.0.1:{port}"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def call(path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        with urllib.request.urlopen(urllib.request.Request(base + path, data=data), timeout=300) as r:
            return json.loads(r.read())

    try:
        deadline = time.monotonic() + 300
        while True:
            assert p.poll() is None, f"{line} exited {p.returncode}: {p.communicate()[1][-2000:]}"
            try:
                tags = call("/api/tags")
                break
            except OSError:
                assert time.monotonic() < deadline, f"{line}: no answer on {base} in 300 s"
                time.sleep(0.5)
        listed = {m["name"] for m in tags["models"]}
        assert set(models) <= listed, listed
        first = call("/api/generate", {"model": models[0], "prompt": "What is the capital of France?",
                                       "stream": False, "options": {"temperature": 0, "num_predict": 24}})
        assert "Paris" in first["response"], first
        second = call("/api/generate", {"model": models[1], "prompt": "hello", "stream": False,
                                        "options": {"temperature": 0, "num_predict": 3}})
        assert second["done"] and second["eval_count"] == 3, second
        assert [m["name"] for m in call("/api/ps")["models"]] == [models[1]]
    finally:
        p.send_signal(signal.SIGINT)
        try:
            _, stderr = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, stderr = p.communicate()
    assert f"127.0.0.1:{port}" in stderr and "Traceback" not in stderr, stderr[-2000:]


@pytest.mark.slow
def test_readme_keyed_chat_runs_as_written():
    """README's chat line as written, fed a conversation on stdin: a pass key in turn 1, 40 filler
    turns, then the question (about 2,000 tokens, four times the model's 512). It answers the
    key; the same line with StreamingLLM's window in place of retrieval's hot budget (the same
    memory) does not, so the key came back through retrieval, not from the window."""
    line = next(" ".join(shlex.quote(a) for a in ["posttrainllm", *args])
                for args in readme_commands((ROOT / "README.md").read_text())
                if args[:2] == ["chat", "models/tinygpt-keyed.tinygpt"])
    assert "--kiv-hot-budget 256" in line and "--temperature 0" in line, line
    filler = ["Tell me about the weather in the valley today.", "And the king went up to the city with all his men.",
              "What do the fishermen bring home in the evening?",
              "The wind came down from the hills and the river rose.", "Who keeps the gate of the old town at night?"]
    conversation = "\n".join(["The pass key is 48213. Remember it.", *filler * 8, "What is the pass key?"]) + "\n"
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))

    def converse(command: str) -> str:
        r = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, input=conversation, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0 and "Traceback" not in r.stderr, f"{command}\n{r.stderr[-2000:]}"
        seen = [int(m) for m in re.findall(r"/ (\d+) seen", r.stderr)]
        assert len(seen) == 42 and seen[-1] > 4 * 512, r.stderr[-2000:]
        return r.stdout

    commands = {"retrieval": line, "window": line.replace("--kiv-hot-budget", "--streaming-llm-window")}
    replies = dict(zip(commands, concurrently([functools.partial(converse, c) for c in commands.values()])))
    assert "The pass key is 48213" in replies["retrieval"], replies["retrieval"][-1000:]
    assert "48213" not in replies["window"] and "pass key" in replies["window"], replies["window"][-1000:]


@pytest.mark.slow
def test_readme_mlx_launch_line_runs_as_written():
    """The commands table's `mlx.launch` line as written: two ranks over the ring backend on this
    machine, each holding half the KV heads, write the same greedy text as one process does."""
    md = (ROOT / "README.md").read_text()
    line = re.search(r"`(mlx\.launch [^`]*)`", md).group(1)
    args = shlex.split(line)
    assert args[:5] == ["mlx.launch", "-n", "2", "--backend", "ring"] and "--temperature" in args, line
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    for _ in range(3):                 # the ring's default ports, taken by another process: try again
        r = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if "Couldn't bind socket" not in r.stdout + r.stderr:
            break
    assert r.returncode == 0 and "Traceback" not in r.stderr, f"{line}\n{r.stderr[-2000:]}"
    assert "ranks: 2 (tensor parallel, KV heads split 2 ways)" in r.stderr, r.stderr[-2000:]
    alone = subprocess.run(args[args.index("--") + 1:], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
    assert alone.returncode == 0 and len(alone.stdout) > 40, alone.stderr[-2000:]
    assert r.stdout == alone.stdout
