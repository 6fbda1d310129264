"""The training loop: data preparation, AdamW + warmup/cosine, clipping, held-out loss,
checkpoint/resume, a rich progress bar and export to `.tinygpt`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from .. import corpus
from ..config import ModelConfig, field_default
from ..lazy import lazy
from . import data as data_mod
from .tokenizer import encode_batch, train_tokenizer
from .torch_model import build_model, require_torch, to_mlx

# the MLX model file (mlx-lm's model code): only when a model file is read or written
fmt = lazy("tinygpt_mlx.format")


@dataclass
class TrainArgs:
    data: str
    out: str
    heldout: Optional[str] = None       # None: hold out the last 2% of --data
    work_dir: Optional[str] = None      # None: runs/<out stem>
    steps: Optional[int] = None         # either steps or tokens
    tokens: Optional[int] = None
    seq_len: int = field_default(ModelConfig, "context_length")
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: Optional[int] = None        # None: 5% of the steps, at most 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    resume: bool = False
    vocab_size: int = 4096             # the tokenizer's size (ModelConfig has no default)
    # the model shape: ModelConfig's defaults are the one source
    d_model: int = field_default(ModelConfig, "d_model")
    n_layers: int = field_default(ModelConfig, "n_layers")
    n_heads: int = field_default(ModelConfig, "n_heads")
    n_kv_heads: int = field_default(ModelConfig, "n_kv_heads")
    d_ff: int = field_default(ModelConfig, "d_ff")
    yoco: bool = field_default(ModelConfig, "yoco")
    rope_theta: float = field_default(ModelConfig, "rope_theta")
    needle_fraction: float = 0.3
    answer_weight: float = 1.0          # loss weight of needle-answer targets (others weigh 1)
    pack_fraction: float = 0.0          # share of needle rows packed with several short documents
    copy_fraction: float = 0.0          # share of rows that repeat a span (induction signal)
    copy_span: int = 0                  # longest repeated span (0: half the row)
    keyed_fraction: float = 0.0         # share of rows with several keyed facts or a phone book
    chat_fraction: float = 0.0          # share of rows that are conversations asking for a fact
    init_from: Optional[str] = None     # warm start: a checkpoint.pt or a .tinygpt (fresh optimizer)
    eval_every: int = 200
    eval_windows: int = 32
    ckpt_every: int = 200
    threads: Optional[int] = None
    precision: str = "bf16"             # "bf16": bfloat16 autocast (fp32 weights), or "fp32"
    log_every: int = 50
    stop_after: Optional[int] = None    # stop (with a checkpoint) after this step, schedule unchanged
    extra: dict = field(default_factory=dict)

    def total_steps(self) -> int:
        if self.steps:
            return self.steps
        if self.tokens:
            return max(1, math.ceil(self.tokens / (self.batch_size * self.seq_len)))
        raise ValueError("give --steps or --tokens")

    def model_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=self.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
                           n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, d_ff=self.d_ff,
                           context_length=self.seq_len, rope_theta=self.rope_theta, yoco=self.yoco)


def lr_at(step: int, total: int, warmup: int, lr: float, min_ratio: float) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_ratio` at `total`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _console():
    from rich.console import Console  # noqa: PLC0415
    return Console(stderr=True)


def prepare_data(args: TrainArgs, work: Path, log) -> dict:
    """Tokenizer + token arrays, cached in the work directory (reused on resume)."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    train_docs = corpus.load_documents(args.data)
    if args.heldout:
        heldout_text = corpus.load_text(args.heldout)
    else:
        split = [corpus.split_heldout(d) for d in train_docs]
        train_docs = [s[0] for s in split]
        heldout_text = "".join(s[1] for s in split)
    train_text = "\n".join(train_docs)
    tok_path = work / "tokenizer.json"
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    else:
        t0 = time.time()
        paragraphs = [p for p in train_text.split("\n\n") if p.strip()]
        tok = train_tokenizer(paragraphs, vocab_size=args.vocab_size)
        tok.save(str(tok_path))
        log(f"tokenizer: {tok.get_vocab_size()} tokens trained in {time.time() - t0:.1f}s")
    eot = tok.token_to_id(corpus.EOT)
    tr_path, ho_path = work / "train_tokens.npy", work / "heldout_tokens.npy"
    if tr_path.exists() and ho_path.exists():
        train_tokens, heldout_tokens = np.load(tr_path), np.load(ho_path)
    else:
        t0 = time.time()
        ids: list[int] = []
        for doc in train_docs:
            chunks = [c + "\n\n" for c in doc.split("\n\n")]
            for c in encode_batch(tok, chunks):
                ids.extend(c)
            ids.append(eot)
        dtype = np.uint16 if tok.get_vocab_size() < 65536 else np.uint32
        train_tokens = np.asarray(ids, dtype=dtype)
        heldout_tokens = np.asarray(
            [i for c in encode_batch(tok, [c + "\n\n" for c in heldout_text.split("\n\n")]) for i in c],
            dtype=dtype)
        np.save(tr_path, train_tokens)
        np.save(ho_path, heldout_tokens)
        log(f"corpus: {len(train_tokens):,} train / {len(heldout_tokens):,} held-out tokens "
            f"({len(train_text) / max(1, len(train_tokens)):.2f} chars/token), {time.time() - t0:.1f}s")
    encode = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    return {"tok": tok, "train_tokens": train_tokens, "heldout_tokens": heldout_tokens,
            "heldout_text": heldout_text, "train_text": train_text, "encode": encode, "eot": eot}


