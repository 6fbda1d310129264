"""Chat conversations over one cache that lives across turns (`posttrainllm chat`); the
templates are chat_template.py's.

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

from .cache import make_cache
from .chat_template import encode_fragment, has_template, prompt_ids, stop_strings, turn_text
from .errors import ContextLengthError
from .generate import Reply, prefill


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
    kernels_built: int = 0          # MLX CPU kernels compiled inside this turn's timings (first use)

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
        self.logits = None      # the fp32 logits after the last token fed (None before any)
        self.reset()

    @property
    def templated(self) -> bool:
        return self.use_template and has_template(self.loaded.tokenizer)

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.close()
        self.cache = make_cache(self.loaded.model, self.cache_config)
        self.conversation = Conversation(self.loaded.tokenizer, self.use_template, self.system)
        self.turns = []
        self.logits = None

    def flush(self) -> Any:
        """Feed what the conversation means the cache to hold but was not fed yet (the last
        answer's final sampled token; the rest of a cancelled prefill), so that the cache holds
        the whole transcript; returns the logits after its last token. The next message then
        feeds only its own tokens."""
        conv = self.conversation
        if conv.pending:
            self.logits = prefill(self.loaded.model, conv.pending, self.cache, self._chunk(len(conv.pending)),
                                  tail=self.sample_config.prefill_tail)
            conv.fed += conv.pending
            conv.pending = []
        return self.logits

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    @property
    def cold_count(self) -> int:
        return max((len(c.cold) for c in self.cache.owned), default=0)

    def _chunk(self, n: int) -> int:
        """The prefill chunk for `n` more tokens: narrowed once the conversation passes the trained
        context under a shifted policy, so that no query sits farther than that from a key it
        sees (`CacheConfig.prefill_fit`)."""
        return self.cache_config.fitted_chunk(self.sample_config.prefill_chunk, self.loaded.context_length,
                                              self.cache.current_length + n)

    def _fits(self, n: int) -> int:
        """Room left in the model's context after `n` more tokens, for a full cache (None when
        the policy is bounded or the context unknown); raises when they do not fit."""
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
        tok, s, cache = self.loaded.tokenizer, self.sample_config, self.cache
        ids, rule = self.conversation.next_ids(user)
        room = self._fits(len(ids))
        max_tokens = s.max_tokens if room is None else min(s.max_tokens, room)
        self.conversation.add_user(user)
        turn = Turn(len(self.turns) + 1, rule, len(ids), len(self.conversation.fed) + len(ids))
        self.turns.append(turn)
        start = cache.current_length
        generated: list[int] = []
        fed, shown = 0, []

        def prefilled(done: int, total: int) -> None:
            turn.prefilled = cache.current_length - start
            if progress is not None:
                progress(done, total)

        reply = Reply(self.loaded.model, tok, ids, cache, max_tokens, self._chunk(len(ids)), s.temperature, s.top_p,
                      s.top_k, s.seed, tuple(s.stop) + stop_strings(tok, self.use_template), s.ignore_eos,
                      prefilled, should_stop, prefill_tail=s.prefill_tail)
        stats = reply.stats
        try:
            for step, piece in reply:
                fed += len(step.fed)
                if step.token is None:
                    continue
                generated.append(step.token)
                if piece:
                    shown.append(piece)
                    yield piece
            tail = reply.finish()
            if tail:
                shown.append(tail)
                yield tail
        finally:
            if fed and stats.logits is not None:
                self.logits = stats.logits
            self.conversation.add_reply(ids, generated, fed, "".join(shown))
            turn.generated, turn.finish_reason, turn.reply = len(generated), stats.finish_reason, "".join(shown)
            turn.current_length, turn.stored_count = cache.current_length, cache.stored_count
            turn.cold_count, turn.cache_bytes = self.cold_count, cache.nbytes
            turn.prefill_seconds, turn.decode_seconds = stats.prefill_seconds, stats.decode_seconds
            turn.kernels_built = sum(stats.kernels_built().values())
