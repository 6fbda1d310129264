"""From a request to prompt token ids: chat template, and fitting the prompt to the context.

Chat uses the model's own chat template (mlx-lm models that ship one) or the tokenizer's
documented plain template for native models ("User: ...\\nAssistant: ...\\nAssistant:", see
`plain_chat_text`); with the plain template "\\nUser:" is added as a stop string so the model
does not write the user's next turn.

Context: with `num_ctx` (ollama option) the context is `num_ctx` tokens, capped by the
model's trained context when the cache is a full one; without it, the model's context for a
full cache and unbounded for StreamingLLM / retrieval policies (no cut there). Within a context
the prompt gets a budget of `context - reserve` tokens, the reserve being the room kept for the
reply: `num_predict` / `max_tokens` when given (at most half the context), half the context
otherwise (`reserve_for`). A chat over the budget loses its oldest whole turns, keeping the
system message(s), the first user message and the newest turns (`fit_chat`); a token prompt
keeps its first `num_keep` and its newest tokens (`fit_tokens`, as ollama does). Every cut is
logged (one line: what was dropped, what was kept, the room left) and reported in the response
(`truncated`), never silent. Generation stops with done_reason "length" when the context is full.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from ..chat_template import PLAIN_STOP, has_template, plain_text, prompt_ids, render, stop_strings

log = logging.getLogger("posttrainllm.server")

PLAIN_TEMPLATE_STOP = PLAIN_STOP


def has_chat_template(loaded: Any) -> bool:
    return has_template(loaded.tokenizer)


def template_text(loaded: Any) -> str:
    if has_chat_template(loaded):
        return str(loaded.tokenizer._wrapper.chat_template)
    return "{{ range .Messages }}{{ .Role }}: {{ .Content }}\n{{ end }}Assistant:"


def plain_chat_text(messages: list[dict]) -> str:
    """The plain turn format (`tinygpt_mlx.chat.plain_text`, shared with `sample` and `chat`)."""
    return plain_text(messages)


def chat_ids(loaded: Any, messages: list[dict]) -> tuple[list[int], tuple[str, ...], str]:
    """Token ids and text of a chat prompt, and the stop strings the template implies (the one
    helper `sample` and `chat` use: `tinygpt_mlx.chat`)."""
    tok = loaded.tokenizer
    return prompt_ids(tok, messages), stop_strings(tok), render(tok, messages)


def generate_ids(loaded: Any, prompt: str, system: Optional[str], raw: bool,
                 context: Optional[list[int]]) -> tuple[list[int], Optional[str]]:
    """ollama /api/generate: `context` (ids from a previous answer) + the prompt, and the
    prompt's text when there is no `context` (None otherwise).

    Templated models get their chat template unless `raw`; native models are base language
    models, so the prompt is used as written (after `system`, if given).
    """
    if not raw and has_chat_template(loaded):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = render(loaded.tokenizer, msgs)
        new = prompt_ids(loaded.tokenizer, msgs)
    else:
        text = f"{system}\n\n{prompt}" if system and not raw else prompt
        new = loaded.tokenizer.encode(text) if text else []
    ids = list(context or []) + new
    return ids, (None if context else text)


# ----- the context policy ------------------------------------------------------------------------
@dataclass
class Fitted:
    """A prompt fitted to the context: its ids, its text where `ids` is that text's plain encoding
    (None after a cut inside the tokens), the context and prompt budget, and the truncation
    report (None when nothing was dropped)."""

    ids: list[int]
    text: Optional[str]
    limit: Optional[int]            # the context (None: unbounded, StreamingLLM / retrieval)
    budget: Optional[int]           # the most prompt tokens: limit - reserve
    truncated: Optional[dict] = None


def context_limit(loaded: Any, cache_config: Any, num_ctx: Optional[int]) -> Optional[int]:
    unbounded = cache_config.streaming or cache_config.retrieval
    model_ctx = None if unbounded else loaded.context_length
    if num_ctx is None:
        return model_ctx
    return min(num_ctx, model_ctx) if model_ctx else num_ctx


def reserve_for(limit: int, requested: Optional[int]) -> int:
    """Tokens kept free for the reply in a context of `limit`: `requested` (num_predict /
    max_tokens) when given, at most half the context and at least 1; half the context when the
    request is unbounded (None or negative)."""
    half = max(limit // 2, 1)
    if requested is None or requested < 0:
        return half
    return max(1, min(requested, half))


def _budget(limit: Optional[int], requested: Optional[int]) -> Optional[int]:
    return None if limit is None else limit - reserve_for(limit, requested)


def fit_tokens(ids: list[int], text: Optional[str], limit: Optional[int], requested: Optional[int],
               num_keep: int = 0) -> Fitted:
    """A token prompt (/api/generate, /v1/completions) cut to the budget as ollama and llama.cpp
    do: its first `num_keep` tokens (-1: as many as allowed; at most half the budget) and its
    newest tokens."""
    budget = _budget(limit, requested)
    if budget is None or len(ids) <= budget:
        return Fitted(ids, text, limit, budget)
    keep = budget // 2 if num_keep < 0 else min(num_keep, budget // 2)
    cut = ids[:keep] + ids[len(ids) - (budget - keep):]
    report = {"prompt_tokens": len(ids), "kept_tokens": len(cut), "dropped_tokens": len(ids) - len(cut),
              "num_ctx": limit, "num_keep": keep, "reserved": limit - len(cut)}
    log.warning("context %d: prompt of %d tokens cut to %d: kept the first %d and the newest %d tokens, "
                "dropped %d in between; %d tokens left for the reply",
                limit, len(ids), len(cut), keep, budget - keep, len(ids) - len(cut), limit - len(cut))
    return Fitted(cut, None, limit, budget, report)


def _turns(messages: list[dict]) -> tuple[list[int], Optional[int], list[list[int]]]:
    """Indices of the system messages, of the first user message, and the other messages grouped
    into turns (a user message and what follows it up to the next one). The newest message is
    always in the last turn, never pinned."""
    last = len(messages) - 1
    system = [i for i, m in enumerate(messages) if m.get("role") == "system" and i != last]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    first = None if first == last else first
    turns: list[list[int]] = []
    for i in range(len(messages)):
        if i in system or i == first:
            continue
        if not turns or messages[i].get("role") == "user":
            turns.append([i])
        else:
            turns[-1].append(i)
    return system, first, turns


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def fit_chat(loaded: Any, messages: list[dict], limit: Optional[int],
             requested: Optional[int]) -> tuple[Fitted, tuple[str, ...]]:
    """A chat fitted to the budget by dropping the oldest whole turns.

    Kept, in this order of priority: the newest turn (the question being asked), the system
    message(s), the first user message, then as many of the newest other turns as fit. Where the
    newest message alone does not fit, only its newest tokens are kept.
    """
    ids, stops, text = chat_ids(loaded, messages)
    budget = _budget(limit, requested)
    if budget is None or len(ids) <= budget:
        return Fitted(ids, text, limit, budget), stops

    def render(idx: list[int]) -> tuple[list[int], str]:
        got = chat_ids(loaded, [messages[i] for i in sorted(idx)])
        return got[0], got[2]

    system, first, turns = _turns(messages)
    heads = [system + ([first] if first is not None else [])]
    if first is not None and system:
        heads.append(system)
    heads.append([])
    for head in heads:
        best = None
        for k in range(1, len(turns) + 1):
            kept = [i for t in turns[len(turns) - k:] for i in t]
            got = render(head + kept)
            if len(got[0]) > budget:
                break
            best = (k, kept, got)
        if best is None:
            continue
        k, kept, (kids, ktext) = best
        head_tokens = len(kids) - len(render(kept)[0]) if head else 0
        dropped = []
        if len(turns) > k:
            dropped.append(f"{_plural(len(turns) - k, 'oldest turn')}")
        if first is not None and first not in head:
            dropped.append("the first message")
        if system and not head:
            dropped.append("the system prompt")
        names = " + ".join(n for n, on in (("system", bool(system) and set(system) <= set(head)),
                                           ("first message", first is not None and first in head)) if on)
        kept_desc = (f"{names} ({head_tokens} tokens) and " if names else "") + \
            f"the last {_plural(k, 'turn')} ({len(kids) - head_tokens} tokens)"
        report = {"prompt_tokens": len(ids), "kept_tokens": len(kids), "dropped_tokens": len(ids) - len(kids),
                  "num_ctx": limit, "reserved": limit - len(kids),
                  "dropped_messages": len(messages) - len(head) - len(kept)}
        log.info("context %d: dropped %s (%d tokens), kept %s; %d tokens left for the reply",
                 limit, " and ".join(dropped), len(ids) - len(kids), kept_desc, limit - len(kids))
        return Fitted(kids, ktext, limit, budget, report), stops
    return _cut_newest(loaded, messages, ids, limit, budget), stops


def _cut_newest(loaded: Any, messages: list[dict], full: list[int], limit: int, budget: int) -> Fitted:
    """The newest message alone does not fit: it is sent alone, cut to its newest tokens."""
    tok = loaded.tokenizer
    last = dict(messages[-1])
    content = tok.encode(last.get("content", ""))
    n = max(budget - len(chat_ids(loaded, [dict(last, content="")])[0]), 0)
    while True:
        kept = tok.decode(content[len(content) - n:]).lstrip("\ufffd") if n > 0 else ""
        ids, _, _ = chat_ids(loaded, [dict(last, content=kept)])
        if len(ids) <= budget or n == 0:
            break
        n = max(n - (len(ids) - budget), 0)
    if len(ids) > budget:              # the template alone is longer than the budget
        ids = ids[len(ids) - budget:]
    report = {"prompt_tokens": len(full), "kept_tokens": len(ids), "dropped_tokens": len(full) - len(ids),
              "num_ctx": limit, "reserved": limit - len(ids), "dropped_messages": len(messages) - 1,
              "cut_message": True}
    earlier = f", dropped {_plural(len(messages) - 1, 'earlier message')}" if len(messages) > 1 else ""
    log.warning("context %d: the newest message alone (%d tokens) does not fit the %d-token prompt budget: "
                "kept its newest %d tokens%s (%d tokens dropped in all); %d tokens left for the reply",
                limit, len(content), budget, n, earlier, len(full) - len(ids), limit - len(ids))
    return Fitted(ids, None, limit, budget, report)


def max_new_tokens(requested: Optional[int], limit: Optional[int], prompt_len: int, unbounded_default: int) -> int:
    """num_predict / max_tokens -> a count; -1, -2 or None mean "until the context is full".
    A bounded request is also stopped at the context (by the worker), whatever it asked for."""
    room = (limit - prompt_len) if limit is not None else unbounded_default
    if requested is None or requested < 0:
        return max(room, 0)
    return requested
