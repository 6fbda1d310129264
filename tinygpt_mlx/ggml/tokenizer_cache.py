"""A GGUF's converted tokenizer kept, so that transformers' converter runs once per file, not at
every start (`tokenizer.py` calls `converted`).

transformers' GGUF converter rebuilds the fast tokenizer a file's `tokenizer.ggml.*` metadata
describes; for Gemma 3's 262,144 tokens it re-derives 514,906 merges from the vocabulary, most of
a `sample`'s tokenizer time (docs/gguf.md, "Start-up"). Its result, in `tokenizers`' own
serialisation (the `tokenizer.json` of a Hugging Face directory), is kept:

- in the process, by a digest of all the converter reads (the architecture, the tokenizer
  metadata it is given, the versions of transformers and tokenizers): a second load of the same
  file, or the same metadata with another chat template, converts nothing;
- on disk, under `$POSTTRAINLLM_CACHE/tokenizers/` (default ~/.cache/posttrainllm/tokenizers), one
  entry per GGUF file, named by the file's identity: its resolved path, and its size, modification
  time and that digest. A changed file (another size, mtime or tokenizer) misses and is converted
  afresh; writing its new entry removes the old one of the same path. An entry is a directory of
  tokenizer.json and meta.json (what it was made for, tokenizer.json's SHA-256, the converter's
  extra arguments) written in a temporary directory beside it and renamed into place, so a reader
  sees a whole entry or none; of two processes writing at once, the second finds the first's entry
  and drops its own. An entry that cannot be read, or whose tokenizer.json does not match its
  SHA-256, is removed and rebuilt with one warning line on stderr; an entry that cannot be
  written is a warning too, and the load goes on with the tokenizer it converted.

Vocabularies under MIN_TOKENS tokens are kept in the process only: they convert in milliseconds,
and the test suite's small generated files would otherwise fill the user's cache directory.
POSTTRAINLLM_NO_TOKENIZER_CACHE=1 leaves the disk out (no entry read or written).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from .. import switches
from ..realmodel import cache_dir

#: the entries' layout; a new one misses every old entry
FORMAT = 1
#: the smallest vocabulary kept on disk (module doc)
MIN_TOKENS = 16384
OFF_VAR = "POSTTRAINLLM_NO_TOKENIZER_CACHE"
_STALE_SECONDS = 3600     # a temporary directory left this long by a writer that died


class Converted(NamedTuple):
    """The converter's result: `json`, tokenizers' serialisation (UTF-8); `extra`, its keyword
    arguments for PreTrainedTokenizerFast; `file`, a checked tokenizer.json on disk holding
    `json` (None: none); `backend`, the converter's own Tokenizer when this call converted."""
    json: bytes
    extra: dict
    file: Optional[Path] = None
    backend: Any = None


#: this process's conversions: digest -> (json, extra, the disk entry's tokenizer.json or None)
_converted: dict[str, tuple[bytes, dict, Optional[Path]]] = {}


def root() -> Path:
    return cache_dir() / "tokenizers"


def digest(architecture: str, tok_dict: dict, versions: str) -> str:
    """SHA-256 of everything the converter reads: the architecture, each entry of its tokenizer
    dictionary (numbers as their float64 or int64 bytes, the rest as JSON) and `versions`."""
    h = hashlib.sha256(f"{FORMAT}\0{versions}\0{architecture}".encode())
    for name in sorted(tok_dict):
        value = tok_dict[name]
        h.update(b"\0" + name.encode() + b"\0")
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], (int, float)) \
                and not isinstance(value[0], bool):
            arr = np.asarray(value)
            h.update(f"{arr.dtype.str}{arr.shape}".encode() + arr.tobytes())
        else:
            h.update(json.dumps(value, ensure_ascii=False, sort_keys=True).encode())
    return h.hexdigest()


