"""`posttrainllm sample`: stream text from a model under any cache policy."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from tinygpt_mlx.chat_template import PromptTurn, has_template, template_id, user_prompt_ids
from tinygpt_mlx.config import CacheConfig, SampleConfig, field_default, random_seed
from tinygpt_mlx.lazy import lazy

from . import common as c
from .common import err
from .ranks import Ranks, print_ranks, ranks

caches = lazy("tinygpt_mlx.cache")
generate = lazy("tinygpt_mlx.generate")
kernel_cache = lazy("tinygpt_mlx.kernel_cache")
persist = lazy("tinygpt_mlx.cache.persist")

_S = SampleConfig

# Prefill progress is shown for prompts longer than one prefill chunk or at least this long.
PREFILL_PROGRESS_TOKENS = 1024


def banner(loaded, cache_config, sample_config, prompt_tokens: int, drawn_seed: bool = False) -> None:
    info = loaded.info
    kind = loaded.kind
    if loaded.format == "gguf":
        kind = f"GGUF {info['architecture']} via mlx-lm, weights {info['weights']}"
    err.print(f"[bold]posttrainllm[/bold] · model [cyan]{escape(loaded.name)}[/cyan] ({escape(kind)}, "
              f"{info.get('parameters', 0) / 1e6:.2f}M parameters, context {loaded.context_length})")
    err.print(f"cache policy: [green]{escape(cache_config.label())}[/green]")
    s = sample_config
    seed = (f"seed {s.seed}" + (f" (drawn: --seed {s.seed} repeats the run)" if drawn_seed else "")
            if s.seed is not None else "no seed (greedy)")
    err.print(f"sampling: temperature {s.temperature}, top-p {s.top_p}, top-k {s.top_k}, {seed}, "
              f"prompt {c.counted(prompt_tokens, 'token')}, up to {s.max_tokens} new, prefill chunk {s.prefill_chunk}"
              + (f", the last {s.prefill_tail} tokens apart" if s.prefill_tail else ""))


def print_report(r: dict) -> None:
    # (a prompt cache's file, tokens and load time: the note before the text says them; the JSON keeps them)
    stored = f"stored {r['stored_count']}"
    if r["stored_count"] != r["current_length"]:
        stored += " (StreamingLLM cap)" if "streaming_llm" in r["policy"] else " (policy cap)"
    parts = ", ".join(f"{escape(k)} {c.fmt_bytes(v)}" for k, v in r["cache_bytes_breakdown"].items()
                      if v and k != "sliding")
    windows = r.get("sliding_windows") or {}
    layers = f"{r['layers_with_kv']} layers"
    if windows:     # the split: the policy's global layers, the sliding-window layers' own rings
        split, n_sliding = r["cache_bytes_split"], sum(windows.values())
        at = ", ".join(f"{n} at {w}" for w, n in sorted(windows.items()))
        layers += (f": {r['layers_with_kv'] - n_sliding} global {c.fmt_bytes(split['global'])}"
                   f"{' (' + parts + ')' if parts else ''}, {n_sliding} sliding-window ({at}) "
                   f"{c.fmt_bytes(split['sliding'])}")
        parts = ""
    err.print(f"\n[bold]report[/bold]: prompt {c.counted(r['prompt_tokens'], 'token')}, generated {r['generated_tokens']} "
              f"({escape(r['finish_reason'])}); prefill {r['prefill_tokens_per_s']:.1f} tok/s, "
              f"decode {r['decode_tokens_per_s']:.1f} tok/s")
    if compiling := kernels_note(r.get("kernels_built") or {}):
        note(compiling)
    disk = r["cache_disk_bytes"]
    where = (f", {c.fmt_bytes(r['cache_bytes'] - disk)} in RAM + {c.fmt_bytes(disk)} memory-mapped on disk"
             if disk else "")
    err.print(f"cache: {c.fmt_bytes(r['cache_bytes'])}{where} over {layers}"
              f"{' (' + parts + ')' if parts else ''}; peak RSS {c.fmt_bytes(r['peak_rss_bytes'])}; currentLength {r['current_length']}, {stored}")
    if r.get("world_size", 1) > 1:
        print_ranks(r)


def kernels_note(built: dict) -> str:
    """What a report adds when MLX's CPU backend compiled kernels inside the timed phases (a
    policy's first run on a machine: tinygpt_mlx/kernel_cache.py), else ""."""
    prefill, decode = built.get("prefill", 0), built.get("decode", 0)
    if not prefill + decode:
        return ""
    where = " and ".join(f"{n} during the {phase}" for phase, n in (("prefill", prefill), ("decode", decode)) if n)
    n = prefill + decode
    return (f"MLX compiled {c.counted(n, 'CPU kernel')} for this run ({where}) and keeps "
            f"{'it' if n == 1 else 'them'} in {kernel_cache.folder()} for later runs: the speeds above include compiling; a second run shows "
            f"the steady ones")


