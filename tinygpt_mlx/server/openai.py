"""OpenAI-compatible schemas: request parsing and response / SSE chunk objects (no I/O here).

`usage.prompt_tokens` is the whole prompt; `usage.prompt_tokens_details.cached_tokens` the part
served by a warm slot (prompt_tokens - cached_tokens were prefilled for this request), and
`restored_tokens` (ours) the part of those a slot checkpoint restored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from .ollama import OptionError, _number, parse_stop
from .worker import Result

DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default max_tokens for /v1/completions


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def parse_sampling(body: dict, default_max: Optional[int]) -> dict:
    """temperature, top_p, seed, stop, max_tokens (None = up to the context), n (only 1)."""
    out: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "max_tokens": default_max}
    for name, kind in (("temperature", float), ("top_p", float), ("seed", int), ("top_k", int)):
        if body.get(name) is not None:
            out[name] = _number(name, body[name], kind)
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            out["max_tokens"] = _number(name, body[name], int)
            if out["max_tokens"] < 0:
                raise OptionError(f"{name} must be >= 0, got {out['max_tokens']}")
            break
    out["stop"] = parse_stop(body.get("stop"))
    if body.get("n") not in (None, 1):
        raise OptionError("only n = 1 is supported")
    if not 0 <= out["temperature"] <= 2:
        raise OptionError(f"temperature must be in [0, 2], got {out['temperature']}")
    if not 0 < out["top_p"] <= 1:
        raise OptionError(f"top_p must be in (0, 1], got {out['top_p']}")
    if out["top_k"] < 0:
        raise OptionError(f"top_k must be >= 0, got {out['top_k']}")
    return out


def message_text(content: Any) -> str:
    """A message's content: a string, or a list of parts of which the text parts are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise OptionError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def finish_reason(r: Result) -> str:
    return "stop" if r.done_reason == "stop" else "length"


def usage(r: Result) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.tokens),
            "total_tokens": r.prompt_tokens + len(r.tokens),
            "prompt_tokens_details": {"cached_tokens": r.reused_tokens,
                                      "restored_tokens": r.restored_tokens}}   # posttrainllm's own


def chat_completion(cid: str, model: str, r: Result, text: str) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": "posttrainllm",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason(r)}],
            "usage": usage(r)}


def chat_chunk(cid: str, model: str, delta: dict, finish: Optional[str] = None) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "system_fingerprint": "posttrainllm",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion(cid: str, model: str, r: Result, text: str) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": "posttrainllm",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(r)}],
            "usage": usage(r)}


def completion_chunk(cid: str, model: str, text: str, finish: Optional[str] = None) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": "posttrainllm",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(cid: str, model: str, obj: str, r: Result) -> dict:
    return {"id": cid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(r)}


def models(names: list[str], created: int) -> dict:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created,
                                        "owned_by": "posttrainllm"} for n in names]}


def error(message: str, status: int) -> dict:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "server_error")
    code = "model_not_found" if status == 404 else None
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
