"""Chat prompts and conversations: the one helper `sample`, `chat` and the server share.

Templates. An mlx-lm model whose tokenizer has a chat template gets it, tokenized exactly as
`mlx_lm.generate` does (`apply_chat_template(..., tokenize=False)`, then `encode(text,
add_special_tokens=False)`: the template writes any BOS itself). Everything else (native
`.tinygpt` models, or `--no-chat-template`) gets the plain turn format (`plain_text`):

    System: ...
    User: ...
    Assistant: ...
    User: ...
    Assistant:

with "\\nUser:" as a stop string, so the model does not write the user's next line.

Turns. A `Conversation` keeps the tokens its cache has seen, so a turn feeds only what is new:
the sampled token the engine did not feed yet (it feeds every sampled token but the last),
then the template's text between the reply and the next reply (end of turn, the new message,
the generation prompt). That text is the template applied to the conversation with a
placeholder reply and the new message, minus the template applied to the conversation so far,
minus the placeholder (`turn_text`). It is exact when the template has the prefix property (the
conversation so far renders as a prefix of the longer one: true for ChatML, Llama and the plain
format); a template that re-renders earlier turns (a message count, a date, the last turn
marked) does not, and then a turn is the end of turn after the placeholder followed by the
system message (if any) and the new message rendered alone, as `mlx_lm.chat` renders every
turn (`Turn.rule == "alone"`). The reply's own tokens are never re-encoded: the cache holds what
the model generated. Where a stop string ended the reply inside the text the template adds next
(the model wrote "\\nUser:" itself), the part already in the cache is not added again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

PLAIN_STOP = "\nUser:"
# A placeholder reply: one private-use character, neither alphanumeric nor whitespace, so no
# template strips it and the plain format joins it to "Assistant:" directly.
PLACEHOLDER = "\ue000"


def wrapper_of(tokenizer: Any) -> Any:
    """mlx-lm's TokenizerWrapper behind our `Tokenizer`, or None (native)."""
    return getattr(tokenizer, "_wrapper", None)


def has_template(tokenizer: Any) -> bool:
    """Whether the tokenizer brings its own chat template (mlx-lm models that ship one)."""
    w = wrapper_of(tokenizer)
    return bool(w is not None and (getattr(w, "has_chat_template", False) or getattr(w, "chat_template", None)))


