"""`posttrainllm chat`: an interactive conversation whose cache lives across turns."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer
from rich.markup import escape

from tinygpt_mlx.config import CacheConfig, SampleConfig
from tinygpt_mlx.errors import ContextLengthError
from tinygpt_mlx.lazy import lazy

from . import common as c
from .common import err

chat_session = lazy("tinygpt_mlx.chat")
persist = lazy("tinygpt_mlx.cache.persist")

_S = SampleConfig
DEFAULT_CHAT_TOKENS = 256
PROMPT, MORE = ">>> ", "... "
HELP = ("commands: /stats (cache and speed), /reset (forget the conversation), /save FILE (prompt-cache "
        "file), /help, /quit. A message that starts with / is sent by writing // (//etc sends /etc). End a "
        "line with \\ to continue it; \"\"\" opens and closes a multi-line message. Ctrl-C stops an answer; "
        "Ctrl-C at the prompt or Ctrl-D ends the chat.")


class Interrupts:
    """SIGINT while an answer streams: the first asks the answer to stop (`stop` becomes true,
    checked after each model call), a second ends the session (KeyboardInterrupt)."""

    def __init__(self):
        self.stop = False
        self._old = None

    def _handler(self, signum, frame):
        if self.stop:
            raise KeyboardInterrupt
        self.stop = True

    def __enter__(self) -> "Interrupts":
        self.stop = False
        with contextlib.suppress(ValueError):          # not the main thread: no handler
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


def read_messages(interactive: bool) -> Iterator[str]:
    """Messages from stdin. A terminal: a prompt, line editing, a line ending in \\ continues,
    \"\"\" opens and closes a multi-line block. Otherwise one message per line. Ends at EOF
    (Ctrl-D) or Ctrl-C at the prompt."""
    if not interactive:
        for line in sys.stdin:
            yield line.rstrip("\n").rstrip("\r")
        return
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401, PLC0415 (line editing and history for input())
    while True:
        parts: list[str] = []
        try:
            line = input(PROMPT)
            if line.strip() == '"""':
                parts.append("")      # (an open block, even before its first line)
                while (more := input(MORE)).strip() != '"""':
                    parts.append(more)
                yield "\n".join(parts[1:])
                continue
            while line.endswith("\\"):
                parts.append(line[:-1])
                line = input(MORE)
            yield "\n".join(parts + [line])
        except (EOFError, KeyboardInterrupt):
            sys.stdout.write("\n")
            if parts:   # Ctrl-D / Ctrl-C inside a message: say it was not sent
                err.print("[yellow]the unfinished message was not sent[/yellow]")
            return


def turn_line(t) -> str:
    """The one dim line after each answer."""
    why = {"stop": "end of turn", "length": "token limit", "cancel": "stopped"}.get(t.finish_reason, t.finish_reason)
    return (f"[dim]turn {t.index}: +{t.prefilled} tokens prefilled, {t.generated} generated ({why}), "
            f"{t.decode_tokens_per_s:.1f} tok/s"
            + (f" (with MLX compiling {c.counted(t.kernels_built, 'CPU kernel')}, kept for later turns and runs)"
               if t.kernels_built else "")
            + f" · cache {t.stored_count} stored / {t.current_length} seen, "
            f"{c.fmt_bytes(t.cache_bytes)}[/dim]")


def stats_lines(session) -> list[str]:
    """`/stats`: the last turn and the cache, from the cache's own counters."""
    cfg, cache = session.cache_config, session.cache
    n, stored, cold = cache.current_length, cache.stored_count, session.cold_count
    lines = [f"policy: {escape(cfg.label())}",
             f"cache: currentLength {n}, stored {stored}, {c.fmt_bytes(cache.nbytes)}"
             + (f" ({c.fmt_bytes(cache.disk_nbytes)} memory-mapped on disk)" if cache.disk_nbytes else "")]
    gone = n - stored - cold
    if cfg.retrieval:
        lines.append(f"retrieval: {stored} tokens hot (sink + hot budget), {cold} in the cold store, "
                     "fetched back by query-key score when a question needs them")
    if gone > 0:
        lines.append(f"[yellow]{gone} of {n} tokens were evicted and are gone[/yellow]: the model no longer "
                     "sees them (StreamingLLM keeps the sink and the window); --kiv-hot-budget keeps evicted "
                     "tokens retrievable")
    if session.turns:
        t = session.turns[-1]
        lines.append(f"last turn ({t.index}, {t.rule}): {t.new_tokens} new tokens, prefill "
                     f"{t.prefill_tokens_per_s:.1f} tok/s; {t.generated} generated ({t.finish_reason}), decode "
                     f"{t.decode_tokens_per_s:.1f} tok/s")
    lines.append(f"conversation: {session.conversation.replies} turns, "
                 f"{len(session.conversation.transcript_ids())} tokens")
    return lines


def save(session, path: str) -> str:
    logits = session.flush()     # the last answer's final token goes into the cache first
    conv = session.conversation
    persist.save_prompt_cache(path, session.cache, session.loaded, conv.fed, logits)
    return f"saved {len(conv.fed)} tokens to {path}"


