"""From a request to prompt token ids: chat template, and fitting the prompt to the context.

Chat uses the model's own chat template (mlx-lm models that ship one) or the tokenizer's
documented plain template for native models ("User: ...\\nAssistant: ...\\nAssistant:", see
`plain_chat_text`); with the plain template "\\nUser:" is added as a stop string so the model
does not write the user's next turn.

Context: with `num_ctx` (ollama option) the context is `num_ctx` tokens, capped by the
model's trained context when the cache is a full one; without it, the model's context for a
full cache and unbounded for StreamingLLM / retrieval policies. A prompt longer than the
context minus one is cut: its first `num_keep` tokens and its newest tokens are kept (as
ollama does). The cut is logged and reported in the response (`truncated`), never silent.
Generation stops with done_reason "length" when the context is full.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

log = logging.getLogger("posttrainllm.server")

PLAIN_TEMPLATE_STOP = "\nUser:"


def has_chat_template(loaded: Any) -> bool:
    wrapper = getattr(loaded.tokenizer, "_wrapper", None)   # mlx-lm TokenizerWrapper, if any
    return bool(wrapper is not None and getattr(wrapper, "chat_template", None))


def template_text(loaded: Any) -> str:
    if has_chat_template(loaded):
        return str(loaded.tokenizer._wrapper.chat_template)
    return "{{ range .Messages }}{{ .Role }}: {{ .Content }}\n{{ end }}Assistant:"


def plain_chat_text(messages: list[dict]) -> str:
    """The tokenizer's plain template ("Role: content" lines, then "Assistant:"), except that an
    assistant turn starting with a space, newline or punctuation follows "Assistant:" directly.

    That is how the model generated it (its answer began right after "Assistant:"), so the
    history reproduces the generated text and the warm slot covers the previous answer too.
    """
    lines = []
    for m in messages:
        role, content = str(m.get("role", "user")).capitalize(), m.get("content", "")
        sep = " " if role != "Assistant" or (content[:1].isalnum()) else ""
        lines.append(f"{role}:{sep}{content}")
    lines.append("Assistant:")
    return "\n".join(lines)


def chat_ids(loaded: Any, messages: list[dict]) -> tuple[list[int], tuple[str, ...], str]:
    """Token ids and text of a chat prompt, and the stop strings the template implies."""
    tok = loaded.tokenizer
    if has_chat_template(loaded):
        text = tok.chat_prompt(messages)
        return tok.encode(text), (), text
    text = plain_chat_text(messages)
    return tok.encode(text), (PLAIN_TEMPLATE_STOP,), text


def generate_ids(loaded: Any, prompt: str, system: Optional[str], raw: bool,
                 context: Optional[list[int]]) -> tuple[list[int], Optional[str]]:
    """ollama /api/generate: `context` (ids from a previous answer) + the prompt, and the
    prompt's text when there is no `context` (None otherwise).

    Templated models get their chat template unless `raw`; native models are base language
    models, so the prompt is used as written (after `system`, if given).
    """
    if not raw and has_chat_template(loaded):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = loaded.tokenizer.chat_prompt(msgs)
    else:
        text = f"{system}\n\n{prompt}" if system and not raw else prompt
    ids = list(context or []) + (loaded.tokenizer.encode(text) if text else [])
    return ids, (None if context else text)


def context_limit(loaded: Any, cache_config: Any, num_ctx: Optional[int]) -> Optional[int]:
    unbounded = cache_config.streaming or cache_config.retrieval
    model_ctx = None if unbounded else loaded.context_length
    if num_ctx is None:
        return model_ctx
    return min(num_ctx, model_ctx) if model_ctx else num_ctx


def fit(ids: list[int], limit: Optional[int], num_keep: int = 0) -> tuple[list[int], Optional[dict]]:
    """Cut `ids` to `limit - 1` tokens (room for one new token); returns ids and the report."""
    if limit is None or len(ids) <= limit - 1:
        return ids, None
    room = limit - 1
    keep = min(num_keep, room)
    cut = ids[:keep] + ids[len(ids) - (room - keep):]
    report = {"prompt_tokens": len(ids), "kept_tokens": len(cut), "dropped_tokens": len(ids) - len(cut),
              "num_ctx": limit, "num_keep": keep}
    log.warning("prompt of %d tokens truncated to %d to fit a context of %d (kept the first %d and the "
                "newest %d)", len(ids), len(cut), limit, keep, room - keep)
    return cut, report


def max_new_tokens(requested: Optional[int], limit: Optional[int], prompt_len: int, unbounded_default: int) -> int:
    """num_predict / max_tokens -> a count; -1, -2 or None mean "until the context is full"."""
    room = (limit - prompt_len) if limit is not None else unbounded_default
    if requested is None or requested < 0:
        return max(room, 0)
    return requested
