"""Prompt-cache files: prefill once, ask many times (issue #18, docs/prompt-cache.md).

`save_prompt_cache(path, cache, model, tokens, logits)` writes a `KVCache` to ONE safetensors
file; `load_prompt_cache(path, model)` rebuilds the same cache (same policy, same stored
tokens, positions, packed blocks, residual, sink/window, hot window, cold pages and summaries,
shadow) so that continuing from it gives exactly what continuing in process gives.

Serialisation is owned store by store, data flowing down: the layer cache asks its stores for
`state()` -> (arrays, counters) and hands each its arrays back in `load_state` (store.py's
`Persistent`). This module only writes and reads the file.

The file (format "posttrainllm-prompt-cache", version 7) is standard safetensors, written here
by hand so that memory-mapped rows are streamed from their files and never read into RAM:

* tensors: `logits` (fp32 [vocab], what the next token is sampled from) and, per distinct
  layer cache i, `layer{i}.{sink|body|cold}.<name>` as stored: dtypes kept (BF16 as BF16,
  KIVI codes as U32 with their F16 scales and zeros, cold positions I64, bf16 shadow rows U16).
* metadata (strings): `format`, `format_version`, `cache_config` (the CacheConfig as JSON),
  `model` (JSON: fingerprint, kind, name), `tokens` (JSON ids), `token_count`,
  `current_length`, `stored_count`, `cache_bytes`, `layers` (JSON: the layout, each layer's
  kind, "global" or "sliding W", and each distinct layer's counters), `chat` (JSON, optional: chat_template.PromptTurn's record), `checksum` (JSON:
  sha256 over the canonical header without the checksum, then the data region).

Disk stores (a memory-mapped cold store, KIVI's disk shadow) are written INTO the file; on load
their byte ranges are copied file-to-file (`os.copy_file_range`: no RAM) into the new cache's
private directory and memory-mapped there, so a run never modifies the saved file, and saving
stays one atomic rename: the file is written under a temporary name in the same folder, flushed
and renamed over `path` (an interrupted save leaves the old file whole).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import weakref
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Any, Optional, Union

import mlx.core as mx
import numpy as np

from mlx.utils import tree_flatten

from .. import format as tinygpt_format
from ..config import RUN_CHOICES, CacheConfig
from ..errors import ModelFormatError, PosttrainError
from . import cachefile
from .factory import make_cache
from .kv_cache import KVCache
from .layer import LayerCache

__all__ = ["PromptCacheError", "PromptCacheInfo", "save_prompt_cache", "load_prompt_cache",
           "read_prompt_cache_info", "model_fingerprint", "config_mismatch", "FORMAT_NAME", "FORMAT_VERSION"]

FORMAT_NAME = "posttrainllm-prompt-cache"
#: 2: exact StreamingLLM caches are rings (sink and window one store, keys as the model rotated
#: them, `base` per layer); version-1 files held them as two position-ordered stores
#: 3: KIVI under shifted StreamingLLM keeps its body's keys as the model rotated them (frame
#: positions, kivi.py); version-2 files held them before RoPE or at virtual slots
#: 4: a shifted retrieval hot window keeps its keys as the model rotated them (frame positions,
#: layer.py); version-3 files held them before RoPE
#: 5: the cache config may name fields a version-4 build does not know (int8's `long_residual`);
#: this build reads version-4 files too (their int8 grows its residual from here on, which any
#: int8 state allows), and an older build calls a newer file newer, not corrupt
#: 6: a `chat` record (chat_template.PromptTurn: which chat template, where the turn stands);
#: a version-4 or -5 file has none and is raw text (`PromptCacheInfo.chat` None)
#: 7: sliding-window layers (Gemma 2/3's local layers) are ours, exact rings of their own window,
#: and `layers` records each layer's kind ("global" / "sliding W"); a version-4 to -6 file has
#: no sliding layer (a model with one could not be saved) and loads as before
FORMAT_VERSION = 7
READS_FROM = 4


class PromptCacheError(PosttrainError):
    """A prompt-cache file that cannot be used here (one line, naming the file)."""


@dataclass
class PromptCacheInfo:
    """What a prompt-cache file says about itself (its metadata; no arrays read)."""
    path: Path
    config: CacheConfig
    model: dict                   # fingerprint, kind, name
    tokens: list[int]
    current_length: int
    stored_count: int
    cache_bytes: int
    file_bytes: int
    logits: Optional[mx.array] = None   # filled by load_prompt_cache
    chat: Optional[dict] = None         # the `chat` record; None: none (a file before version 6)

    @property
    def token_count(self) -> int:
        return len(self.tokens)


# ----- model identity ---------------------------------------------------------------------------

_FINGERPRINTS: dict[int, str] = {}


def model_fingerprint(model: Any) -> str:
    """The identity of a model's weights and config: sha256 over its config (JSON) and the
    tensor digest of its parameters (format.tensor_digest: names, dtypes, shapes, bytes). For a
    native `.tinygpt` LoadedModel whose file carries a checksum, the file's tensors digest is
    used (the same digest, already verified at load). Cached per model object in the process."""
    module = getattr(model, "model", model)
    key = id(module)
    if key in _FINGERPRINTS:
        return _FINGERPRINTS[key]
    config = getattr(module, "config", None) or getattr(module, "args", None)
    config = (dataclasses.asdict(config) if dataclasses.is_dataclass(config)
              else config if isinstance(config, dict) else repr(config))
    checksum = (getattr(model, "info", None) or {}).get("checksum")
    native = type(module).__module__ == "tinygpt_mlx.model"
    if native and checksum:
        tensors = checksum["tensors"]
    else:
        records = []
        for name, v in tree_flatten(module.parameters()):
            if native:
                v, tag = v.astype(mx.float32), "F32"
            else:
                tag = str(v.dtype).rsplit(".", 1)[-1]
                v = v.view(mx.uint16) if v.dtype == mx.bfloat16 else v
            a = np.ascontiguousarray(np.asarray(v))
            records.append((name, tag, list(a.shape), a.data))
        tensors = tinygpt_format.tensor_digest(records)
    h = hashlib.sha256(json.dumps({"module": type(module).__module__, "config": config}, sort_keys=True,
                                  default=str).encode())
    h.update(tensors.encode())
    fp = h.hexdigest()
    _FINGERPRINTS[key] = fp
    weakref.finalize(module, _FINGERPRINTS.pop, key, None)
    return fp


def _model_identity(model: Any) -> dict:
    kind = getattr(model, "kind", None) or type(getattr(model, "model", model)).__module__
    name = getattr(model, "name", None) or type(getattr(model, "model", model)).__name__
    return {"fingerprint": model_fingerprint(model), "kind": kind, "name": name}


# ----- writing ----------------------------------------------------------------------------------

def remove_stale_temps(path: Path) -> list[Path]:
    """Remove the temporary files that saves to `path` left when their process was killed
    mid-write (`.NAME.<pid>-<hex>.tmp` whose pid no longer runs); a save in progress in a live
    process keeps its own. Returns what was removed."""
    removed = []
    for tmp in path.parent.glob(f".{glob_escape(path.name)}.*-*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def save_prompt_cache(path: Union[str, Path], cache: KVCache, model: Any, tokens: list[int],
                      logits: Optional[mx.array] = None, chat: Optional[dict] = None) -> Path:
    """Write `cache` (holding `tokens`, fed to `model`) to `path`, atomically (module doc).

    `logits`: the fp32 logits after the last token (what the next token is sampled from), so
    that a run may continue without new prompt tokens. `chat`: where the tokens stand in the
    chat format (chat_template.PromptTurn.as_dict()), written as the `chat` record."""
    path = Path(path)
    layout, owned = _layout(cache)
    tensors: dict = {}
    metas = []
    for i, layer in enumerate(owned):
        arrays, meta = layer_state(layer)
        tensors.update({f"layer{i}.{k}": v for k, v in arrays.items()})
        metas.append(meta)
    if logits is not None:
        tensors["logits"] = logits.astype(mx.float32).reshape(-1)
    mx.eval([v for v in tensors.values() if isinstance(v, mx.array)])
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "cache_config": json.dumps(dataclasses.asdict(cache.config)),
        "model": json.dumps(_model_identity(model)),
        "tokens": json.dumps([int(t) for t in tokens]),
        "token_count": str(len(tokens)),
        "current_length": str(cache.current_length),
        "stored_count": str(cache.stored_count),
        "cache_bytes": str(cache.nbytes),
        "layers": json.dumps({"layout": layout, "kinds": cache.kinds(), "owned": metas}),
        **({} if chat is None else {"chat": json.dumps(chat)}),
    }
    remove_stale_temps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        cachefile.write(tmp, tensors, metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _kinds(kinds: list) -> str:
    """Layer kinds in a line: runs of one kind counted ("sliding 512 x5, global x1, ...")."""
    runs: list[list] = []
    for k in kinds:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return ", ".join(f"{k} x{n}" for k, n in runs)


def _layout(cache: KVCache) -> tuple[list[int], list[LayerCache]]:
    """For each layer, the index of its (distinct) layer cache; model-owned caches refused."""
    owned = cache.owned
    index = {id(c): i for i, c in enumerate(owned)}
    layout = []
    for c in cache:
        if id(c) not in index:
            raise PromptCacheError(f"layer cache {type(c).__name__} is the model's own (not a plain or sliding-"
                                   "window attention layer): prompt-cache files hold only posttrainllm's layer caches")
        layout.append(index[id(c)])
    return layout, owned


# ----- reading ----------------------------------------------------------------------------------

@dataclass
class Entry:
    """One tensor of the file, read on demand."""
    file: Path
    tag: str
    shape: tuple
    start: int        # absolute byte offsets in the file
    end: int

    def np(self) -> np.ndarray:
        """Read into RAM (BF16 as uint16 bit patterns)."""
        dtype = cachefile.TAG_NP[self.tag]
        count = (self.end - self.start) // dtype.itemsize
        return np.fromfile(self.file, dtype=dtype, count=count, offset=self.start).reshape(self.shape)

    def mx(self) -> mx.array:
        a = mx.array(self.np())
        return a.view(mx.bfloat16) if self.tag == "BF16" else a

    def copy_to(self, dest: str) -> None:
        """Copy the bytes into a new file `dest`, kernel to kernel where possible (not via RAM)."""
        with open(self.file, "rb") as src, open(dest, "wb") as out:
            left, off = self.end - self.start, self.start
            while left > 0:
                try:
                    n = os.copy_file_range(src.fileno(), out.fileno(), min(left, 1 << 30), off)
                except (AttributeError, OSError):
                    src.seek(off)
                    n = out.write(src.read(min(left, cachefile.CHUNK)))
                if n <= 0:
                    raise PromptCacheError(f"{self.file}: file is truncated")
                left -= n
                off += n


class Arrays:
    """A store's view of the file's tensors: `arrays[name]` is an `Entry`, `scope(prefix)` a
    sub-store's view."""

    def __init__(self, entries: dict, path: Path, prefix: str = ""):
        self.entries, self.path, self.prefix = entries, path, prefix

    def __getitem__(self, name: str) -> Entry:
        try:
            return self.entries[self.prefix + name]
        except KeyError:
            raise PromptCacheError(f"{self.path}: corrupt prompt cache (no tensor {self.prefix + name!r})") from None

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.entries

    def scope(self, prefix: str) -> "Arrays":
        return Arrays(self.entries, self.path, self.prefix + prefix)


