"""ollama API schemas: option parsing and the JSON objects of every endpoint (no I/O here).

Field names and types follow ollama's API (docs/api.md of ollama/ollama): timestamps are
RFC 3339 UTC with `Z`, durations integer nanoseconds, `done_reason` "stop" or "length".
`prompt_eval_count` counts the prompt tokens prefilled for this request — tokens served by a
warm slot are not counted, as ollama does with its own prompt cache. Extra fields (added by
this server, ignored by clients): `prompt_tokens` (whole prompt) and `truncated`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from typing import Any, Optional

from ..ggml.header import main_type
from .worker import Result

VERSION = "0.6.0"        # the ollama API version we mirror (clients gate features on it)
FAR_FUTURE = "2318-11-29T00:00:00Z"   # /api/ps expires_at: the model never unloads
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
UNBOUNDED_PREDICT = 4096  # num_predict -1 under a policy with no context limit
# /api/ps context_length of a server whose policy has no context limit (StreamingLLM, retrieval):
# prompts of any length stream through; this is the longest one measured (docs/retrieval.md, 1M)
UNBOUNDED_ACCEPTS = 1 << 20


class OptionError(ValueError):
    """An option of the wrong type or out of range (answered with 400)."""


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _number(name: str, v: Any, kind: type) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise OptionError(f"option {name} must be a number, got {v!r}")
    if kind is int:
        if isinstance(v, float) and not v.is_integer():
            raise OptionError(f"option {name} must be an integer, got {v!r}")
        return int(v)
    return float(v)


def parse_stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(s for s in v if s)
    raise OptionError(f"stop must be a string or a list of strings, got {v!r}")


def parse_options(options: Any) -> dict:
    """ollama `options` -> {temperature, top_p, top_k, seed, stop, num_predict, num_ctx, num_keep}.

    Unknown options are ignored (as ollama does); known ones are type- and range-checked.
    """
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise OptionError(f"options must be an object, got {type(options).__name__}")
    out: dict[str, Any] = dict(OLLAMA_DEFAULTS, stop=(), num_predict=-1, num_ctx=None, num_keep=0, seed=None)
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("seed", int),
                       ("num_predict", int), ("num_ctx", int), ("num_keep", int)):
        if options.get(name) is not None:
            out[name] = _number(name, options[name], kind)
    out["stop"] = parse_stop(options.get("stop"))
    if out["temperature"] < 0:
        raise OptionError(f"option temperature must be >= 0, got {out['temperature']}")
    if not 0 < out["top_p"] <= 1:
        raise OptionError(f"option top_p must be in (0, 1], got {out['top_p']}")
    if out["top_k"] < 0:
        raise OptionError(f"option top_k must be >= 0, got {out['top_k']}")
    if out["num_ctx"] is not None and out["num_ctx"] < 2:
        raise OptionError(f"option num_ctx must be >= 2, got {out['num_ctx']}")
    if out["num_predict"] < -2:
        raise OptionError(f"option num_predict must be >= -2, got {out['num_predict']}")
    if out["num_keep"] < -1:
        raise OptionError(f"option num_keep must be >= -1 (-1: as many as allowed), got {out['num_keep']}")
    return out


def digest(loaded: Any) -> str:
    p = loaded.path
    key = f"{p.resolve()}:{p.stat().st_mtime_ns}".encode()
    return hashlib.sha256(key).hexdigest()


def _modified(loaded: Any) -> str:
    t = _dt.datetime.fromtimestamp(loaded.path.stat().st_mtime, _dt.timezone.utc)
    return t.isoformat(timespec="microseconds").replace("+00:00", "Z")


def quant_level(config: dict) -> str:
    """ollama's quantization_level of an mlx-lm config: Q<bits> if quantised, else F32."""
    quant = config.get("quantization")
    return f"Q{quant['bits']}" if isinstance(quant, dict) and "bits" in quant else "F32"


def details(loaded: Any) -> dict:
    n = loaded.info.get("parameters", 0)
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    family = loaded.info.get("model_type") or ("tinygpt" if loaded.kind == "tinygpt" else loaded.kind)
    fmt = "tinygpt" if loaded.kind == "tinygpt" else "mlx"
    qlevel = quant_level(loaded.info.get("config", {}))
    if loaded.info.get("format") == "gguf":
        # ollama's words: format gguf, the architecture as family, the file's main tensor type
        fmt, family = "gguf", loaded.info["architecture"]
        qlevel = main_type({t: v["count"] for t, v in loaded.info["tensor_types"].items()})
    return {"parent_model": "", "format": fmt, "family": family, "families": [family],
            "parameter_size": size, "quantization_level": qlevel}