def note(message: str) -> None:
    err.print(f"[dim]note:[/dim] {escape(message)}")


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {escape(message)}")


EMPTY_PROMPT_FILE = "omit --prompt-file to sample unconditionally from the start token"


def read_prompt_file(path: Path, if_empty: str = EMPTY_PROMPT_FILE) -> str:
    """The prompt file's text; an unreadable, non-UTF-8 or empty file is a usage error naming it
    (an empty one says `if_empty`: what the command can do instead)."""
    hint = "'--prompt-file'"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise typer.BadParameter(f"cannot read {path}: {e.strerror or e}", param_hint=hint) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise typer.BadParameter(f"{path} is not UTF-8 text ({e.reason}: byte 0x{data[e.start]:02x} at offset "
                                 f"{e.start})", param_hint=hint) from None
    if not text:
        raise typer.BadParameter(f"{path} is empty; {if_empty}", param_hint=hint)
    return text


def run_positions(cfg: CacheConfig, context: Optional[int], prompt_tokens: int, sample_config: SampleConfig,
                  save_to: Optional[Path]) -> Optional[CacheConfig]:
    """The policy with original positions where they are the run's to choose (`--streaming-llm-rope
    auto`, retrieval's default) and the whole run, the prompt and up to --tokens more, fits the
    trained context (`CacheConfig.for_run`); None where nothing changes. A cache saved for later
    (--save-prompt-cache) may be continued past this run: it keeps shifted positions."""
    if save_to is not None:
        return None
    chosen = cfg.for_run(context, prompt_tokens + sample_config.max_tokens)
    return chosen if chosen is not cfg else None


def config_context_warning(context: Optional[int], cfg: CacheConfig) -> Optional[str]:
    """Up front: a shifted policy whose cache slots reach past the trained context.

    Shifted RoPE puts keys at cache slots, so the largest query-key distance is the span the
    policy attends to: sink + window for StreamingLLM; sink + the retrieved tokens' slots
    (1 with --kiv-positions fixed, --kiv-page-size with page, --kiv-top-p with slots) + hot
    budget for retrieval.
    """
    if not context or cfg.rope_mode != "shifted":
        return None
    span = cfg.slot_span
    if span is None or span <= context:
        return None
    if cfg.streaming:
        return (f"StreamingLLM sink {cfg.sink} + window {cfg.window} = {span} positions exceed "
                f"the model's trained context ({context}), so attention reaches untrained positions; keep "
                f"--streaming-llm-sink + --streaming-llm-window <= {context}")
    return (f"retrieval spans sink {cfg.sink} + {cfg.retrieved_slots} retrieved slot(s) + hot budget "
            f"{cfg.hot_budget} = {span} positions, past the model's trained context ({context}); keep that sum "
            f"<= {context} (lower --kiv-hot-budget)")