def _open(path: Path) -> tuple[dict, dict, int, int]:
    """(tensor entries, metadata, data start, file size) of a prompt-cache file, checked for
    being one (format name, version) and not truncated; no data read."""
    if not path.exists():
        raise PromptCacheError(f"{path}: no such prompt-cache file")
    if path.is_dir():
        raise PromptCacheError(f"{path}: is a directory, not a prompt-cache file")
    try:
        header, meta, data_start = tinygpt_format.read_header(path)
    except ModelFormatError as e:
        raise PromptCacheError(f"{e} (not a usable prompt-cache file)") from None
    if meta.get("format") != FORMAT_NAME:
        raise PromptCacheError(f"{path}: not a prompt-cache file (format {meta.get('format')!r}); make one "
                               "with 'posttrainllm cache-prompt'")
    version = meta.get("format_version", "")
    if not version.isdigit():
        raise PromptCacheError(f"{path}: corrupt prompt cache (format version {version!r})")
    if int(version) > FORMAT_VERSION:
        raise PromptCacheError(f"{path}: prompt-cache format version {version} is newer than this build reads "
                               f"({FORMAT_VERSION}); upgrade posttrainllm or re-create the cache")
    if int(version) < READS_FROM:
        raise PromptCacheError(f"{path}: prompt-cache format version {version} was written by an older "
                               f"posttrainllm (this build reads {READS_FROM} to {FORMAT_VERSION}); re-create it with "
                               "cache-prompt")
    return header, meta, data_start, path.stat().st_size