def evaluate(model, torch, windows: np.ndarray, needle_rows, needle_spans, batch: int = 8) -> dict:
    """Held-out loss (nats/token) and teacher-forced pass-key accuracy (all digits argmax)."""
    F = torch.nn.functional
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(windows[i:i + batch])
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                   reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
    acc = needle_accuracy(model, torch, needle_rows, needle_spans, batch)
    model.train()
    loss = total / count
    return {"heldout_loss": loss, "heldout_ppl": math.exp(loss), "needle_acc": acc}


def needle_accuracy(model, torch, needle_rows, needle_spans, batch: int = 8) -> Optional[float]:
    """Teacher-forced pass-key accuracy: the share of documents whose answer tokens are all
    the argmax (None without documents)."""
    if not len(needle_rows):
        return None
    correct = 0
    with torch.no_grad():
        for i in range(0, len(needle_rows), batch):
            x = torch.from_numpy(needle_rows[i:i + batch])
            pred = model(x[:, :-1]).argmax(-1)
            for j, (a, b) in enumerate(needle_spans[i:i + batch]):
                correct += bool((pred[j, a - 1:b - 1] == x[j, a:b]).all())
    return correct / len(needle_rows)


def init_weights(model, path: str, torch) -> None:
    """Copy the weights of a training checkpoint or a `.tinygpt` model into `model` (same
    shape). Parameters the model lacks are dropped (a YOCO model has no K/V projections in its
    shared layers); a parameter the checkpoint lacks or of another shape is an error."""
    if is_model_file(path):
        from mlx.utils import tree_flatten  # noqa: PLC0415

        state = {k: torch.from_numpy(np.array(v, dtype=np.float32))
                 for k, v in tree_flatten(fmt.load_file(path).model.parameters())}
    else:
        state = torch.load(path, map_location="cpu", weights_only=False)
        state = state.get("model", state)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    extra = [k for k in state if k not in own and not k.endswith(("k_proj.weight", "v_proj.weight"))]
    if missing or wrong or extra:
        raise ValueError(f"--init-from {path}: does not fit this model "
                         f"(missing {missing[:3]}, other shape {wrong[:3]}, unused {extra[:3]})")
    model.load_state_dict({k: state[k] for k in own})


def is_model_file(path: str) -> bool:
    return str(path).endswith(".tinygpt")


def adopt_model_file(args: "TrainArgs", work: Path) -> "TrainArgs":
    """Fine-tuning a `.tinygpt`: its shape replaces the shape arguments and its tokenizer is
    the work directory's (written there; a different tokenizer already there is an error,
    since the cached token arrays were made with it)."""
    f = fmt.load_file(args.init_from)
    tok_path = work / "tokenizer.json"
    if tok_path.exists() and tok_path.read_text(encoding="utf-8") != f.tokenizer_json:
        raise ValueError(f"--init-from {args.init_from}: {tok_path} holds another tokenizer "
                         "(use a fresh --work-dir)")
    if not tok_path.exists():
        work.mkdir(parents=True, exist_ok=True)
        tmp = tok_path.with_suffix(".tmp")
        tmp.write_text(f.tokenizer_json, encoding="utf-8")
        os.replace(tmp, tok_path)
    cfg = f.model.config
    return dataclasses.replace(args, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                               n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff, yoco=cfg.yoco,
                               rope_theta=cfg.rope_theta, seq_len=cfg.context_length,
                               vocab_size=cfg.vocab_size)