def plain_text(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The plain turn format: "Role: content" lines, then "Assistant:" (with
    `add_generation_prompt`). An assistant message starting with a space, a newline or
    punctuation follows "Assistant:" directly: that is how the model generated it (its answer
    began right after "Assistant:"), so the history reproduces the generated text."""
    lines = []
    for m in messages:
        role, content = str(m.get("role", "user")).capitalize(), m.get("content", "")
        sep = " " if role != "Assistant" or (content[:1].isalnum()) else ""
        lines.append(f"{role}:{sep}{content}")
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n".join(lines)


def render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
           use_template: bool = True) -> str:
    """The chat's text: the model's template (where it has one and `use_template`), else plain."""
    if use_template and has_template(tokenizer):
        return wrapper_of(tokenizer).apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)
    return plain_text(messages, add_generation_prompt)


def encode_fragment(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a piece of text inside a conversation: no BOS or other added tokens (special
    tokens written in the text, e.g. "<|im_end|>", are still recognised)."""
    w = wrapper_of(tokenizer)
    if w is None:
        return tokenizer.encode(text)
    return list(w.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer: Any, messages: list[dict], use_template: bool = True) -> list[int]:
    """A whole chat prompt's ids, ending in the generation prompt (as `mlx_lm.generate` makes
    them for a templated model)."""
    text = render(tokenizer, messages, True, use_template)
    if use_template and has_template(tokenizer):
        return encode_fragment(tokenizer, text)
    return tokenizer.encode(text)


def stop_strings(tokenizer: Any, use_template: bool = True) -> tuple[str, ...]:
    """The stop strings a chat format implies: "\\nUser:" for the plain one, none for a template
    (its end-of-turn token is the tokenizer's EOS)."""
    return () if use_template and has_template(tokenizer) else (PLAIN_STOP,)


def user_prompt_ids(tokenizer: Any, prompt: str, system: Optional[str] = None,
                    use_template: bool = True) -> list[int]:
    """`sample`'s prompt: the chat template around one user message (and `system`) for a
    templated model, as `mlx_lm.generate` does; otherwise the text as written (after `system`
    and a blank line, if given): a native model is a base language model."""
    if use_template and has_template(tokenizer):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return prompt_ids(tokenizer, msgs)
    return tokenizer.encode(f"{system}\n\n{prompt}" if system else prompt)


def turn_text(tokenizer: Any, messages: list[dict], user: str, use_template: bool = True) -> tuple[str, str]:
    """The text from the end of the last reply to the next generation prompt, and the rule used:
    "prefix" (the template's own text: full conversation minus the conversation so far) or
    "alone" (the template re-renders earlier turns: end of turn + the new message alone).
    `messages` ends with the user message the last reply answered."""
    asst = {"role": "assistant", "content": PLACEHOLDER}
    new = {"role": "user", "content": user}
    before = render(tokenizer, messages, True, use_template) + PLACEHOLDER
    after = render(tokenizer, messages + [asst, new], True, use_template)
    if after.startswith(before):
        return after[len(before):], "prefix"
    closed = render(tokenizer, messages + [asst], False, use_template)
    eot = closed[closed.rindex(PLACEHOLDER) + 1:] if PLACEHOLDER in closed else ""
    system = [m for m in messages[:1] if m.get("role") == "system"]
    return eot + render(tokenizer, system + [new], True, use_template), "alone"


@dataclass
class Conversation:
    """The messages of a chat and the tokens its cache holds.

    `fed`: every token fed to the cache, in order; `pending`: tokens meant for the cache that
    were not fed yet (the reply's last sampled token; the rest of a prompt whose prefill was
    cancelled); `extra`: text the cache holds beyond the last reply (a stop string's start)."""
    tokenizer: Any
    use_template: bool = True
    system: Optional[str] = None
    messages: list[dict] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    extra: str = ""

    def __post_init__(self):
        if self.system and not self.messages:
            self.messages.append({"role": "system", "content": self.system})

    @property
    def replies(self) -> int:
        return sum(m.get("role") == "assistant" for m in self.messages)

    def next_ids(self, user: str) -> tuple[list[int], str]:
        """The tokens to feed for a new user message, and the rule ("first", "prefix", "alone");
        changes nothing (call `add_user` when the turn runs)."""
        if not self.replies:
            return self.pending + prompt_ids(self.tokenizer, self.messages + [{"role": "user", "content": user}],
                                             self.use_template), "first"
        text, rule = turn_text(self.tokenizer, self.messages[:-1], user, self.use_template)
        if self.extra and text.startswith(self.extra):
            text = text[len(self.extra):]
        return self.pending + encode_fragment(self.tokenizer, text), rule

    def add_user(self, user: str) -> None:
        self.messages.append({"role": "user", "content": user})
        self.pending, self.extra = [], ""

    def add_reply(self, prompt: list[int], generated: list[int], fed: int, text: str) -> None:
        """After a turn: `prompt` (what `next_ids` gave) and `generated` (the sampled tokens) were
        meant for the cache, of which the first `fed` were fed; `text` is the reply shown."""
        meant = list(prompt) + list(generated)
        self.fed += meant[:fed]
        self.pending = meant[fed:]
        whole = self.tokenizer.decode(generated) if generated else ""
        self.extra = whole[len(text):] if whole.startswith(text) else ""
        self.messages.append({"role": "assistant", "content": text})

    def transcript_ids(self) -> list[int]:
        """Every token of the conversation so far (fed and pending)."""
        return self.fed + self.pending


@dataclass
class Turn:
    """One turn's numbers, all read from the cache's own counters (`/stats`)."""
    index: int
    rule: str
    new_tokens: int                 # tokens this turn fed before its reply (pending + new text)
    reply_offset: int = 0           # where the reply's tokens begin in the transcript
    prefilled: int = 0              # currentLength after the prefill minus before the turn
    generated: int = 0
    finish_reason: str = ""
    reply: str = ""
    current_length: int = 0
    stored_count: int = 0
    cold_count: int = 0
    cache_bytes: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefilled / self.prefill_seconds if self.prefill_seconds else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(decode_tokens_per_s=self.decode_tokens_per_s, prefill_tokens_per_s=self.prefill_tokens_per_s)
        return d


class ChatSession:
    """A conversation against one cache that lives across turns.

        session = ChatSession(loaded, cache_config, sample_config)
        for piece in session.say("Hello"):      # the reply, streamed
            print(piece, end="")
        session.turns[-1]                       # its numbers

    `should_stop()` (checked after each model call) ends a reply early, keeping the session:
    what was fed stays in the cache and in the conversation. `reset()` starts over."""

    def __init__(self, loaded: Any, cache_config: Any, sample_config: Any, system: Optional[str] = None,
                 use_template: bool = True):
        self.loaded, self.cache_config, self.sample_config = loaded, cache_config, sample_config
        self.system, self.use_template = system, use_template
        self.cache = None
        self.turns: list[Turn] = []
        self.reset()

    @property
    def templated(self) -> bool:
        return self.use_template and has_template(self.loaded.tokenizer)

    def reset(self) -> None:
        from .cache import make_cache  # noqa: PLC0415 (the module stays light for the server's imports)
        if self.cache is not None:
            self.cache.close()
        self.cache = make_cache(self.loaded.model, self.cache_config)
        self.conversation = Conversation(self.loaded.tokenizer, self.use_template, self.system)
        self.turns = []

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    @property
    def cold_count(self) -> int:
        return max((len(c.cold) for c in self.cache.owned if getattr(c, "cold", None) is not None), default=0)

    def _fits(self, n: int) -> int:
        """Room left in the model's context after `n` more tokens, for a full cache (None when
        the policy is bounded or the context unknown); raises when they do not fit."""
        from .errors import ContextLengthError  # noqa: PLC0415
        ctx, cfg = self.loaded.context_length, self.cache_config
        if not ctx or cfg.streaming or cfg.retrieval:
            return None
        have = self.cache.current_length
        if have + n > ctx:
            raise ContextLengthError(
                f"this message needs {n} tokens but the conversation already holds {have} of the model's "
                f"{ctx}-token context: /reset, or chat with --streaming-llm-window or --kiv-hot-budget")
        return ctx - have - n

    def say(self, user: str, should_stop: Optional[Callable[[], bool]] = None,
            progress: Optional[Callable[[int, int], None]] = None) -> Iterator[str]:
        """Feed the new message (only its new tokens), stream the reply's text."""
        from .generate import GenerationStats, steps  # noqa: PLC0415
        from .sampling import make_sampler  # noqa: PLC0415
        from .textstream import TextStream  # noqa: PLC0415

        tok, s, cache = self.loaded.tokenizer, self.sample_config, self.cache
        ids, rule = self.conversation.next_ids(user)
        room = self._fits(len(ids))
        max_tokens = s.max_tokens if room is None else min(s.max_tokens, room)
        self.conversation.add_user(user)
        turn = Turn(len(self.turns) + 1, rule, len(ids), len(self.conversation.fed) + len(ids))
        self.turns.append(turn)
        start = cache.current_length
        stats = GenerationStats(cache=cache)
        sampler = make_sampler(s.temperature, s.top_p, s.top_k, s.seed)
        stops = tuple(s.stop) + stop_strings(tok, self.use_template)
        text = TextStream(tok, stops)
        eos = frozenset() if s.ignore_eos else frozenset(tok.eos_ids)
        generated: list[int] = []
        fed, shown = 0, []

        def prefilled(done: int, total: int) -> None:
            turn.prefilled = cache.current_length - start
            if progress is not None:
                progress(done, total)

        try:
            for step in steps(self.loaded.model, ids, cache, sampler, max_tokens, s.prefill_chunk, stats,
                              eos, prefilled, should_stop):
                fed += len(step.fed)
                if step.token is None:
                    continue
                generated.append(step.token)
                piece = text.add(step.token)
                if piece:
                    shown.append(piece)
                    yield piece
                if text.stopped:
                    stats.finish_reason = "stop"
                    break
            tail = text.finish()
            if tail:
                shown.append(tail)
                yield tail
        finally:
            self.conversation.add_reply(ids, generated, fed, "".join(shown))
            turn.generated, turn.finish_reason, turn.reply = len(generated), stats.finish_reason, "".join(shown)
            turn.current_length, turn.stored_count = cache.current_length, cache.stored_count
            turn.cold_count, turn.cache_bytes = self.cold_count, cache.nbytes
            turn.prefill_seconds, turn.decode_seconds = stats.prefill_seconds, stats.decode_seconds
