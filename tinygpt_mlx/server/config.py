"""`ServerConfig`: the server's settings and their defaults (the CLI reads them from here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import ConfigError, SampleConfig, _positive, field_default


def check_names(names, models: int) -> None:
    """`serve --name` (each model's name in the models' order): at most one per model, each one
    word with at most one ':tag', all different; a ValueError naming what was given. The CLI
    checks them before the first model loads; `app.rename` again."""
    if len(names) > models:
        raise ValueError(f"--name given {len(names)} times for {models} model(s)")
    for name in names:
        if not name or any(ch.isspace() for ch in name) or name.count(":") > 1:
            raise ValueError(f"--name {name!r}: a model name is one word, with at most one ':tag'")
    if len(set(names)) != len(names):
        raise ValueError(f"--name: the names must differ, got {', '.join(names)}")


@dataclass(frozen=True)
class ServerConfig:
    """host/port to listen on; warm slots kept; the small-request rule's threshold (tokens).
    A bad value is a `ConfigError` naming the field."""

    host: str = "127.0.0.1"
    port: int = 11434                 # ollama's port, which clients assume
    max_slots: int = 2
    small_request: int = 256
    prefill_chunk: int = field(default=field_default(SampleConfig, "prefill_chunk"))
    # the prompt's last tokens prefilled as a pass of their own (`generate.pass_end`); 0 = off
    prefill_tail: int = field(default=field_default(SampleConfig, "prefill_tail"))
    # A request that sets no length (ollama num_predict -1/-2 or absent, OpenAI chat without
    # max_tokens: LangChain's and most UIs' defaults) gets this many tokens at most; 0 = up to
    # the context, as ollama does (a 135M model then runs minutes on a CPU).
    default_max_tokens: int = 1024
    # The context of a request without num_ctx (ollama's OLLAMA_CONTEXT_LENGTH); None = the
    # model's trained context for a full cache, unlimited under StreamingLLM or retrieval.
    default_num_ctx: Optional[int] = None
    # Stop a reply whose last N tokens repeat one n-gram (of up to 64 tokens); 0 = off (a loop is
    # the model's output, and stopping it is the user's choice).
    stop_loops: int = 0
    # Checkpoints per slot for caches that cannot roll back (StreamingLLM, KIVI, retrieval): the
    # slot's state at the end of each of its last N prompts, so that a regenerated or edited reply
    # restores one instead of prefilling the conversation again. Each costs at most the window (or
    # hot budget) plus KIVI's residual and the cold store's open page; 0 = off.
    slot_checkpoints: int = 4
    # Requests answered at once (ollama's OLLAMA_NUM_PARALLEL): each has a cache of its own (its
    # warm slot's, or a scratch one beyond --max-slots), so memory grows with parallel x the
    # requests' contexts (a full cache: every token's K/V; StreamingLLM: its window); a request
    # past the limit, or past what memory holds, waits in the queue.
    parallel: int = 4

    def __post_init__(self) -> None:
        for name, low in (("port", 1), ("max_slots", 1), ("small_request", 0), ("prefill_chunk", 1), ("prefill_tail", 0),
                          ("default_max_tokens", 0), ("stop_loops", 0), ("slot_checkpoints", 0), ("parallel", 1)):
            _positive(name, getattr(self, name), low)
        if self.default_num_ctx is not None:
            _positive("default_num_ctx", self.default_num_ctx, 2)
        if self.port > 65535:
            raise ConfigError("port", f"must be <= 65535, got {self.port}")

    @property
    def loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")


def listen_address(value: str) -> tuple[str, int]:
    """Where `ollama serve` listens for an `OLLAMA_HOST` value, read the way ollama reads it:
    `host`, `host:port`, `:port` (every interface, as ollama binds it), `[::1]:port`, with or
    without `http://` (whose default port is 80; `https://` 443; none 11434) and a trailing
    path. A port that is not a number in 1-65535 is an error naming the value (ollama falls
    back to its default port with a warning; a server answering on another port than the one
    asked for is the harder surprise)."""
    text = value.strip()
    scheme, sep, rest = text.partition("://")
    default = {"http": 80, "https": 443}.get(scheme, None) if sep else 11434
    if default is None:
        raise ValueError(f"OLLAMA_HOST={value!r}: unknown scheme {scheme!r} (use host:port, http:// or https://)")
    hostport = (rest if sep else text).split("/", 1)[0]
    if hostport.startswith("["):                      # [v6] or [v6]:port
        inside, _, tail = hostport[1:].partition("]")
        host, port = inside, (tail[1:] if tail.startswith(":") else "")
    elif hostport.count(":") == 1:
        host, port = hostport.split(":")
        host = host or "0.0.0.0"
    else:                                             # a bare name, a bare v6 address or nothing
        host, port = hostport or "127.0.0.1", ""
    if not port:
        return host, default
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"OLLAMA_HOST={value!r}: port {port!r} is not a number in 1-65535")
    return host, int(port)