def command(session, line: str) -> bool:
    """A /command; False when the session should end."""
    name, _, arg = line.strip().partition(" ")
    if name in ("/quit", "/exit", "/bye"):
        return False
    if name == "/help":
        err.print(escape(HELP))
    elif name == "/reset":
        session.reset()
        err.print("[dim]conversation and cache reset[/dim]")
    elif name == "/stats":
        for ln in stats_lines(session):
            err.print(ln)
    elif name == "/save":
        if not arg.strip():
            c.fail("/save needs a file name: /save FILE")
        else:
            path = Path(arg.strip()).expanduser()
            try:
                c.check_writable(path, "/save")     # its folder, before the cache is written
                err.print(escape(save(session, str(path))))
            except typer.BadParameter as e:
                # what the user typed, not the temporary file the write goes through
                c.fail(f"/save {arg.strip()}: {e.message}")
            except (ValueError, OSError) as e:
                c.fail(str(e))
    else:
        c.fail(f"unknown command {name}; {HELP}")
    return True


@c.with_cache_options
def chat(
    cache_config: CacheConfig,
    model: c.ModelArg = None,
    weights: c.Weights = "auto",
    system: Annotated[Optional[str], typer.Option(
        "--system", help="A system prompt (the first message of the conversation).")] = None,
    no_chat_template: Annotated[bool, typer.Option(
        "--no-chat-template", help="Use the plain 'User: / Assistant:' turn format even where the model "
        "has a chat template.")] = False,
    tokens: Annotated[Optional[int], typer.Option(
        "--tokens", "-n", min=1, help=f"Most tokens per answer. Default {DEFAULT_CHAT_TOKENS}.",
        show_default=False)] = None,
    temperature: c.Temperature = None,
    top_p: c.TopP = None,
    top_k: c.TopK = None,
    seed: c.Seed = None,
    prefill_chunk: c.PrefillChunk = None,
    prefill_tail: c.PrefillTail = None,
    report_json: Annotated[Optional[Path], typer.Option(
        "--report-json", help="Write every turn's numbers (tokens fed, cache counters, speed) as JSON to this "
        "path when the chat ends.", dir_okay=False)] = None,
) -> None:
    """Chat with a model: the cache lives across turns, so each turn prefills only its new tokens.

    Answers stream on stdout; the prompt's notes, one line per turn and /stats on stderr. From a
    terminal: a prompt, \\ or \"\"\" for multi-line messages, Ctrl-C stops an answer (Ctrl-C at the
    prompt or Ctrl-D ends the chat). Otherwise one message per line from stdin. With
    --streaming-llm-window, retrieval or KIVI the conversation runs in bounded memory (what
    StreamingLLM evicts is gone; retrieval keeps it reachable). See docs/chat.md.
    """
    try:
        sample_config = SampleConfig(**{k: v for k, v in dict(
            max_tokens=tokens if tokens is not None else DEFAULT_CHAT_TOKENS, temperature=temperature,
            top_p=top_p, top_k=top_k, seed=seed, prefill_chunk=prefill_chunk,
            prefill_tail=prefill_tail).items() if v is not None})
    except ValueError as e:
        raise c.config_error(e) from None
    model = c.resolve_model(model)  # a bad MODEL fails before the heavy imports
    c.check_writable(report_json, "--report-json")
    interactive = sys.stdin.isatty()
    with c.guarded():
        loaded = c.load_model(model, weights)
        session = chat_session.ChatSession(loaded, cache_config, sample_config, system, not no_chat_template)
        fmt = "the model's chat template" if session.templated else "the plain 'User: / Assistant:' format"
        err.print(f"[bold]posttrainllm chat[/bold] · [cyan]{escape(loaded.name)}[/cyan] · cache "
                  f"[green]{escape(cache_config.label())}[/green] · {fmt}")
        if interactive:
            err.print("[dim]/help for commands; Ctrl-C stops an answer, Ctrl-D ends the chat[/dim]")
        try:
            converse(session, interactive)
        finally:
            if report_json is not None:
                c.write_atomic(report_json, json.dumps({
                    "turns": [t.as_dict() for t in session.turns],
                    "transcript_tokens": session.conversation.transcript_ids(),
                    "policy": cache_config.describe()}, indent=2) + "\n")
            session.close()


def converse(session, interactive: bool) -> None:
    for line in read_messages(interactive):
        if not line.strip():
            continue
        if line.lstrip().startswith("/") and not line.lstrip().startswith("//"):
            if not command(session, line):
                return
            continue
        message = line[1:] if line.lstrip().startswith("//") else line
        if not answer(session, message):
            return


def answer(session, message: str) -> bool:
    """One turn; False when a second Ctrl-C ended the session."""
    wrote = ""
    text = False   # any visible character in the answer
    try:
        with Interrupts() as ints:
            for piece in session.say(message, should_stop=lambda: ints.stop):
                c.write_stdout(piece)
                wrote = piece or wrote
                text = text or bool(piece.strip())
    except ContextLengthError as e:
        c.fail(str(e))
        return True
    except KeyboardInterrupt:
        c.write_stdout("\n")
        err.print("[yellow]interrupted[/yellow]")
        return False
    if wrote and not wrote.endswith("\n"):
        c.write_stdout("\n")
    elif not wrote:
        c.write_stdout("\n")
    err.print(turn_line(session.turns[-1]))
    if not text and session.turns[-1].finish_reason == "stop":
        err.print(empty_answer_note(session.templated))
    return True


def empty_answer_note(templated: bool) -> str:
    """Said on stderr when a turn ended with no visible text, so an empty answer is not taken
    for a hang or a crash."""
    if templated:
        return "[yellow]the model ended its turn without any text[/yellow]"
    return ("[yellow]the model ended its turn without any text: it has no chat template, so the turns "
            "are plain 'User: / Assistant:' text, which a pretrained (not instruction-tuned) model may "
            "not answer; `posttrainllm sample` continues a text instead[/yellow]")


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
