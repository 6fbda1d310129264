"""Where the retrieval policy attaches its cold store to a layer cache."""

from __future__ import annotations

from ..config import CacheConfig


def attach(layer_cache, config: CacheConfig, layer_index: int) -> None:
    """Give `layer_cache` a cold store when the policy asks for retrieval."""
    if config.retrieval:
        from .retrieval import attach_cold_store  # noqa: PLC0415
        attach_cold_store(layer_cache, config, layer_index)