def _save_checkpoint(path: Path, state: dict, torch) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def run(args: TrainArgs, console=None) -> dict:
    """Train (or resume) and export `args.out`. Returns the final metrics."""
    torch = require_torch()
    console = console or _console()
    log = console.log
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else Path("runs") / out.stem
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / "checkpoint.pt"
    if args.precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be bf16 or fp32, got {args.precision!r}")
    total = args.total_steps()
    shares = (args.needle_fraction, args.copy_fraction, args.keyed_fraction, args.chat_fraction)
    if min(shares) < 0 or sum(shares) > 1:
        raise ValueError("--needle-fraction, --copy-fraction, --keyed-fraction and --chat-fraction "
                         f"must be >= 0 and sum to at most 1, got {' + '.join(map(str, shares))}")
    if args.init_from and not args.resume and not Path(args.init_from).exists():
        raise FileNotFoundError(f"--init-from: no checkpoint at {args.init_from}")
    if args.init_from and not args.resume and is_model_file(args.init_from):
        args = adopt_model_file(args, work)
        total = args.total_steps()
    warmup = args.warmup if args.warmup is not None else max(1, min(200, total // 20))

    resumed = None
    if args.resume:
        if not ckpt_path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
        resumed = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        saved = resumed["args"]
        # The model/data shape comes from the checkpoint; only the schedule may be extended.
        keep = {k: saved[k] for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                      "d_ff", "yoco", "rope_theta", "seq_len", "seed", "batch_size")}
        args = dataclasses.replace(args, **keep)

    d = prepare_data(args, work, log)
    tok = d["tok"]
    args = dataclasses.replace(args, vocab_size=tok.get_vocab_size())
    cfg = args.model_config()
    torch.manual_seed(args.seed)
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step, tokens_seen, elapsed, history, segments = 0, 0, 0.0, [], []
    if resumed is not None:
        model.load_state_dict(resumed["model"])
        opt.load_state_dict(resumed["optimizer"])
        step, tokens_seen = resumed["step"], resumed["tokens_seen"]
        elapsed, history = resumed["elapsed"], resumed["history"]
        segments = resumed.get("segments", [])
        log(f"resumed from {ckpt_path} at step {step}")
    elif args.init_from:
        init_weights(model, args.init_from, torch)
        log(f"initialised from the weights of {args.init_from}")
    # Every (re)start with its settings: a resumed run may change the schedule or the data mix.
    segments.append({"from_step": step, "steps": total, "needle_fraction": args.needle_fraction,
                     "answer_weight": args.answer_weight, "pack_fraction": args.pack_fraction,
                     "copy_fraction": args.copy_fraction, "copy_span": args.copy_span,
                     "keyed_fraction": args.keyed_fraction, "chat_fraction": args.chat_fraction,
                     "init_from": args.init_from,
                     "threads": args.threads,
                     "precision": args.precision, "lr": args.lr})

    train_data = data_mod.TrainData(d["train_tokens"], d["train_text"], d["encode"], d["eot"])
    windows = data_mod.eval_windows(d["heldout_tokens"], args.seq_len, args.eval_windows)
    needle_rows, needle_spans = data_mod.needle_eval_rows(
        d["heldout_text"], d["encode"], args.seq_len, 16)
    unigram = data_mod.unigram_loss(d["train_tokens"], windows[:, 1:].reshape(-1), cfg.vocab_size)
    log(f"model: {n_params:,} parameters ({cfg.n_layers} layers, d={cfg.d_model}, "
        f"{cfg.n_heads}/{cfg.n_kv_heads} heads, yoco={cfg.yoco}); {total} steps x "
        f"{args.batch_size} x {args.seq_len} tokens; torch threads {torch.get_num_threads()}, "
        f"{args.precision}; "
        f"unigram held-out loss {unigram:.3f}")

    def checkpoint():
        _save_checkpoint(ckpt_path, {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "tokens_seen": tokens_seen, "elapsed": elapsed, "history": history, "segments": segments,
            "args": dataclasses.asdict(args), "config": cfg.to_dict()}, torch)

    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,  # noqa: PLC0415
                               TimeElapsedColumn, TimeRemainingColumn)
    F = torch.nn.functional
    model.train()
    loss_ema = None
    metrics: dict = history[-1] if history else {}
    with Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task("train", total=total, completed=step, loss="-", tps="-")
        t_last, tok_last = time.time(), 0
        while step < (min(total, args.stop_after) if args.stop_after else total):
            lr = lr_at(step, total, warmup, args.lr, args.min_lr_ratio)
            for g in opt.param_groups:
                g["lr"] = lr
            t0 = time.time()
            rows, weights = train_data.batch(args.seed, step, args.batch_size, args.seq_len,
                                             args.needle_fraction, args.answer_weight,
                                             args.pack_fraction, args.copy_fraction,
                                             cfg.vocab_size, args.copy_span,
                                             args.keyed_fraction, args.chat_fraction)
            batch, w = torch.from_numpy(rows), torch.from_numpy(weights).reshape(-1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                logits = model(batch[:, :-1])
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                 reduction="none")
            loss = (ce * w).sum() / w.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            step += 1
            n_tok = args.batch_size * args.seq_len
            tokens_seen += n_tok
            tok_last += n_tok
            elapsed += time.time() - t0
            lv = loss.item()
            loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
            now = time.time()
            tps = tok_last / max(1e-9, now - t_last)
            progress.update(task, completed=step, loss=f"{loss_ema:.3f}", tps=f"{tps:,.0f}")
            if step % args.log_every == 0 or step == total:
                if not console.is_terminal:
                    log(f"step {step}/{total} loss {loss_ema:.4f} lr {lr:.2e} gnorm {float(gnorm):.2f} "
                        f"{tps:,.0f} tok/s tokens {tokens_seen:,} elapsed {elapsed / 60:.1f} min")
                t_last, tok_last = now, 0
            if step % args.eval_every == 0 or step == total:
                metrics = evaluate(model, torch, windows, needle_rows, needle_spans)
                metrics.update(step=step, train_loss=loss_ema, tokens=tokens_seen, elapsed=elapsed)
                history.append(metrics)
                log(f"eval step {step}: held-out loss {metrics['heldout_loss']:.4f} "
                    f"(ppl {metrics['heldout_ppl']:.1f}, unigram {math.exp(unigram):.1f}), "
                    f"pass-key (teacher-forced) {metrics['needle_acc'] if metrics['needle_acc'] is None else format(metrics['needle_acc'], '.0%')}")
                with open(work / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(metrics) + "\n")
            if step % args.ckpt_every == 0 or step == total or step == args.stop_after:
                checkpoint()
    if step < total:
        log(f"stopped at step {step}/{total}; continue with --resume")
        return {"steps": step, "stopped": True}

    mlx_model = to_mlx(model)
    extra = {
        "trained_with": f"torch {torch.__version__} (CPU), tinygpt_mlx.train",
        "corpus": str(args.data), "heldout": str(args.heldout or "last 2% of --data"),
        "steps": step, "tokens_trained": tokens_seen, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "lr": args.lr, "precision": args.precision, "seed": args.seed,
        "needle_fraction": args.needle_fraction, "parameters": n_params,
        "wall_time_s": round(elapsed, 1), "tokens_per_s": round(tokens_seen / max(elapsed, 1e-9), 1),
        "heldout_loss": metrics.get("heldout_loss"), "heldout_ppl": metrics.get("heldout_ppl"),
        "unigram_heldout_loss": unigram, "unigram_heldout_ppl": math.exp(unigram),
        "needle_acc_teacher_forced": metrics.get("needle_acc"), "answer_weight": args.answer_weight,
        "segments": segments, **args.extra,
    }
    fmt.save(out, mlx_model, tok.to_str(), extra=extra)
    log(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return extra


def main_args_from_cli(**kwargs) -> TrainArgs:
    return TrainArgs(**kwargs)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: posttrainllm train --help")
