"""`posttrainllm --help` and flag errors answer without loading MLX's model code.

mlx-lm's package imports transformers (and torch where installed): seconds of start-up. The CLI
modules declare the library at their top to load on first use (`lazy`, tinygpt_mlx/lazy.py;
tinygpt_mlx/cli/main.py), and `tinygpt_mlx` exports its names lazily; this checks the import graph
rather than a time (no timed tests)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("mlx_lm", "transformers", "torch", "fastapi", "uvicorn", "tinygpt_mlx.cache", "tinygpt_mlx.loading", "numpy",
         "tinygpt_mlx.resolve", "tinygpt_mlx.train")


def _loaded_after(code: str) -> set:
    probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_cli_import_and_help_load_no_model_code():
    for code in ("import tinygpt_mlx.cli.main",
                 "from typer.testing import CliRunner\nfrom tinygpt_mlx.cli.main import app\n"
                 "r = CliRunner().invoke(app, ['sample', '--help'])\nassert r.exit_code == 0, r.output"):
        loaded = _loaded_after(code)
        assert not [m for m in HEAVY if m in loaded], [m for m in HEAVY if m in loaded]


def test_the_package_exports_its_names_lazily():
    loaded = _loaded_after("import tinygpt_mlx.config")
    assert "mlx_lm" not in loaded and "tinygpt_mlx.cache" not in loaded
    loaded = _loaded_after("import tinygpt_mlx\nf = tinygpt_mlx.make_cache\n"
                           "assert f is sys.modules['tinygpt_mlx.cache'].make_cache")
    assert "tinygpt_mlx.cache" in loaded


def test_info_and_sample_run_without_the_training_extra():
    """The base install has no torch (only `[train]` brings it): with torch unimportable,
    `info` and a short `sample` on the shipped model still run."""
    for args in (["info"], ["sample", "-n", "2", "-p", "hi", "--seed", "0"]):
        code = ("import sys\nsys.modules['torch'] = None\nsys.argv = ['posttrainllm', *%r]\n"
                "from tinygpt_mlx.cli.main import app\napp()" % (args,))
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr


def test_the_wheel_installs_only_the_project_namespace():
    """No top-level `cli` (or other generic) package lands in site-packages: the commands live in
    tinygpt_mlx.cli, and the wheel's package list is what pyproject's find rule gives."""
    import tomllib
    from pathlib import Path

    from setuptools import find_packages

    root = Path(__file__).resolve().parent.parent
    rule = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(root), include=rule["include"])
    assert "tinygpt_mlx.cli" in packages
    assert {p.split(".")[0] for p in packages} == {"tinygpt_mlx"}, packages
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"posttrainllm": "tinygpt_mlx.cli.main:app"}


def test_lazy_modules_import_on_first_use_and_name_what_exists():
    """`lazy(...)` (tinygpt_mlx/lazy.py) imports nothing until an attribute is read; every module
    the package declares that way imports, and every attribute read through it exists there (a
    typo fails here, not in a user's command)."""
    import ast
    import importlib

    loaded = _loaded_after("from tinygpt_mlx.lazy import lazy\ng = lazy('tinygpt_mlx.generate')\nrepr(g)")
    assert "tinygpt_mlx.generate" not in loaded and "mlx_lm" not in loaded
    loaded = _loaded_after("from tinygpt_mlx.lazy import lazy\ng = lazy('tinygpt_mlx.generate')\n"
                           "assert g.check_context is sys.modules['tinygpt_mlx.generate'].check_context")
    assert "tinygpt_mlx.generate" in loaded
    checked = 0
    for path in sorted((ROOT / "tinygpt_mlx").rglob("*.py")):
        tree = ast.parse(path.read_text())
        declared = {node.targets[0].id: node.value.args[0].value for node in tree.body
                    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Name) and node.value.func.id == "lazy"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in declared:
                module = importlib.import_module(declared[node.value.id])
                assert hasattr(module, node.attr), f"{path.name}: {declared[node.value.id]} has no {node.attr}"
                checked += 1
    assert checked >= 19


@pytest.mark.parametrize("policy", [["--streaming-llm-sink", "4", "--kiv-hot-budget", "8", "--kv-quantize", "int4"],
                                    []], ids=["retrieval-int4", "no-cache-flags"])
def test_sample_on_the_shipped_model_loads_neither_mlx_lm_nor_transformers(policy):
    """The native model runs on MLX alone: mlx-lm (whose package imports transformers, and torch
    where installed: seconds at every start, ~300 MB of RSS) is imported only where an mlx-lm or
    GGUF model, or mlx-lm's own caches, need it (loading, the cache factory's layout of a
    non-native model, attention's fallback for a cache that is not ours). With no cache flags (the
    full fp32 cache, whose layers attend through that fallback) it imported mlx-lm in the first
    prefill: `prefill 0.5 tok/s` for a 3-token prompt, peak RSS 305 MiB instead of 93."""
    args = ["sample", "-p", "And God said", "-n", "6", "--seed", "0", *policy]
    code = (f"sys.argv = ['posttrainllm', *{args!r}]\nfrom tinygpt_mlx.cli.main import app\n"
            "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('---modules---')")
    probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "POSTTRAINLLM_NO_BLAS_PRELOAD": "1"})
    assert out.returncode == 0 and "report:" in out.stderr, out.stderr
    loaded = set(out.stdout.split("---modules---")[1].split())
    assert "tinygpt_mlx.cache" in loaded and "tinygpt_mlx.loading" in loaded
    assert not {"mlx_lm", "transformers", "torch"} & loaded, {"mlx_lm", "transformers", "torch"} & loaded


def test_ctrl_c_while_the_command_starts_says_interrupted_without_a_traceback():
    """A Ctrl-C during the CLI's own imports (before click or `guarded` can catch one): the line
    `interrupted` and exit code 130, as later; it printed a KeyboardInterrupt traceback. The
    signal is sent from inside the import of a command module, so the moment is the same every run."""
    probe = (
        "import importlib.abc, os, signal, sys, time\n"
        "sys.argv[0] = 'posttrainllm'\n"
        "class Hit(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tinygpt_mlx.cli.sample':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "            time.sleep(2)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hit())\n"
        "import tinygpt_mlx.cli.main\n"
        "print('imported')\n")
    env = {**__import__("os").environ, "POSTTRAINLLM_NO_BLAS_PRELOAD": "1"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 130, (out.returncode, out.stderr)
    assert out.stderr.strip() == "interrupted" and "imported" not in out.stdout, out.stderr