def converted(architecture: str, tok_dict: dict, versions: str, convert: Callable[[], tuple[Any, dict]],
              gguf: Optional[Path] = None, environ=os.environ) -> Converted:
    """The converted tokenizer for this metadata: from this process's conversions, from the disk
    entry of `gguf` (the file the metadata was read from; None: the process's only), or from
    `convert()` (-> the backend Tokenizer and the extra arguments), then kept in both."""
    key = digest(architecture, tok_dict, versions)
    entry = expect = None
    if gguf is not None and len(tok_dict.get("tokens", ())) >= MIN_TOKENS and not switches.flag(OFF_VAR, environ):
        entry, expect = _entry(Path(gguf), key)
    if key in _converted:
        data, extra, file = _converted[key]
        if entry is None or file == entry / "tokenizer.json":
            return Converted(data, extra, file)
    if entry is not None:
        got = _read(entry, expect)
        if got is not None:
            data, extra = got
            _converted[key] = (data, extra, entry / "tokenizer.json")
            return Converted(data, extra, entry / "tokenizer.json")
    if key in _converted:                  # converted in this process, its entry not on disk (yet)
        data, extra, _ = _converted[key]
        backend = None
    else:
        backend, extra = convert()
        data = backend.to_str().encode("utf-8")
    file = None
    if entry is not None and _write(entry, data, {**expect, "sha256": hashlib.sha256(data).hexdigest(),
                                                  "extra": extra}):
        file = entry / "tokenizer.json"
    _converted[key] = (data, extra, file)
    return Converted(data, extra, file, backend)


def _entry(gguf: Path, key: str) -> tuple[Path, dict]:
    """The entry directory of this file and tokenizer digest, and the meta.json it must hold."""
    where = gguf.resolve()
    st = where.stat()
    expect = {"format": FORMAT, "gguf": str(where), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
              "tokenizer_digest": key}
    ident = hashlib.sha256(str(where).encode()).hexdigest()[:16]
    name = hashlib.sha256(json.dumps(expect, sort_keys=True).encode()).hexdigest()[:32]
    return root() / f"{ident}-{name}", expect


def _warn(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()


def _read(entry: Path, expect: dict) -> Optional[tuple[bytes, dict]]:
    """(tokenizer.json's bytes, extra) of a whole, matching entry; None if there is none. A
    damaged one is removed, with a warning."""
    if not entry.exists():
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        data = (entry / "tokenizer.json").read_bytes()
        if not isinstance(meta, dict):
            raise ValueError("meta.json is not an object")
        wrong = [k for k, v in expect.items() if meta.get(k) != v]
        if wrong:
            raise ValueError(f"meta.json's {', '.join(wrong)} not this file's")
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise ValueError("tokenizer.json does not match its SHA-256")
        extra = meta.get("extra")
        if not isinstance(extra, dict):
            raise ValueError("meta.json has no extra arguments")
    except FileNotFoundError:
        if not entry.exists():
            return None        # removed by another process meanwhile (a stale or damaged entry)
        return _damaged(entry, "a file of it is missing")
    except (OSError, ValueError) as e:     # json's errors are ValueErrors, UnicodeDecodeError too
        return _damaged(entry, str(e).splitlines()[0] if str(e) else type(e).__name__)
    return data, extra


def _damaged(entry: Path, why: str) -> None:
    _warn(f"tokenizer cache entry {entry} is unreadable ({why}); converting the tokenizer again")
    _discard(entry)


def _write(entry: Path, data: bytes, meta: dict) -> bool:
    """Puts the entry in place whole (a temporary directory renamed); True when it is there."""
    try:
        text = json.dumps(meta, sort_keys=True)
    except (TypeError, ValueError):
        return False           # extra arguments JSON cannot hold: kept in the process only
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        (tmp / "tokenizer.json").write_bytes(data)
        (tmp / "meta.json").write_text(text, encoding="utf-8")
        try:
            os.rename(tmp, entry)
            tmp = None
        except OSError:
            if not (entry / "meta.json").exists():
                raise
            # another process put the same entry in place first: ours is not needed
    except OSError as e:
        _warn(f"cannot write the tokenizer cache entry {entry} ({e.strerror or e}); "
              f"{OFF_VAR}=1 leaves the cache out")
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(entry)
    return True


def _discard(path: Path) -> None:
    """Removes an entry: renamed aside first (a reader then sees it whole or not at all)."""
    aside = path.parent / f".trash-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.rename(path, aside)
    except OSError:
        return                 # gone already (another process removed it)
    shutil.rmtree(aside, ignore_errors=True)


def _prune(entry: Path) -> None:
    """Removes the entries of the same GGUF path (an older version of the file) and what writers
    that died left behind."""
    ident = entry.name.split("-", 1)[0]
    try:
        others = list(entry.parent.iterdir())
    except OSError:
        return
    now = time.time()
    for p in others:
        if p.name.startswith(f"{ident}-") and p != entry:
            _discard(p)
        elif p.name.startswith((".tmp-", ".trash-")):
            try:
                if now - p.stat().st_mtime > _STALE_SECONDS:
                    shutil.rmtree(p, ignore_errors=True)
            except OSError:
                pass
