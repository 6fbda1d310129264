"""`load(path)`: a native `.tinygpt` file or an mlx-lm / Hugging Face model directory, offline,
returned as the same `LoadedModel` either way.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from mlx_lm.utils import load as mlx_load

from . import attention
from . import format as tinygpt_format
from .errors import ModelFormatError
from .model import count_parameters
from .tokenizer import Tokenizer

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
DEFAULT_MODEL_NAME = "tinygpt-base.tinygpt"


@dataclass
class LoadedModel:
    """A model ready for sampling, whatever its kind.

    model           the MLX module (`model(tokens, cache=...)` gives logits)
    tokenizer       `Tokenizer`: encode / decode / eos_ids, for both kinds
    kind            "tinygpt" (a native `.tinygpt` file) or "mlx-lm" (a model directory)
    context_length  the trained context, or None if the model does not say
    info            config, parameter count, file size; for native files also `training`
                    (the extra metadata) and `checksum` (see `checksum_state`)

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

    @property
    def name(self) -> str:
        return self.path.stem if self.kind == "tinygpt" else self.path.name

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
            return "not applicable (mlx-lm model directory)"
        c = self.info.get("checksum")
        return f"verified {c['algorithm']} {c['tensors'][:16]}…" if c else "none (saved before checksums existed)"


def default_model_path() -> Path:
    """The shipped default model; a clear error when none is shipped."""
    path = MODELS_DIR / DEFAULT_MODEL_NAME
    if not path.exists():
        raise ModelFormatError(f"no default model shipped yet ({path} is missing); pass MODEL explicitly")
    return path


def load(path: Union[str, Path, None] = None) -> LoadedModel:
    """Load a model for sampling; `None` means the shipped default."""
    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file or directory")
    loaded = _load_mlx_lm(path) if path.is_dir() else _load_native(path)
    loaded.routing = attention.install(loaded.model)
    return loaded


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
        model, wrapper = mlx_load(str(path))
    except (FileNotFoundError, ValueError, KeyError, OSError) as e:
        raise ModelFormatError(f"{path}: cannot load with mlx-lm ({str(e).splitlines()[0]})") from None
    ctx = config.get("max_position_embeddings") or config.get("n_positions")
    info = {"config": config, "parameters": count_parameters(model),
            "model_type": config.get("model_type"),
            "file_bytes": sum(p.stat().st_size for p in path.glob("*.safetensors"))}
    return LoadedModel(model, Tokenizer(wrapper=wrapper), "mlx-lm", path, ctx, info)
