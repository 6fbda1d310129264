"""`ServerConfig`: the server's settings and their defaults (the CLI reads them from here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ConfigError, SampleConfig, _positive, field_default


@dataclass(frozen=True)
class ServerConfig:
    """host/port to listen on; warm slots kept; the small-request rule's threshold (tokens).
    A bad value is a `ConfigError` naming the field."""

    host: str = "127.0.0.1"
    port: int = 11434                 # ollama's port, which clients assume
    max_slots: int = 2
    small_request: int = 256
    prefill_chunk: int = field(default=field_default(SampleConfig, "prefill_chunk"))

    def __post_init__(self) -> None:
        for name, low in (("port", 1), ("max_slots", 1), ("small_request", 0), ("prefill_chunk", 1)):
            _positive(name, getattr(self, name), low)
        if self.port > 65535:
            raise ConfigError("port", f"must be <= 65535, got {self.port}")

    @property
    def loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")