def prefill_context_warning(context: Optional[int], cfg: CacheConfig, chunk: int, prompt_tokens: int
                            ) -> Optional[str]:
    """Up front: a `--prefill-chunk` wider than `CacheConfig.prefill_fit`."""
    fit = cfg.prefill_fit(context, prompt_tokens)
    if fit is None or min(chunk, prompt_tokens) <= fit:
        return None
    held = context - fit
    return (f"prefill chunk {chunk}: with {held} tokens kept before each chunk, prefill reaches "
            f"{held + min(chunk, prompt_tokens)} positions, past the model's trained context ({context}); "
            f"--prefill-chunk {fit} or less keeps them inside")


def passing_context_warning(context: int, cfg: CacheConfig) -> Optional[str]:
    """What to say when the tokens seen pass the trained context: only where positions keep
    growing (the full cache, or absolute RoPE positions under a window or retrieval)."""
    if cfg.streaming or cfg.retrieval:
        if cfg.rope_mode != "absolute":
            return None
        return (f"generation passed the model's trained context ({context} tokens): with "
                "--streaming-llm-rope absolute, positions keep growing past it; --streaming-llm-rope "
                "shifted keeps them inside")
    return (f"generation passed the model's trained context ({context} tokens): the full cache keeps every "
            "token, so attention now spans positions the model was never trained on; a window "
            "(--streaming-llm-window) or retrieval (--kiv-hot-budget) keeps it inside")