#: fields a file written before they existed lacks, with the behaviour that file was saved under
_OLDER_FILES = {"kivi_sink": 0, "rotate": False}


def _json(path: Path, meta: dict, key: str) -> Any:
    try:
        return json.loads(meta[key])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise PromptCacheError(f"{path}: corrupt prompt cache (metadata {key!r})") from None


def read_prompt_cache_info(path: Union[str, Path]) -> PromptCacheInfo:
    """The metadata of a prompt-cache file (format and version checked; arrays not read)."""
    path = Path(path)
    _, meta, _, size = _open(path)
    try:
        # files written before KIVI's exact sink and rotation existed hold neither
        config = CacheConfig(**{**_OLDER_FILES, **_json(path, meta, "cache_config")})
    except (TypeError, ValueError) as e:
        raise PromptCacheError(f"{path}: corrupt prompt cache (cache config: {e})") from None
    tokens = _json(path, meta, "tokens")
    chat = _json(path, meta, "chat") if "chat" in meta else None
    if chat is not None and not isinstance(chat, dict):
        raise PromptCacheError(f"{path}: corrupt prompt cache (metadata 'chat')")
    try:
        return PromptCacheInfo(path, config, _json(path, meta, "model"), [int(t) for t in tokens],
                               int(meta["current_length"]), int(meta["stored_count"]),
                               int(meta["cache_bytes"]), size, chat=chat)
    except (KeyError, TypeError, ValueError):
        raise PromptCacheError(f"{path}: corrupt prompt cache (counters)") from None


