"""`posttrainllm info`: what a model file holds."""

from __future__ import annotations

import json

import typer

from . import common as c


def info(model: c.ModelArg = None,
    weights: c.Weights = "auto",
         as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text.")) -> None:
    """Show what MODEL resolved to (file, ollama name, Hugging Face id) and from where, its format and
    architecture, each GGUF tensor type and how it is held, parameters, tokenizer, file size and
    checksum state."""

    with c.guarded():
        loaded = c.load_model(model, weights, compute=False)
        out = {"path": str(loaded.path), "kind": loaded.kind, "parameters": loaded.info["parameters"],
               "context_length": loaded.context_length, "tokenizer": loaded.tokenizer.kind,
               "vocab_size": loaded.tokenizer.vocab_size, "file_bytes": loaded.info["file_bytes"],
               "checksum": loaded.checksum_state, "config": loaded.info["config"]}
        r = loaded.resolved
        out.update({"format": loaded.format, "source": r.source, "name": r.name, "found": r.origin})
        for key in ("architecture", "model_type", "weights", "weights_note", "tensor_types", "gguf_name"):
            if key in loaded.info:
                out[key] = loaded.info[key]
        if loaded.info.get("checksum"):
            out["checksum_digests"] = loaded.info["checksum"]
        if loaded.info.get("training"):
            out["training"] = loaded.info["training"]
        if as_json:
            print(json.dumps(out, indent=2))
            return
        for k in ("name", "path", "format", "source", "found", "kind", "architecture", "parameters",
                  "context_length", "tokenizer", "vocab_size", "weights", "weights_note"):
            if k in out:
                print(f"{k:15} {out[k]}")
        for t, held in out.get("tensor_types", {}).items():
            print(f"{'tensors ' + t:15} {held['count']} tensors, held {held['held']}")
        print(f"{'file size':15} {c.fmt_bytes(out['file_bytes'])}")
        print(f"{'checksum':15} {out['checksum']}")
        print("config")
        for k, v in out["config"].items():
            if not isinstance(v, (dict, list)):
                print(f"  {k:22} {v}")


def register(app: typer.Typer) -> None:
    app.command("info")(info)