@c.with_cache_options
def sample(
    cache_config: CacheConfig,
    model: c.ModelArg = None,
    weights: c.Weights = "auto",
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", "-p", help="Prompt text. Omit it (and --prompt-file) to sample unconditionally from the "
        "start token; an empty --prompt '' is an error.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(
        "--prompt-file", help="Read the prompt from this UTF-8 file (not empty).", exists=True,
        dir_okay=False)] = None,
    tokens: Annotated[Optional[int], typer.Option(
        "--tokens", "-n", help="Tokens to generate; 0 = prefill only (no text; the report times the prefill). "
        f"Default {field_default(_S, 'max_tokens')}.", show_default=False)] = None,
    temperature: c.Temperature = None,
    top_p: c.TopP = None,
    top_k: c.TopK = None,
    seed: c.Seed = None,
    prefill_chunk: c.PrefillChunk = None,
    prefill_tail: c.PrefillTail = None,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos", help="Keep generating past the end-of-text token (for long runs).")] = False,
    report_json: Annotated[Optional[Path], typer.Option(
        "--report-json", help="Also write the report as JSON to this path (checked writable before the "
        "model loads).", dir_okay=False)] = None,
    prompt_cache: Annotated[Optional[Path], typer.Option(
        "--prompt-cache", help="Continue from a prompt-cache file (posttrainllm cache-prompt). A file made with "
        "the chat template holds the document as the opening of the user's message: the prompt (the question) "
        "completes it after a blank line and the turn is closed, so the answer is that of `sample --prompt "
        "\"DOCUMENT<blank line>QUESTION\"`. A raw file (--no-chat-template) is followed by the prompt as "
        "written (if its tokens start with the cached ones, only the rest is fed); without a prompt, generation "
        "continues the cached text. The file is not changed. Policy flags may be left out (the file's policy "
        "is used); any given must match it.", exists=True, dir_okay=False)] = None,
    save_prompt_cache: Annotated[Optional[Path], typer.Option(
        "--save-prompt-cache", help="After generating, save the extended cache (cached + prompt + generated "
        "tokens) to this prompt-cache file (may be the --prompt-cache file itself; replaced atomically).",
        dir_okay=False)] = None,
    system: Annotated[Optional[str], typer.Option(
        "--system", help="A system prompt: the chat template's system message where the model has a "
        "template, else written before the prompt and a blank line. With --prompt-cache the file's (from "
        "cache-prompt --system) is used: one given must be the same.")] = None,
    no_chat_template: Annotated[bool, typer.Option(
        "--no-chat-template", help="Send the prompt as written, even where the model has a chat template "
        "(mlx-lm models with one get it by default, like mlx_lm.generate). With --prompt-cache it must "
        "match the file (made with or without it).")] = False,
) -> None:
    """Generate text: banner, notes and report on stderr, only the generated text on stdout.

    An mlx-lm model with a chat template gets the prompt as one user message in its template
    (tokenized as mlx_lm.generate does; --no-chat-template sends it raw); a native model gets it as
    written. No prompt at all samples unconditionally from the start token (a note says so); an empty
    --prompt '' or --prompt-file is an error. --tokens 0 only runs the prefill. A prompt longer
    than one prefill chunk (or 1024 tokens) shows prefill progress on stderr. Passing the model's
    trained context, or a window / retrieval span wider than it, is warned about once on stderr.
    """
    if prompt is not None and prompt_file is not None:
        raise typer.BadParameter("give --prompt or --prompt-file, not both")
    if prompt == "":
        raise typer.BadParameter("is empty; omit --prompt to sample unconditionally from the start token",
                                 param_hint="'--prompt'")
    try:
        sample_config = SampleConfig(**{k: v for k, v in dict(
            max_tokens=tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            prefill_chunk=prefill_chunk, prefill_tail=prefill_tail, ignore_eos=ignore_eos).items()
            if v is not None})
    except ValueError as e:
        raise c.config_error(e) from None
    drawn_seed = sample_config.seed is None and sample_config.temperature > 0
    if drawn_seed:     # drawn here, so that the banner can say how to repeat the run
        sample_config = dataclasses.replace(sample_config, seed=random_seed())
    c.check_writable(report_json, "--report-json")
    c.check_writable(save_prompt_cache, "--save-prompt-cache")
    model = c.resolve_model(model)  # a bad MODEL fails before the heavy imports
    text = read_prompt_file(prompt_file) if prompt_file is not None else prompt
    saved = read_prompt_cache(prompt_cache, cache_config) if prompt_cache is not None else None
    turn = check_turn(saved, text, system, no_chat_template) if saved is not None else None
    with c.guarded(), ranks() as world:
        loaded = c.load_model(model, weights)
        if loaded.info.get("weights_note"):     # packed weights asked for: why some types are not
            note(loaded.info["weights_note"])
        if world.group is not None and (saved is not None or save_prompt_cache is not None):
            raise ValueError("prompt-cache files (--prompt-cache, --save-prompt-cache) are one process's "
                             "cache; they are not supported under several ranks yet")
        if saved is not None:
            run_from_prompt_cache(loaded, saved, turn, text, no_chat_template, sample_config, report_json,
                                  save_prompt_cache, cache_config, drawn_seed)
            return
        if world.group is not None:
            world.shard(loaded)
            sample_config = world.shared_seed(sample_config)
        if text is None:
            bos = loaded.tokenizer.eos_id
            if bos is None:
                raise ValueError("no prompt given and the model has no BOS/EOS token to start from; "
                                 "give --prompt or --prompt-file")
            ids = [bos]
        else:
            ids = user_prompt_ids(loaded.tokenizer, text, system, not no_chat_template)
            if not ids:
                raise ValueError("the prompt encodes to no tokens")
        context = loaded.context_length
        generate.check_context(len(ids), context, cache_config)
        chosen = run_positions(cache_config, context, len(ids), sample_config, save_prompt_cache)
        cache_config = chosen or cache_config
        fit = cache_config.prefill_fit(context, len(ids))
        narrowed = prefill_chunk is None and fit is not None and fit < sample_config.prefill_chunk
        if narrowed:   # the default chunk, narrowed so that prefill stays inside the trained context
            sample_config = dataclasses.replace(sample_config, prefill_chunk=fit)
        banner(loaded, cache_config, sample_config, len(ids), drawn_seed)
        if narrowed:
            note(f"prefill chunk {fit}: the widest whose queries stay inside the model's trained context "
                 f"({context}) with this policy (--prefill-chunk sets it)")
        if text is not None and has_template(loaded.tokenizer):
            note("the prompt was sent raw (--no-chat-template)" if no_chat_template
                 else "the prompt is one user message in the model's chat template (--no-chat-template: raw)")
        if chosen is not None:
            note(f"original RoPE positions: prompt + --tokens ({len(ids)} + {sample_config.max_tokens}) fit the "
                 f"model's trained context ({context}); --streaming-llm-rope shifted keeps cache slots")
        if text is None:
            note(f"no prompt given: sampling unconditionally from the start token (id {ids[0]})")
        if sample_config.max_tokens == 0:
            note("--tokens 0: prefill only, no text is generated; the report times the prefill")
        for upfront in (config_context_warning(context, cache_config),
                        prefill_context_warning(context, cache_config, sample_config.prefill_chunk, len(ids))):
            if upfront:
                warn(upfront)
        passing = passing_context_warning(context, cache_config) if context else None
        with caches.make_cache(loaded.model, cache_config) as cache:
            templated = text is not None and not no_chat_template and has_template(loaded.tokenizer)
            after = PromptTurn(template_id(loaded.tokenizer), "reply", system) if templated else PromptTurn()
            report = run(loaded, ids, cache_config, sample_config, context, passing, world, cache=cache,
                         done=saver(save_prompt_cache, loaded, ids, cache, after))
        print_report(report)
        if report_json is not None and world.rank == 0:
            c.write_atomic(report_json, json.dumps(report, indent=2) + "\n")