def model_entry(loaded: Any, name: str) -> dict:
    """One element of /api/tags `models`."""
    return {"name": name, "model": name, "modified_at": _modified(loaded),
            "size": loaded.info.get("file_bytes", 0), "digest": digest(loaded), "details": details(loaded)}


def listed_entry(name: str, size: int, modified: float, details: dict) -> dict:
    """An /api/tags row for an offered model that is not loaded (described from its file)."""
    t = _dt.datetime.fromtimestamp(modified, _dt.timezone.utc)
    return {"name": name, "model": name, "size": size,
            "modified_at": t.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "digest": hashlib.sha256(name.encode()).hexdigest(), "details": details}


def ps_entry(loaded: Any, name: str, memory: dict, context_length: Optional[int]) -> dict:
    """An /api/ps row: `size` is the weights plus every slot's cache, `size_vram` what of it is in
    memory (a retrieval cold store or KIVI shadow on disk is memory-mapped, not resident);
    `posttrainllm` breaks the caches down (the cold store's share included)."""
    e = model_entry(loaded, name)
    e.pop("modified_at")
    size = e["size"] + memory["cache_bytes"] + memory.get("checkpoint_bytes", 0)
    e.update(size=size, size_vram=size - memory["cache_disk_bytes"], expires_at=FAR_FUTURE,
             context_length=context_length or 0, posttrainllm=memory)
    return e


def show(loaded: Any, cache_label: str, template: str) -> dict:
    cfg = loaded.info.get("config", {})
    family = details(loaded)["family"]
    info: dict[str, Any] = {"general.architecture": family,
                            "general.parameter_count": loaded.info.get("parameters", 0),
                            f"{family}.context_length": loaded.context_length or 0}
    for k, v in cfg.items():
        if isinstance(v, (int, float, str, bool)):
            info[f"{family}.{k}"] = v
    return {"license": "", "modelfile": f"# served by posttrainllm\nFROM {loaded.path}\n",
            "parameters": "\n".join(f"{k} {v}" for k, v in OLLAMA_DEFAULTS.items()),
            "template": template, "details": details(loaded), "model_info": info,
            "capabilities": ["completion"], "modified_at": _modified(loaded),
            "posttrainllm": {"kind": loaded.kind, "cache_policy": cache_label}}


def _final_fields(r: Result, truncated: Optional[dict]) -> dict:
    out = {"done_reason": "stop" if r.done_reason == "stop" else "length",
           "total_duration": r.total_ns, "load_duration": r.load_ns,
           "prompt_eval_count": r.prefilled_tokens, "prompt_eval_duration": r.prompt_eval_ns,
           "eval_count": len(r.tokens), "eval_duration": r.eval_ns,
           "prompt_tokens": r.prompt_tokens,
           # posttrainllm's own: how the prompt was served (warm slot, checkpoint, prefill)
           "prompt_cached_tokens": r.reused_tokens, "prompt_restored_tokens": r.restored_tokens}
    if truncated:
        out["truncated"] = truncated
    return out


def generate_chunk(model: str, text: str) -> dict:
    return {"model": model, "created_at": now(), "response": text, "done": False}


def generate_final(model: str, r: Result, text: str, context: list[int], truncated: Optional[dict]) -> dict:
    out = {"model": model, "created_at": now(), "response": text, "done": True}
    out.update(_final_fields(r, truncated))
    out["context"] = context
    return out


def chat_chunk(model: str, text: str) -> dict:
    return {"model": model, "created_at": now(), "message": {"role": "assistant", "content": text},
            "done": False}


def chat_final(model: str, r: Result, text: str, truncated: Optional[dict]) -> dict:
    out = {"model": model, "created_at": now(), "message": {"role": "assistant", "content": text},
           "done": True}
    out.update(_final_fields(r, truncated))
    return out


def load_only(model: str, chat: bool) -> dict:
    """ollama's answer to an empty prompt / empty messages: the model is loaded, nothing run."""
    out = {"model": model, "created_at": now(), "done": True, "done_reason": "load"}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return out