def _verify(path: Path, header: dict, meta: dict, data_start: int, size: int) -> None:
    """Recompute the checksum over the canonical header and the data region."""
    stored = _json(path, meta, "checksum")
    if not isinstance(stored, dict) or stored.get("algorithm") != "sha256":
        raise PromptCacheError(f"{path}: corrupt prompt cache (checksum field)")
    if cachefile.data_digest(path, header, meta, data_start) != stored.get("digest"):
        raise PromptCacheError(f"{path}: checksum mismatch: the prompt cache is corrupted; re-create it with "
                               "'posttrainllm cache-prompt'")


#: fields that say where stores live, not what they keep: a file loads under either value
PLACEMENT = ("cold_path", "cold_store", "cold_ram")


def config_mismatch(saved: CacheConfig, given: CacheConfig) -> Optional[str]:
    """The first policy field that `given` sets (differs from the default) to another value in
    effect than the file's policy (`CacheConfig.in_effect`: int4's default tier is 1/8 whether
    named or not), or None. Where the stores live (`PLACEMENT`) is not policy, and positions
    left to the run (`rope_auto`) take the file's."""
    default = CacheConfig()
    for f in dataclasses.fields(CacheConfig):
        if f.name in PLACEMENT or f.name in RUN_CHOICES:   # a run's choice is not the file's policy
            continue
        if f.name == "rope_mode" and given.rope_auto:
            continue
        if getattr(given, f.name) != getattr(default, f.name) and given.in_effect(f.name) != saved.in_effect(f.name):
            return f.name
    return None


