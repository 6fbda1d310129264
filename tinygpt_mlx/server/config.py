"""`ServerConfig`: the server's settings and their defaults (the CLI reads them from here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import SampleConfig, field_default


@dataclass(frozen=True)
class ServerConfig:
    """host/port to listen on; warm slots kept; the small-request rule's threshold (tokens)."""

    host: str = "127.0.0.1"
    port: int = 11434                 # ollama's port, which clients assume
    max_slots: int = 2
    small_request: int = 256
    prefill_chunk: int = field(default=field_default(SampleConfig, "prefill_chunk"))

    def __post_init__(self) -> None:
        for name, low in (("port", 1), ("max_slots", 1), ("small_request", 0), ("prefill_chunk", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        if self.port > 65535:
            raise ValueError(f"port must be <= 65535, got {self.port}")

    @property
    def loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")
