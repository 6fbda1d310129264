"""The environment switches (`POSTTRAINLLM_*`), read in one place and checked at start-up.

On/off switches take 1, true, yes, on (on) or 0, false, no, off (off), any case, spaces around
ignored; unset or empty is the switch's default. Anything else is refused: `flag` raises
`SwitchError` naming the variable and the value (a program using the library sees it where the
switch is read: a new cache, the first packed matmul, a rank's guard, and the import of
tinygpt_mlx.cache on an x86 machine with g++, where POSTTRAINLLM_NO_FAST_EXP is read), and
`posttrainllm` checks every switch before any work (`problem`, cli/main.py), one `error:` line and exit code 2.

| variable | default | what it turns on |
|---|---|---|
| POSTTRAINLLM_COMPILE | on | compiled decode steps (cache/compiled.py) |
| POSTTRAINLLM_STAGE_SPILLS | off | a spilled cold store's decode step staged ahead (cache/spill_stage.py) |
| POSTTRAINLLM_NO_BLAS_PRELOAD | off | no re-execution with OpenBLAS preloaded (blas.py) |
| POSTTRAINLLM_NO_HEAP_TUNE | off | glibc's heap left as it is (heap.py) |
| POSTTRAINLLM_NO_FAST_EXP | off | MLX's softmax instead of the compiled one (cache/cpu_softmax.py) |
| POSTTRAINLLM_NO_TOKENIZER_CACHE | off | a GGUF's tokenizer converted at every start, none kept on disk (ggml/tokenizer_cache.py) |

Two more are checked at start-up: POSTTRAINLLM_QMATMUL (`QMATMUL_PATHS`, quant.py) and
POSTTRAINLLM_RANK_TIMEOUT (a positive number of seconds, unset or empty: 300;
`rank_timeout`, read by distributed.py).
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")

#: on/off switches and their defaults (module doc)
FLAGS = {"POSTTRAINLLM_COMPILE": True, "POSTTRAINLLM_STAGE_SPILLS": False,
         "POSTTRAINLLM_NO_BLAS_PRELOAD": False, "POSTTRAINLLM_NO_HEAP_TUNE": False,
         "POSTTRAINLLM_NO_FAST_EXP": False, "POSTTRAINLLM_NO_TOKENIZER_CACHE": False}
QMATMUL = "POSTTRAINLLM_QMATMUL"
#: the packed matmul's paths (quant.matmul_path)
QMATMUL_PATHS = ("packed", "dequantise")
RANK_TIMEOUT = "POSTTRAINLLM_RANK_TIMEOUT"


class SwitchError(ValueError):
    """An environment switch set to a value it does not take (one line)."""


def flag(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """The on/off switch `name` (one of FLAGS): its default when unset or empty."""
    value = environ.get(name)
    word = (value or "").strip().lower()
    if not word:
        return FLAGS[name]
    if word in ON:
        return True
    if word in OFF:
        return False
    raise SwitchError(f"{name}={value!r}: must be one of {', '.join(ON)} (on) or {', '.join(OFF)} (off)")


def problem(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The first switch of the environment set to a value it does not take, as one line; None
    where all are fine (or unset)."""
    for name in FLAGS:
        try:
            flag(name, environ)
        except SwitchError as e:
            return str(e)
    path = environ.get(QMATMUL)
    if path and path not in QMATMUL_PATHS:
        return f"{QMATMUL}={path!r}: must be one of {', '.join(QMATMUL_PATHS)}"
    try:
        rank_timeout(environ)
    except SwitchError as e:
        return str(e)
    return None


def rank_timeout(environ: Mapping[str, str] = os.environ, default: float = 300.0) -> float:
    """POSTTRAINLLM_RANK_TIMEOUT in seconds (distributed.Guard): `default` when unset or empty,
    as every switch; any value but a positive number a SwitchError naming it."""
    value = environ.get(RANK_TIMEOUT)
    if value is None or not value.strip():
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise SwitchError(f"{RANK_TIMEOUT}={value!r}: must be a positive number of seconds")
    return seconds
