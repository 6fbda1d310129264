"""What the routes share: the `Server` (model, names, slot pool, worker), `ApiError` and
request parsing. Imported by `app` (which builds the FastAPI app) and `routes`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
from fastapi import Request

from . import prompt as pr
from ..cache import make_cache
from ..chat_template import PromptTurn, has_template, template_id
from ..cache.persist import PLACEMENT, PromptCacheError, load_prompt_cache, read_prompt_cache_info, save_prompt_cache
from ..generate import prefill
from .slots import SlotPool
from .worker import Job, Worker

log = logging.getLogger("posttrainllm.server")


def names_for(label: str) -> tuple[str, str]:
    """(name, name:tag): an ollama name keeps its tag (smollm2:135m), any other gets :latest."""
    if ":" in label:
        return label.rsplit(":", 1)[0], label
    return label, f"{label}:latest"


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def read_json(request: Request) -> dict:
    body = await request.body()
    if not body.strip():
        raise ApiError(400, "missing request body")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


def probe(loaded: Any, cache_config: Any) -> None:
    """Run one token through a fresh cache so a policy the model cannot use fails at startup
    (e.g. a KIVI group size that does not divide the head dimension), not on the first request."""
    token = loaded.tokenizer.eos_id if loaded.tokenizer.eos_id is not None else 0
    with make_cache(loaded.model, cache_config) as cache:
        prefill(loaded.model, [token], cache, 1)


def policy_difference(saved: Any, served: Any) -> Optional[str]:
    """The first cache-policy field in which a prompt-cache file's policy differs from the
    served one, as the caches use them (`CacheConfig.in_effect`), or None; where the cold store
    lives (`cold_store`, `cold_path`) is not policy: either store retrieves the same tokens and
    reads the other's rows."""
    for f in dataclasses.fields(saved):
        if f.name not in PLACEMENT and saved.in_effect(f.name) != served.in_effect(f.name):
            return f.name
    return None


def prompt_turn(info: Any, loaded: Any) -> Optional[PromptTurn]:
    """A prompt-cache file's chat record (None: none, raw text); a file made with a chat template
    must have been made with the served model's (otherwise a one-line `PromptCacheError`)."""
    try:
        turn = None if info.chat is None else PromptTurn.from_dict(info.chat)
    except ValueError as e:
        raise PromptCacheError(f"{info.path}: corrupt prompt cache ({e})") from None
    if turn is not None and turn.templated and turn.template != template_id(loaded.tokenizer):
        mine = template_id(loaded.tokenizer)
        raise PromptCacheError(f"{info.path}: the prompt cache was made with another chat template (sha256 "
                               f"{turn.template[:12]}…) than the served model's ({mine[:12] + '…' if mine else 'none'}); "
                               "re-create it with cache-prompt")
    return turn


def turn_note(path: Any, loaded: Any) -> Optional[str]:
    """What the start-up says about a pre-warmed file's chat format, or None (raw text for a
    model without a chat template: requests are raw too)."""
    info = read_prompt_cache_info(path)
    turn = prompt_turn(info, loaded)
    if turn is not None and turn.turn == "user":
        return (f"{path}: the document opens a user message in the chat template; a request whose message is the "
                "document, a blank line and a question extends its slot")
    if (turn is None or not turn.templated) and has_template(loaded.tokenizer):
        why = "made with --no-chat-template" if turn is not None else "no chat-template record"
        return (f"{path} holds raw text ({why}): templated requests do not begin with it; only raw ones "
                "(/api/generate with \"raw\": true, /v1/completions) that begin with its text extend its slot")
    return None


def load_for_server(path: Any, loaded: Any, cache_config: Any) -> tuple[Any, list[int]]:
    """A prompt-cache file's cache and tokens for a pre-warmed slot: the file's policy must be
    the served one, its model the served model (fingerprint), its chat template the served
    model's, its checksum right; otherwise a one-line `PromptCacheError` naming the file."""
    path = Path(path)
    info = read_prompt_cache_info(path)
    prompt_turn(info, loaded)
    field = policy_difference(info.config, cache_config)
    if field is not None:
        raise PromptCacheError(f"{path}: the prompt cache was made with cache policy {info.config.label()} "
                               f"({field}={info.config.in_effect(field)!r}), but the server runs "
                               f"{cache_config.label()} ({field}={cache_config.in_effect(field)!r}); serve with "
                               "the file's policy flags or re-create the file")
    cache, info = load_prompt_cache(path, loaded, cold_path=cache_config.cold_path, cold_store=cache_config.cold_store,
                                    cold_ram=cache_config.cold_ram)
    return cache, info.tokens