def read_prompt_cache(path: Path, cache_config: CacheConfig):
    """The file's metadata, before the model loads: a file that is not a usable prompt cache, or
    a policy flag that contradicts its policy, is a usage error naming the flag."""
    try:
        info = persist.read_prompt_cache_info(path)
    except persist.PromptCacheError as e:
        raise typer.BadParameter(str(e), param_hint="'--prompt-cache'") from None
    field = persist.config_mismatch(info.config, cache_config)
    if field is None:
        return info
    flag = c.CONFIG_FLAGS.get(field, field)
    made, given = info.config.in_effect(field), cache_config.in_effect(field)
    if field in _SIDES:    # --kv-quantize sets both sides: name it beside the side's own flag
        side = _SIDES[field]
        raise typer.BadParameter(
            f"{path} was made with {_precision(info.config, made)} {side}, not {_precision(cache_config, given)}; "
            f"leave --kv-quantize and {flag} out to use the file's policy ({info.config.label()})",
            param_hint=f"'--kv-quantize' / '{flag}'")
    raise typer.BadParameter(f"{path} was made with {flag} {made}, not {given}; leave {flag} out to use the "
                             f"file's policy ({info.config.label()})", param_hint=f"'{flag}'")


#: the KIVI precision fields of a policy and the side of the cache each sets
_SIDES = {"key_bits": "keys", "value_bits": "values"}


def _precision(config: CacheConfig, bits: Optional[int]) -> str:
    """A side's precision as --kv-quantize names it: int8, or the exact storage (fp32...)."""
    return f"int{bits}" if bits else config.storage


