"""`load(model)`: a native `.tinygpt` file, a GGUF file, an mlx-lm / Hugging Face model directory,
an ollama model name or a Hugging Face repo id (`resolve.py` says which), returned as the same
`LoadedModel` whatever it was. GGUF files run through mlx-lm's own model classes (`ggml/`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from . import attention
from . import format as tinygpt_format
from .errors import ModelFormatError
from .ggml.load import load_gguf_model, resolve_weights_mode
from .ggml.tokenizer import tokenizer_from_metadata
from .lazy import lazy
from .model import count_parameters
from .resolve import DEFAULT_MODEL_NAME, MODELS_DIR, Resolved, default_model_path, resolve  # noqa: F401
from .tokenizer import Tokenizer

mlx_utils = lazy("mlx_lm.utils")   # mlx-lm and GGUF models only: its package imports transformers (and torch)


@dataclass
class LoadedModel:
    """A model ready for sampling, whatever its kind.

    model           the MLX module (`model(tokens, cache=...)` gives logits)
    tokenizer       `Tokenizer`: encode / decode / eos_ids, for both kinds
    kind            "tinygpt" (a native `.tinygpt` file) or "mlx-lm" (mlx-lm model code: a model
                    directory, or a GGUF file loaded into mlx-lm's classes)
    context_length  the trained context, or None if the model does not say
    info            config, parameter count, file size; for native files also `training`
                    (the extra metadata) and `checksum` (see `checksum_state`); for GGUF files
                    `format`, `architecture`, `weights` and `tensor_types` (how each is held)
    resolved        what MODEL resolved to: format, source (file / ollama / huggingface /
                    default), name and where it was found

    routing         the routing of its attention through ours (`attention.install`, done
                    by `load`): `close()` or leaving a `with` block undoes it

    Generate with `tinygpt_mlx.generate_text(loaded, prompt, ...)` for either kind.
    """
    model: Any
    tokenizer: Tokenizer
    kind: str                     # "tinygpt" or "mlx-lm"
    path: Path
    context_length: Optional[int]
    info: dict = field(default_factory=dict)
    routing: Optional[attention.Routing] = None
    resolved: Optional[Resolved] = None

    @property
    def name(self) -> str:
        if self.resolved is not None:
            return self.resolved.name
        return self.path.stem if self.kind == "tinygpt" else self.path.name

    @property
    def format(self) -> str:
        """"tinygpt", "gguf" or "mlx-lm" (a model directory)."""
        return self.info.get("format", self.kind)

    def close(self) -> None:
        """Restore the model modules' own attention (other loaded models keep theirs routed)."""
        if self.routing is not None:
            self.routing.close()

    def __enter__(self) -> "LoadedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def mlx_tokenizer(self) -> Any:
        """mlx-lm's `TokenizerWrapper`, for calling mlx-lm's own functions
        (`mlx_lm.generate(loaded.model, loaded.mlx_tokenizer, ...)`). Only mlx-lm model
        directories have one: for a native `.tinygpt` model this raises `AttributeError`
        (use `tinygpt_mlx.generate_text`, which works for both kinds)."""
        wrapper = self.tokenizer._wrapper
        if wrapper is None:
            raise AttributeError(f"{self.path}: a native .tinygpt model has no mlx-lm tokenizer; "
                                 "use tinygpt_mlx.generate_text(loaded, prompt) instead")
        return wrapper

    @property
    def checksum_state(self) -> str:
        """One line for `info`: 'verified sha256 …', 'none (saved before checksums existed)',
        or 'not applicable (mlx-lm model directory)'."""
        if self.kind != "tinygpt":
            return f"not applicable ({'GGUF file' if self.format == 'gguf' else 'mlx-lm model directory'})"
        c = self.info.get("checksum")
        return f"verified {c['algorithm']} {c['tensors'][:16]}…" if c else "none (saved before checksums existed)"


def load(model: Union[str, Path, Resolved, None] = None, weights: str = "auto") -> LoadedModel:
    """Load a model for sampling; `None` means the shipped default.

    `model` is a path (`.tinygpt`, `.gguf`, model directory), an ollama name or a Hugging Face
    repo id. `weights` says how a GGUF's block-quantised tensors are held: auto, packed or dense
    (`tinygpt_mlx.ggml.load`); other formats ignore it.
    """
    resolve_weights_mode(weights)     # a bad mode fails before anything is read
    resolved = model if isinstance(model, Resolved) else resolve(model)
    path = resolved.path
    if resolved.format == "gguf":
        loaded = _load_gguf(path, weights)
    elif resolved.format == "mlx-lm":
        loaded = _load_mlx_lm(path)
    else:
        loaded = _load_native(path)
    loaded.resolved = resolved
    loaded.routing = attention.install(loaded.model)
    return loaded


def _load_gguf(path: Path, weights: str) -> LoadedModel:
    # the tokenizer is built before the weights are dequantised: building Gemma 3's (262,144
    # tokens) takes ~400 MB for a while, which the float32 weights then reuse (docs/gguf.md, "Memory")
    built: list = []
    model, config, info, metadata = load_gguf_model(
        path, weights, before_tensors=lambda md: built.append(tokenizer_from_metadata(md, str(path), path)))
    wrapper = built[0]
    info.update({"config": config, "parameters": mlx_utils.get_total_parameters(model),
                 "file_bytes": path.stat().st_size})
    return LoadedModel(model, Tokenizer(wrapper=wrapper), "mlx-lm", path,
                       config.get("max_position_embeddings"), info)


def _load_native(path: Path) -> LoadedModel:
    loaded_file = tinygpt_format.load_file(path)   # verifies the checksum when the file has one
    model, tok_json, extra = loaded_file.model, loaded_file.tokenizer_json, loaded_file.extra
    try:
        tokenizer = Tokenizer.from_json(tok_json)
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise ModelFormatError(f"{path}: invalid tokenizer ({str(e).splitlines()[0]})") from None
    cfg = model.config
    info = {"config": cfg.to_dict(), "parameters": count_parameters(model),
            "file_bytes": path.stat().st_size, "training": extra,
            "checksum": dataclasses.asdict(loaded_file.checksum) if loaded_file.checksum else None}
    return LoadedModel(model, tokenizer, "tinygpt", path, cfg.context_length, info)


def _load_mlx_lm(path: Path) -> LoadedModel:
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelFormatError(f"{path}: not a model directory (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path}/config.json: invalid JSON ({e})") from None
    if not list(path.glob("*.safetensors")):
        raise ModelFormatError(f"{path}: no *.safetensors weights")
    try:
        model, wrapper = mlx_utils.load(str(path))
    except (FileNotFoundError, ValueError, KeyError, OSError) as e:
        raise ModelFormatError(f"{path}: cannot load with mlx-lm ({str(e).splitlines()[0]})") from None
    ctx = config.get("max_position_embeddings") or config.get("n_positions")
    info = {"config": config, "parameters": count_parameters(model),
            "model_type": config.get("model_type"),
            "file_bytes": sum(p.stat().st_size for p in path.glob("*.safetensors"))}
    return LoadedModel(model, Tokenizer(wrapper=wrapper), "mlx-lm", path, ctx, info)
