"""MODEL as users type it -> a file or directory to load, for every command.

In order:
1. an existing path: a `.tinygpt` file, a GGUF file (by its magic bytes, whatever its name), or
   an mlx-lm / Hugging Face model directory (or a directory holding exactly one GGUF);
2. an ollama model name (`name`, `name:tag`, `namespace/name:tag`, `host/namespace/name:tag`;
   tag `latest` by default): the manifest under `$OLLAMA_MODELS` (default `~/.ollama/models`)
   names the GGUF blob of its model layer;
3. a Hugging Face repo id (`org/name`), resolved as mlx-lm resolves it: the local cache first,
   a download where the network allows (`HF_HUB_OFFLINE=1` keeps it to the cache).
Nothing is ever written into the ollama or Hugging Face folders by resolving.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from .errors import ModelFormatError
from .ggml.tensors import is_gguf

# Package data, so that a wheel (pip / pipx / uv tool install .) ships the default model; the
# repository's top-level models/ is a link to this folder.
MODELS_DIR = Path(__file__).resolve().parent / "models"
DEFAULT_MODEL_NAME = "tinygpt-base.tinygpt"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_HOST = "registry.ollama.ai"
_OLLAMA_NAME = re.compile(r"^(?:(?P<host>[\w.-]+\.[\w.-]+(?::\d+)?)/)?(?:(?P<ns>[\w.-]+)/)?"
                          r"(?P<name>[\w.-]+)(?::(?P<tag>[\w.-]+))?$")
_HF_REPO = re.compile(r"^[\w.-]+/[\w.-]+$")
# What mlx-lm fetches for a model directory, plus GGUF-only repos.
HF_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt",
               "*.jsonl", "*.jinja", "*.gguf"]


@dataclass(frozen=True)
class Resolved:
    path: Path
    format: str          # "tinygpt", "gguf" or "mlx-lm"
    source: str          # "file", "ollama", "huggingface" or "default"
    name: str            # what to call it (the ollama name, the repo id, the file's name)
    origin: str          # where it was found, in words


def default_model_path() -> Path:
    """The shipped default model; a clear error when none is shipped."""
    path = MODELS_DIR / DEFAULT_MODEL_NAME
    if not path.exists():
        raise ModelFormatError(f"no default model shipped yet ({path} is missing); pass MODEL explicitly")
    return path


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def resolve(spec: Union[str, Path, None], default: Optional[Path] = None) -> Resolved:
    """What MODEL names (None: `default`, else the shipped model); one-line errors otherwise."""
    if spec is None:
        default = default or default_model_path()
        return _from_path(default, "default", default.stem)
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists():
        return _from_path(path, "file", path.stem if path.is_file() else path.name)
    shipped = _shipped(text)
    if shipped is not None:
        return shipped
    if _looks_like_path(text):
        raise ModelFormatError(f"{text}: no such file or directory{did_you_mean(text)}")
    found = _ollama(text)
    if found is not None:
        return found
    if _HF_REPO.match(text) and ":" not in text:
        return _huggingface(text)
    raise ModelFormatError(f"{text}: no such file or directory, and no ollama model of that name "
                           f"in {ollama_root()} ({_ollama_listing()}){did_you_mean(text)}")


def did_you_mean(text: str) -> str:
    """`; did you mean models/tinygpt-base.tinygpt?` for a MODEL that names no file, where one
    beside it has its name with another (or no) extension, or nearly its name (a typo): looked
    for in its folder, and among the shipped models for `NAME` and `models/NAME`. A name with a
    space is likely a prompt typed where MODEL goes: said so. Else ""."""
    path = Path(text).expanduser()
    candidates: dict[str, str] = {}      # a file's name -> how to write it
    folder = path.parent
    try:
        if folder.is_dir():
            candidates.update((p.name, str(folder / p.name)) for p in folder.iterdir())
    except OSError:
        pass
    if folder in (Path("."), Path("models")) and MODELS_DIR.is_dir():
        for p in MODELS_DIR.glob("*.tinygpt"):
            candidates.setdefault(p.name, f"models/{p.name}")
    stem = path.name.rsplit(".", 1)[0] if path.suffix in (".gguf", ".tinygpt") else path.name
    same = sorted(n for n in candidates if n.rsplit(".", 1)[0] == stem and n != path.name)
    close = same or difflib.get_close_matches(path.name, list(candidates), n=1, cutoff=0.8)
    if close:
        return f"; did you mean {candidates[close[0]]}?"
    return "; MODEL is the first argument: give the prompt with --prompt" if " " in path.name.strip() else ""


def _shipped(text: str) -> Optional[Resolved]:
    """`models/NAME` where no such file is here but the package ships NAME (README's commands,
    run outside the checkout: after `pip install .` or `pipx install .` the shipped models are
    package data, not a models/ folder beside the user), else None."""
    parts = Path(text).parts
    if len(parts) != 2 or parts[0] != "models":
        return None
    path = MODELS_DIR / parts[1]
    if not path.is_file():
        return None
    r = _from_path(path, "file", path.stem)
    return Resolved(r.path, r.format, r.source, r.name, f"{path} (the shipped {text}: none here)")


def _looks_like_path(text: str) -> bool:
    return (text.startswith(("/", "./", "../", "~")) or text.endswith((".gguf", ".tinygpt", ".json"))
            or text.count("/") > 2)


def _from_path(path: Path, source: str, name: str) -> Resolved:
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
            if len(ggufs) == 1:
                return Resolved(ggufs[0], "gguf", source, name, str(ggufs[0]))
            if len(ggufs) > 1:
                raise ModelFormatError(f"{path}: holds {len(ggufs)} GGUF files "
                                       f"({', '.join(p.name for p in ggufs[:6])}); name one")
            raise ModelFormatError(f"{path}: not a model directory (no config.json): expected config.json and "
                                   f"*.safetensors weights (an mlx-lm / Hugging Face model) or one GGUF file; "
                                   f"{_listing(path)}")
        return Resolved(path, "mlx-lm", source, name, str(path))
    if is_gguf(path):
        return Resolved(path, "gguf", source, name, str(path))
    _refuse_unknown_file(path)
    return Resolved(path, "tinygpt", source, name, str(path))


def _listing(path: Path) -> str:
    """What a directory holds, in a few words (for the error naming what it is instead)."""
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    except OSError as e:
        return f"it cannot be listed ({e.strerror})"
    if not names:
        return "it is empty"
    more = f" and {len(names) - 6} more" if len(names) > 6 else ""
    return f"it holds {', '.join(names[:6])}{more}"


def _refuse_unknown_file(path: Path) -> None:
    """A file that is neither GGUF (checked before) nor safetensors (`.tinygpt` files are
    safetensors: an 8-byte little-endian header length, then the JSON header's `{`) is refused
    in one line naming both expected kinds and what the file starts with. A file that looks like
    safetensors passes, for `format.load_file` to check in detail (truncation, metadata, ...)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read file ({e.strerror})") from None
    if len(head) >= 9 and 0 < int.from_bytes(head[:8], "little") <= size - 8 and head[8:9] == b"{":
        return
    why = (f"only {size} bytes" if size < 9 else "header is not JSON"
           if 0 < int.from_bytes(head[:8], "little") <= size - 8 else "bad header length")
    raise ModelFormatError(f"{path}: not a model file: expected a GGUF file (magic \"GGUF\") or a "
                           f"safetensors file such as a .tinygpt model (not a safetensors file: {why}); "
                           f"{starts_with(head)}")


def starts_with(head: bytes) -> str:
    """'it starts with ...' for a file's first bytes: the text when they read as text, else hex
    (with the commonest wrong files named: an LFS pointer, a ZIP/PyTorch checkpoint, a pickle)."""
    if not head:
        return "it is empty"
    if head.startswith(b"version https://git-lfs"):
        return "it is a Git LFS pointer, not the file itself (fetch it with `git lfs pull`)"
    kind = (" (a ZIP archive, e.g. a PyTorch checkpoint)" if head.startswith(b"PK\x03\x04")
            else " (a Python pickle, e.g. a PyTorch checkpoint)" if head[:1] == b"\x80" and head[1:2] in b"\x02\x03\x04\x05"
            else "")
    text = head.decode("utf-8", errors="ignore") if not kind else ""
    if text and len(text.encode()) >= len(head) - 3 and all(c.isprintable() or c in "\t\r\n" for c in text):
        return f"it starts with {json.dumps(text)} (text)"
    if not head.strip(b"\0"):
        return f"it starts with {len(head)} zero bytes"
    return f"it starts with bytes {head[:16].hex(' ')}{kind}"


# -- ollama ----------------------------------------------------------------------------------

def _ollama(text: str) -> Optional[Resolved]:
    m = _OLLAMA_NAME.match(text)
    if not m:
        return None
    host = m["host"] or OLLAMA_HOST
    ns = m["ns"] or "library"
    tag = m["tag"] or "latest"
    root = ollama_root()
    manifest = root / "manifests" / host / ns / m["name"] / tag
    if not manifest.is_file():
        if m["tag"] or (m["ns"] is None and "/" not in text):
            # name:tag or a bare name can only be ollama's
            raise ModelFormatError(f"{text}: no such file or directory, and no ollama model "
                                   f"{ns}/{m['name']}:{tag} in {root} ({_ollama_listing()}){did_you_mean(text)}")
        return None
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ModelFormatError(f"{manifest}: not a readable ollama manifest ({e})") from None
    digests = [layer.get("digest", "") for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    if not digests:
        raise ModelFormatError(f"{manifest}: the ollama manifest has no model layer")
    blob = root / "blobs" / digests[0].replace(":", "-")
    if not blob.is_file():
        raise ModelFormatError(f"{text}: the manifest names {blob.name}, which is missing from {root / 'blobs'}")
    return Resolved(blob, "gguf", "ollama", _ollama_label(host, ns, m["name"], tag), f"ollama {manifest}")


def _ollama_label(host: str, ns: str, name: str, tag: str) -> str:
    """How ollama prints a name: the default host and namespace left out."""
    return f"{name}:{tag}" if (host, ns) == (OLLAMA_HOST, "library") else f"{ns}/{name}:{tag}"


def ollama_names(root: Optional[Path] = None) -> list[str]:
    """Every model name:tag installed in an ollama store."""
    base = (root or ollama_root()) / "manifests"
    names = []
    for manifest in sorted(base.glob("*/*/*/*")) if base.is_dir() else []:
        if manifest.is_file():
            names.append(_ollama_label(*manifest.relative_to(base).parts))
    return names


def _ollama_listing() -> str:
    names = ollama_names()
    if not names:
        return "no models installed there"
    more = f", and {len(names) - 12} more" if len(names) > 12 else ""
    return "installed: " + ", ".join(names[:12]) + more


# -- Hugging Face ----------------------------------------------------------------------------

def hf_cache() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def _huggingface(repo: str) -> Resolved:
    from huggingface_hub import snapshot_download   # noqa: PLC0415 (slow import)

    # read at call time (huggingface_hub reads its variables once, at import)
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    cache = hf_cache()
    try:
        local = Path(snapshot_download(repo, local_files_only=offline, allow_patterns=HF_PATTERNS,
                                       cache_dir=str(cache)))
    except Exception as e:   # hub errors have no common base worth naming; all mean "not here"
        why = type(e).__name__
        if offline:
            raise ModelFormatError(f"{repo}: not a file, not an ollama model, and not in the Hugging Face "
                                   f"cache ({cache}); downloads are off (HF_HUB_OFFLINE=1)") from None
        raise ModelFormatError(f"{repo}: not a file or an ollama model, and the Hugging Face download "
                               f"failed ({why}: {str(e).splitlines()[0][:160] if str(e) else ''})"
                               f"{did_you_mean(repo)}") from None
    resolved = _from_path(local, "huggingface", repo)
    return Resolved(resolved.path, resolved.format, "huggingface", repo, f"Hugging Face {repo} ({local})")