class Server:
    """State shared by the routes: the model, its names, the pool and the worker."""

    def __init__(self, loaded: Any, cache_config: Any, max_slots: int, prefill_chunk: int,
                 small_tokens: int, prompt_caches: Sequence[Any] = (), slot_dir: Optional[Any] = None,
                 default_max_tokens: int = 0, default_num_ctx: Optional[int] = None, stop_loops: int = 0,
                 slot_checkpoints: int = 0, parallel: int = 1, prefill_tail: int = 0):
        self.loaded, self.cache_config = loaded, cache_config
        self.default_max_tokens, self.default_num_ctx = default_max_tokens, default_num_ctx
        mx.eval(loaded.model.parameters())     # materialise before another thread uses them
        probe(loaded, cache_config)
        self.names = names_for(loaded.name)
        self.pool = SlotPool(loaded.model, cache_config, max_slots, small_tokens,
                             loader=lambda path: load_for_server(path, loaded, cache_config),
                             checkpoints=slot_checkpoints)
        if len(prompt_caches) > max_slots:
            raise PromptCacheError(f"{prompt_caches[max_slots]}: {len(prompt_caches)} prompt caches but {max_slots} "
                                   "slot(s); each file takes one slot (raise --max-slots)")
        self.worker = Worker(loaded, self.pool, prefill_chunk, stop_loops, parallel, prefill_tail)
        self.prewarm_notes: list[str] = []      # what each pre-warmed file's chat format means
        try:
            for path in prompt_caches:          # pre-warmed slots: every file checked before serving
                cache, tokens = self.worker.call(lambda p=path: load_for_server(p, loaded, cache_config))
                self.pool.prewarm(str(path), cache, tokens)
                note = turn_note(path, loaded)      # said once, by `serve` on stderr
                if note:
                    self.prewarm_notes.append(note)
            self.slot_dir = None if slot_dir is None else Path(slot_dir)
            self.restored = self._restore_slots() if self.slot_dir is not None else []
        except BaseException:
            self.worker.stop()
            self.pool.close()
            raise
        self.started = time.time()

    SLOT_FILE = "slot-{}.ptc"

    def _restore_slots(self) -> list[str]:
        """Load the conversations a previous run saved in `slot_dir` (`slot-N.ptc`) into free
        slots; a file this server cannot use (another policy or model, a corrupt file) is
        skipped with a warning in the log, never fatal: it is a cache. Returns what was restored."""
        if not self.slot_dir.is_dir():
            return []
        done = []
        for path in sorted(self.slot_dir.glob(self.SLOT_FILE.format("*"))):
            try:
                cache, tokens = self.worker.call(lambda p=path: load_for_server(p, self.loaded, self.cache_config))
            except PromptCacheError as e:
                log.warning("slot file skipped: %s", e)
                continue
            if self.pool.restore(cache, tokens) is None:
                cache.close()
                log.warning("slot file skipped: %s: no free slot left", path)
                continue
            done.append(str(path))
        return done

    def save_slots(self) -> list[str]:
        """Save every slot's conversation to `slot_dir` (at shutdown, with the worker stopped),
        each file written atomically; files of slots that are now empty are removed."""
        if self.slot_dir is None:
            return []
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for slot in self.pool.conversations():
            path = self.slot_dir / self.SLOT_FILE.format(slot.index)
            try:
                save_prompt_cache(path, slot.cache, self.loaded, slot.tokens)
                written.append(str(path))
            except (OSError, ValueError) as e:
                log.warning("slot %d not saved: %s", slot.index, e)
        for old in self.slot_dir.glob(self.SLOT_FILE.format("*")):
            if str(old) not in written:
                old.unlink(missing_ok=True)
        log.info("saved %d slot(s) to %s", len(written), self.slot_dir)
        return written

    def bounded(self, requested: Optional[int]) -> Optional[int]:
        """A request's length, the server's default where it set none (None, -1, -2)."""
        if (requested is None or requested < 0) and self.default_max_tokens:
            return self.default_max_tokens
        return requested

    def context_limit(self, num_ctx: Optional[int]) -> Optional[int]:
        """The context a request gets: its num_ctx, else the server's default, capped by the
        model's trained context for a full cache; None = unlimited (StreamingLLM, retrieval)."""
        return pr.context_limit(self.loaded, self.cache_config,
                                num_ctx if num_ctx is not None else self.default_num_ctx)

    def job(self, p: "pr.Fitted", s: dict, unbounded_default: int) -> Job:
        if not p.ids:
            raise ApiError(400, "the prompt is empty")
        max_tokens = pr.max_new_tokens(s.get("num_predict", s.get("max_tokens")), p.limit, len(p.ids),
                                       unbounded_default)
        seed = s["seed"]
        seed = None if seed is None or seed < 0 else seed % 2**64     # -1: random (llama.cpp's convention)
        return Job(p.ids, max_tokens, temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
                   seed=seed, stop=tuple(s["stop"]), max_context=p.limit, max_prompt=p.budget, text=p.text,
                   logprobs=s.get("logprobs"), loop=asyncio.get_running_loop(), events=asyncio.Queue())

    def submit(self, job: Job) -> None:
        self.worker.submit(job)