def check_turn(saved, text: Optional[str], system: Optional[str], raw: bool) -> Optional[PromptTurn]:
    """The file's chat record (None: it has none, older than format 6 or saved by chat / serve:
    raw text), checked against the flags before the model loads: every contradiction is a usage
    error naming the flag."""
    path = saved.path
    try:
        turn = None if saved.chat is None else PromptTurn.from_dict(saved.chat)
    except ValueError as e:
        raise typer.BadParameter(f"{path}: corrupt prompt cache ({e})", param_hint="'--prompt-cache'") from None
    if turn is None or not turn.templated:
        if system is not None:
            raise typer.BadParameter(f"{path} holds raw text, which a system prompt cannot precede; give it "
                                     "to cache-prompt --system", param_hint="'--system'")
        return turn
    if raw:
        raise typer.BadParameter(f"{path} was made with the model's chat template; leave --no-chat-template out, "
                                 "or make the file with cache-prompt --no-chat-template", param_hint="'--no-chat-template'")
    if turn.turn == "user" and text is None:
        raise typer.BadParameter(f"{path} ends inside the user's message (the document, in the chat template): "
                                 "give the question with --prompt or --prompt-file", param_hint="'--prompt'")
    if turn.turn == "reply" and text is not None:
        raise typer.BadParameter(f"{path} ends inside the assistant's reply (saved by --save-prompt-cache): "
                                 "continue it without --prompt, or hold a conversation with 'posttrainllm chat'",
                                 param_hint="'--prompt'")
    if system is not None and system != turn.system:
        made = f"system prompt {turn.system!r}" if turn.system else "no system prompt"
        raise typer.BadParameter(f"{path} was made with {made}; leave --system out (the file's is used)",
                                 param_hint="'--system'")
    return turn


def saver(path: Optional[Path], loaded, ids: list[int], cache, turn: PromptTurn):
    """`run`'s `done`: write the extended cache (every token fed so far) to `path`, if given,
    with `turn` as its chat record."""
    if path is None:
        return None

    def done(stats) -> None:
        fed = (list(ids) + stats.tokens)[:cache.current_length]
        persist.save_prompt_cache(path, cache, loaded, fed, stats.logits, chat=turn.as_dict())
        note(f"saved the extended cache ({c.counted(len(fed), 'token')}) to {path}")
    return done


def continuation(loaded, saved, turn: Optional[PromptTurn], text: Optional[str], raw: bool
                 ) -> tuple[list[int], list[str]]:
    """The prompt's tokens to feed after the file's, and the notes saying how it was joined: for
    an open user turn, what the one-shot prompt (the document, a blank line, the question, in the
    template) has after them; for raw text, the prompt as written (the rest, where its tokens
    start with the cached ones)."""
    cached, tok, notes = saved.tokens, loaded.tokenizer, []
    if turn is not None and turn.templated:
        mine = template_id(tok)
        if mine != turn.template:
            raise ValueError(f"{saved.path} was made with another chat template (sha256 {turn.template[:12]}…) "
                             f"than this model's ({mine[:12] + '…' if mine else 'none'}); re-create it with cache-prompt")
    elif has_template(tok) and not raw:
        why = "made with --no-chat-template" if turn is not None else \
            "no chat-template record: written before format 6, or saved by chat or serve"
        notes.append(f"{saved.path} holds raw text ({why}): the prompt follows it as written, without the "
                     "chat template (--no-chat-template turns this note off)")
    if text is None:
        return [], notes
    if turn is not None and turn.turn == "user":
        whole = turn.prompt_ids(tok, text)
        if whole[:len(cached)] != cached:
            raise ValueError(f"{saved.path}: the prompt's first characters tokenize together with the document's "
                             f"end, so the file's {len(cached)} tokens do not begin this prompt's; begin it with a "
                             "letter or a space, or ask without --prompt-cache")
        notes.append("the prompt completes the user's message in the model's chat template (the document, a "
                     "blank line, the prompt), as sample --prompt would send it")
        return whole[len(cached):], notes
    ids = tok.encode(text)
    if len(ids) > len(cached) and ids[:len(cached)] == cached:
        ids = ids[len(cached):]     # the whole document given again: feed only what follows
    return ids, notes