def load_prompt_cache(path: Union[str, Path], model: Any, cold_path: Optional[str] = None,
                      config: Optional[CacheConfig] = None, cold_store: Optional[str] = None,
                      cold_ram: Any = "file") -> tuple[KVCache, PromptCacheInfo]:
    """Rebuild the cache saved at `path` for `model` (a LoadedModel, or the module with our
    attention routed). Checked before anything is built: format and version, the model's
    fingerprint, the checksum, and (if `config` is given) that every field it sets matches the
    file's policy. `cold_path`: where the new cache's disk stores go (default: a temp dir);
    `cold_store`: where its cold store lives (default: the file's, or `config`'s where it sets one;
    both stores write and read the same rows); `cold_ram`: the ram store's RAM budget in MiB
    (None: no limit; default `config`'s where it is given, else the file's).
    Returns (cache, info); `info.logits` holds the saved logits (or None)."""

    path = Path(path)
    header, meta, data_start, size = _open(path)
    info = read_prompt_cache_info(path)
    if config is not None:
        field = config_mismatch(info.config, config)
        if field is not None:
            raise PromptCacheError(f"{path}: the prompt cache was made with {field}={info.config.in_effect(field)!r}, "
                                   f"not {config.in_effect(field)!r}; leave the policy flags out to use the file's")
    mine = model_fingerprint(model)
    if info.model.get("fingerprint") != mine:
        raise PromptCacheError(f"{path}: the prompt cache was made with another model ({info.model.get('name')}, "
                               f"fingerprint {str(info.model.get('fingerprint'))[:12]}…), not this one "
                               f"({getattr(model, 'name', type(model).__name__)}, {mine[:12]}…)")
    _verify(path, header, meta, data_start, size)
    layers = _json(path, meta, "layers")
    entries = {}
    for name, h in header.items():
        lo, hi = (int(x) for x in h["data_offsets"])
        entries[name] = Entry(path, h["dtype"], tuple(h["shape"]), data_start + lo, data_start + hi)
    if cold_store is None and config is not None and config.cold_store != CacheConfig().cold_store:
        cold_store = config.cold_store
    if cold_ram == "file":
        cold_ram = config.cold_ram if config is not None else info.config.cold_ram
    store = cold_store or info.config.cold_store
    cfg = dataclasses.replace(info.config, cold_path=cold_path, cold_store=store,
                              cold_ram=cold_ram if store == "ram" else None)
    cache = make_cache(getattr(model, "model", model), cfg)
    try:
        layout, owned = _layout(cache)
        if layout != layers.get("layout") or len(owned) != len(layers.get("owned", [])):
            raise PromptCacheError(f"{path}: the prompt cache's layers ({layers.get('layout')}) do not match the "
                                   f"model's ({layout})")
        kinds = layers.get("kinds", ["global"] * len(layout))   # before version 7: no sliding layer
        if kinds != cache.kinds():
            raise PromptCacheError(f"{path}: the prompt cache's layer kinds ({_kinds(kinds)}) do not match the "
                                   f"model's ({_kinds(cache.kinds())})")
        arrays = Arrays(entries, path)
        for i, (layer, m) in enumerate(zip(owned, layers["owned"])):
            load_layer(layer, arrays.scope(f"layer{i}."), m)
        info.logits = arrays["logits"].mx() if "logits" in arrays else None
    except (KeyError, TypeError, ValueError) as e:
        cache.close()
        raise PromptCacheError(f"{path}: corrupt prompt cache ({e})") from None
    except BaseException:
        cache.close()
        raise
    if cache.current_length != info.current_length or cache.stored_count != info.stored_count:
        cache.close()
        raise PromptCacheError(f"{path}: corrupt prompt cache (restored {cache.current_length}/"
                               f"{cache.stored_count} tokens, the file says {info.current_length}/{info.stored_count})")
    return cache, info


def layer_state(layer: Any) -> tuple[dict, dict]:
    """(arrays, metadata) of one layer for a prompt-cache file: its counters and each store's
    `state()`, asked store by store (named "sink.", "body.", "cold." in the arrays)."""
    arrays: dict = {}
    meta: dict = layer.counters()
    meta["dtype"] = None if meta["dtype"] is None else str(meta["dtype"]).rsplit(".", 1)[-1]
    for name, store in layer.stores().items():
        a, meta[name] = store.state()
        arrays.update({f"{name}.{k}": v for k, v in a.items()})
    return arrays, meta


def load_layer(layer: Any, arrays: Any, meta: dict) -> None:
    """Refill a freshly built layer cache (same policy) from `layer_state`'s output."""
    layer.set_counters(int(meta["seen"]), int(meta["start"]), int(meta.get("base", 0)),
                       None if meta["dtype"] is None else getattr(mx, meta["dtype"]))
    stores = layer.stores()
    saved = sorted(k for k in ("sink", "body", "cold") if k in meta)
    if set(stores) != set(saved):
        raise ValueError(f"saved stores {saved} do not match this policy's {sorted(stores)}")
    for name, store in stores.items():
        store.load_state(arrays.scope(f"{name}."), meta[name])
