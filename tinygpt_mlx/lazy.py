"""Modules imported on first use, declared at the top of the module that needs them.

The CLI's command modules declare the library modules they call at the top, beside their
ordinary imports (`generate = lazy("tinygpt_mlx.generate")`), and call through them
(`generate.stream_generate(...)`). The module is imported (importlib) at the first attribute
read, so `posttrainllm --help`, a typo or a bad flag answer without mlx-lm's seconds of
start-up (its package imports transformers, and torch where installed), while every dependency
of a module still reads at its top: no import inside a function body. The package's own
exported names are lazy the same way (PEP 562, tinygpt_mlx/__init__.py). Each declaration is
checked to import in tests/test_cli_imports.py.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LazyModule", "lazy"]


class LazyModule:
    """A module by name, imported at the first attribute read (then as `import` gives it)."""

    __slots__ = ("module_name",)

    def __init__(self, module_name: str):
        self.module_name = module_name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.module_name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self.module_name!r}>"


def lazy(module_name: str) -> LazyModule:
    """`module_name` (absolute), imported when first used."""
    return LazyModule(module_name)