def run_from_prompt_cache(loaded, saved, turn: Optional[PromptTurn], text: Optional[str], raw: bool,
                          sample_config: SampleConfig, report_json: Optional[Path], save_to: Optional[Path],
                          flags: CacheConfig, drawn_seed: bool = False) -> None:
    """`sample --prompt-cache`: load the cache (the model's fingerprint and the file's checksum
    checked first), feed what follows the cached tokens (`continuation`), generate, report. The
    file's policy is used; where its stores live is the flags' (`--kiv-cold-store`, default ram,
    `--kiv-cold-ram`, `--kiv-cold-path`), whichever store wrote the file (placement is not policy)."""
    cached = saved.tokens
    cache_config = dataclasses.replace(saved.config, cold_store=flags.cold_store, cold_path=flags.cold_path,
                                       cold_ram=flags.cold_ram)
    context = loaded.context_length
    t0 = time.perf_counter()
    cache, info = persist.load_prompt_cache(saved.path, loaded, cold_path=flags.cold_path, cold_store=flags.cold_store,
                                            cold_ram=flags.cold_ram)
    load_seconds = time.perf_counter() - t0
    with cache:
        ids, notes = continuation(loaded, saved, turn, text, raw)
        if not ids and info.logits is None:
            raise ValueError(f"{saved.path} holds no logits to continue from; give --prompt")
        banner(loaded, cache_config, sample_config, len(ids), drawn_seed)
        note(f"prompt cache {saved.path}: {c.counted(len(cached), 'cached token')} (stored {cache.stored_count}), "
             f"loaded in {load_seconds:.2f} s; {c.counted(len(ids), 'new prompt token')}")
        for line in notes:
            note(line)
        upfront = config_context_warning(context, cache_config)
        if upfront:
            warn(upfront)
        passing = passing_context_warning(context, cache_config) if context else None
        after = PromptTurn(turn.template, "reply", turn.system) if turn is not None and turn.templated \
            else PromptTurn()
        report = run(loaded, ids, cache_config, sample_config, context, passing, cache=cache,
                     first_logits=info.logits, done=saver(save_to, loaded, cached + ids, cache, after))
        report["prompt_cache"] = {"path": str(saved.path), "cached_tokens": len(cached),
                                  "load_seconds": load_seconds,
                                  "turn": turn.turn if turn is not None else None}
    print_report(report)
    if report_json is not None:
        c.write_atomic(report_json, json.dumps(report, indent=2) + "\n")


def run(loaded, ids: list[int], cache_config: CacheConfig, sample_config: SampleConfig,
        context: Optional[int], passing: Optional[str], world: Optional[Ranks] = None, cache=None,
        first_logits=None, done=None) -> dict:
    """Stream the text to stdout; prefill progress and the context warning on stderr. Under
    several ranks (`world`), every rank runs this and only rank 0's output is shown. `cache`:
    one to continue (a loaded prompt cache, with `first_logits` when `ids` is empty); `done` is
    called with the stats at the end (before the cache is released)."""
    world = world or Ranks()
    cache = cache if cache is not None else caches.make_cache(loaded.model, cache_config)
    long = len(ids) > sample_config.prefill_chunk or len(ids) >= PREFILL_PROGRESS_TOKENS
    wrote, report, text = "", None, []
    with contextlib.ExitStack() as prefilling:
        bar = prefilling.enter_context(c.Progress("prefill", total=len(ids), unit="tok")) if long else None

        def progress(done: int, total: int) -> None:
            world.beat()
            if bar is not None:
                bar.update(done, total)

        stream = generate.stream_generate(loaded, ids, cache_config, sample_config, cache=cache, progress=progress,
                                 first_logits=first_logits)
        for chunk in stream:
            world.beat()
            prefilling.close()  # the first chunk comes after the prefill
            if chunk.text:
                world.write_stdout(chunk.text)
                wrote = chunk.text
                text.append(chunk.text)
            if passing and cache.current_length > context:
                if wrote and not wrote.endswith("\n") and sys.stdout.isatty() and err.is_terminal:
                    err.print()  # the warning on a line of its own, between the text
                warn(passing)
                passing = None
            if chunk.done:
                report = chunk.stats.report()
                if done is not None:
                    done(chunk.stats)
    if wrote:
        world.write_stdout("\n")
    if world.group is not None:
        report.update(world.report(report, "".join(text)))
    return report


def register(app: typer.Typer) -> None:
    app.command("sample")(sample)
