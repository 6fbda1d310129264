"""`posttrainllm train`: train a native TinyGPT and write a `.tinygpt` file (logic: tinygpt_mlx.train)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from tinygpt_mlx.config import ModelConfig, field_default
from tinygpt_mlx.lazy import lazy

from . import common as c

training = lazy("tinygpt_mlx.train")   # the training loop (and, through it, numpy and the data code)

PRECISIONS = ("bf16", "fp32")
#: ModelConfig's fields as `train` spells them, for its shape errors
SHAPE_FLAGS = {"vocab_size": "--vocab-size", "d_model": "--d-model", "n_layers": "--n-layers",
               "n_kv_heads": "--n-kv-heads", "n_heads": "--n-heads", "d_ff": "--d-ff", "context_length": "--seq-len",
               "head dimension": "the head dimension (--d-model / --n-heads)", "yoco": "--yoco"}


def _precision(value: str) -> str:
    if value not in PRECISIONS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(map(repr, PRECISIONS))}")
    return value


def check_shape(init_from: Optional[Path], **shape: int) -> None:
    """The model the shape flags describe, checked before any work (ModelConfig's own rules: every
    size >= 1, --d-model divisible by --n-heads into an even head dimension, --n-heads by
    --n-kv-heads), the error in the flags' names (it said `d_model 256 is not divisible by n_heads
    5`, or `d_model must be ...` after the tokenizer was trained). A warm start from a .tinygpt
    takes that model's shape, so its flags are not checked."""
    if init_from is not None and init_from.suffix == ".tinygpt":
        return
    try:
        ModelConfig(**shape)
    except ValueError as e:
        message = str(e)
        for field_name, flag in SHAPE_FLAGS.items():
            message = re.sub(rf"\b{field_name}\b", flag, message)
        raise typer.BadParameter(message) from None


def train(
    data: Path = typer.Option(Path("data/corpus"), "--data", help="Corpus: a text file or a directory of *.txt (scripts/fetch_corpus.sh)."),
    out: Path = typer.Option(..., "--out", help="Output model file, e.g. models/tinygpt-base.tinygpt."),
    heldout: Optional[Path] = typer.Option(None, "--heldout", help="Held-out text (default: the last 2% of --data)."),
    work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="Tokenizer, token cache, checkpoint and metrics (default: runs/<out stem>)."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Optimizer steps (or give --tokens)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", min=1, help="Training tokens (steps = tokens / (batch * seq-len))."),
    seq_len: int = typer.Option(field_default(ModelConfig, "context_length"), "--seq-len", min=1, help="Training context length (= the model's context_length)."),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Rows of --seq-len tokens per optimizer step."),
    lr: float = typer.Option(3e-3, "--lr", help="Peak learning rate (warmup, then cosine decay to 10%)."),
    warmup: Optional[int] = typer.Option(None, "--warmup", min=0, help="Warmup steps (default 5% of steps, at most 200)."),
    seed: int = typer.Option(0, "--seed", help="Seeds initialisation and every batch."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in the work dir."),
    stop_after: Optional[int] = typer.Option(None, "--stop-after", min=1, help="Stop with a checkpoint after this step (the schedule still ends at --steps)."),
    vocab_size: int = typer.Option(4096, "--vocab-size", help="Size of the BPE tokenizer trained on --data (an existing one in the work dir is reused)."),
    d_model: int = typer.Option(field_default(ModelConfig, "d_model"), "--d-model", help="Width of the model (embedding and residual stream)."),
    n_layers: int = typer.Option(field_default(ModelConfig, "n_layers"), "--n-layers", help="Transformer layers."),
    n_heads: int = typer.Option(field_default(ModelConfig, "n_heads"), "--n-heads", help="Query heads per layer (head dim = --d-model / --n-heads)."),
    n_kv_heads: int = typer.Option(field_default(ModelConfig, "n_kv_heads"), "--n-kv-heads", help="Key/value heads per layer (grouped-query attention; divides --n-heads)."),
    d_ff: int = typer.Option(field_default(ModelConfig, "d_ff"), "--d-ff", help="Hidden width of each layer's feed-forward block."),
    yoco: bool = typer.Option(False, "--yoco/--no-yoco", help="YOCO: upper layers share the middle layer's K/V."),
    needle_fraction: float = typer.Option(0.35, "--needle-fraction", help="Share of rows that are synthetic needle documents."),
    answer_weight: float = typer.Option(1.0, "--answer-weight", help="Loss weight of needle-answer tokens (others weigh 1)."),
    pack_fraction: float = typer.Option(0.0, "--pack-fraction", help="Share of needle rows packed with several short needle documents."),
    copy_fraction: float = typer.Option(0.0, "--copy-fraction", help="Share of rows that repeat a span of text or random tokens (dense copying signal that forms induction heads)."),
    copy_span: int = typer.Option(0, "--copy-span", help="Longest repeated span of the copy rows, in tokens (0: half the row; short spans repeat close together, which forms induction heads sooner)."),
    keyed_fraction: float = typer.Option(0.0, "--keyed-fraction", help="Share of rows with 2-6 keyed facts asked for one or all of them, or a phone book of look-alike entries (KIV's limits; `needle --task`)."),
    chat_fraction: float = typer.Option(0.0, "--chat-fraction", help="Share of rows that are plain-format conversations whose last question asks for a fact from an earlier user turn."),
    init_from: Optional[Path] = typer.Option(None, "--init-from", help="Warm start (fresh optimizer and schedule) from a training checkpoint.pt (same tokenizer: reuse its work dir's tokenizer.json) or a .tinygpt model (its shape and tokenizer are used; fine-tuning)."),
    eval_every: int = typer.Option(100, "--eval-every", min=1, help="Evaluate on the held-out text every this many steps (and at the end), appended to the work dir's metrics.jsonl."),
    ckpt_every: int = typer.Option(100, "--ckpt-every", min=1, help="Write the work dir's checkpoint every this many steps (and at the end; --resume continues from it)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: torch's choice)."),
    precision: str = typer.Option("bf16", "--precision", callback=_precision, help="bf16 (autocast, fp32 weights) or fp32."),
) -> None:
    """Train a TinyGPT (PyTorch on CPU, needs the `train` extra) and export it for MLX."""
    console = Console(stderr=True)
    check_shape(init_from, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                n_kv_heads=n_kv_heads, d_ff=d_ff, context_length=seq_len, yoco=yoco)
    with c.guarded():
        args = training.TrainArgs(
            data=str(data), out=str(out), heldout=str(heldout) if heldout else None,
            work_dir=str(work_dir) if work_dir else None, steps=steps, tokens=tokens,
            seq_len=seq_len, batch_size=batch_size, lr=lr, warmup=warmup, seed=seed, resume=resume, stop_after=stop_after,
            vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=n_kv_heads, d_ff=d_ff, yoco=yoco, needle_fraction=needle_fraction, answer_weight=answer_weight,
            pack_fraction=pack_fraction, copy_fraction=copy_fraction, copy_span=copy_span,
            keyed_fraction=keyed_fraction, chat_fraction=chat_fraction,
            init_from=str(init_from) if init_from else None,
            eval_every=eval_every, ckpt_every=ckpt_every, threads=threads, precision=precision)
        args.total_steps()
        training.run(args, console=console)


def register(app: typer.Typer) -> None:
    app.command("train")(train)


if __name__ == "__main__":  # python -m tinygpt_mlx.cli.train ...
    typer.run(train)
