"""Structure metrics of the package, as issue #30 states its targets (docs/architecture.md).

    python scripts/structure.py [--json FILE] [--package tinygpt_mlx]

Lengths are reported for the record, never a target (code splits where responsibilities part,
not to fit a number: issue #54). For cache/: classes over 200 lines, reads of another object's private
attribute (`x._name` where x is not `self`/`cls`), and probes of which store a layer holds
(`isinstance(..., <Store class>)`, `getattr(<store>, ...)`, `sink_store is None`); for the whole
package: modules over 450 lines, function-level imports of the package's own modules (an
import statement or a `lazy(...)` declaration inside a function) and reads of a private name of
another of its modules (`batch._EVENED`, where `batch` is a package module), and, for the record, the
modules declared at a module's top to load on first use (`lazy_modules`, tinygpt_mlx/lazy.py);
for the
measurement code and the tools beside the package (benchmarks/, scripts/): edits of `sys.path`
and imports of the test suite's modules (`tests`, `tests.NAME`: they import the installed package,
and each other as `benchmarks.NAME`).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORES = {"DenseStore", "RingStore", "KiviStore", "ColdStore", "ShadowStore"}
#: folders of code that runs beside the package, checked for `sys.path` edits
BESIDE = ("benchmarks", "scripts")


def _private_reads(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            out.append(f"{ast.unparse(node)} (line {node.lineno})")
    return out


def _store_probes(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            if any(isinstance(n, ast.Name) and n.id in STORES for n in ast.walk(node.args[1])):
                out.append(f"{ast.unparse(node)} (line {node.lineno})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            target = ast.unparse(node.args[0])
            if any(s in target for s in ("body", "sink_store", ".cold")):     # a layer's stores
                out.append(f"{ast.unparse(node)} (line {node.lineno})")
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            if "sink_store" in ast.unparse(node.left):
                out.append(f"{ast.unparse(node)} (line {node.lineno})")
    return out


def _local_imports(tree: ast.AST, package: str) -> list[str]:
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(package)):
                out.append(f"{fn.name}: from {'.' * node.level}{node.module or ''} (line {node.lineno})")
            elif isinstance(node, ast.Import) and any(a.name.startswith(package) for a in node.names):
                out.append(f"{fn.name}: import {', '.join(a.name for a in node.names)} (line {node.lineno})")
            elif _lazy_name(node, package):
                out.append(f"{fn.name}: lazy({_lazy_name(node, package)!r}) (line {node.lineno})")
    return out


def _lazy_name(node: ast.AST, package: str) -> str:
    """The package module a `lazy("...")` call names ('' for any other node)."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "lazy" and node.args
            and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith(package)):
        return str(node.args[0].value)
    return ""


def _lazy_modules(tree: ast.Module, package: str) -> list[str]:
    """Module-level `NAME = lazy("package.module")` declarations."""
    return [f"{ast.unparse(node.targets[0])} = {_lazy_name(node.value, package)} (line {node.lineno})"
            for node in tree.body if isinstance(node, ast.Assign) and _lazy_name(node.value, package)]


def _module_names(tree: ast.Module, path: Path, package: str) -> set[str]:
    """The names a module binds at its top to modules of the package (`from . import batch`,
    `from tinygpt_mlx.cache import kivi as k`, `import tinygpt_mlx.quant as quant`,
    `m = lazy("tinygpt_mlx.cache")`): a name imported `from` a package module counts where it is
    itself a module file or folder there."""
    here = list(path.relative_to(ROOT).with_suffix("").parts[:-1])     # the module's package
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            parts = base + (node.module.split(".") if node.module else [])
            if not parts or parts[0] != package:
                continue
            for a in node.names:
                target = ROOT.joinpath(*parts, a.name)
                if target.is_dir() or target.with_suffix(".py").is_file():
                    names.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            names.update(a.asname for a in node.names if a.asname and a.name.split(".")[0] == package)
        elif isinstance(node, ast.Assign) and _lazy_name(node.value, package):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _module_private_reads(tree: ast.Module, path: Path, package: str) -> list[str]:
    """Reads of a private name (`_x`, not a dunder) of another package module, through a name
    `_module_names` binds."""
    modules = _module_names(tree, path, package)
    return [f"{ast.unparse(node)} (line {node.lineno})" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name) and node.value.id in modules]


def _path_edits(tree: ast.AST) -> list[str]:
    """`sys.path.insert(...)` and the other mutating calls, and assignments to `sys.path` or a slice of it."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and ast.unparse(node.func.value) == "sys.path"
                and node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear")):
            out.append(f"{ast.unparse(node)} (line {node.lineno})")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t).startswith("sys.path") for t in targets):
                out.append(f"{ast.unparse(node).splitlines()[0]} (line {node.lineno})")
    return out


def _tests_imports(tree: ast.AST) -> list[str]:
    """Imports of the test suite (`import tests...`, `from tests... import ...`), anywhere in a module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "tests":
            out.append(f"from {node.module} import {', '.join(a.name for a in node.names)} (line {node.lineno})")
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tests" for a in node.names):
            out.append(f"import {', '.join(a.name for a in node.names)} (line {node.lineno})")
    return out


def measure(package: str) -> dict:
    pkg = ROOT / package
    if not pkg.is_dir():
        raise SystemExit(f"structure.py: no package folder {package!r} under {ROOT}")
    out: dict = {"classes_over_200": {}, "private_reads": {}, "store_probes": {}, "modules_over_450": {},
                 "function_level_imports": {}, "module_private_reads": {}, "path_edits": {}, "tests_imports": {},
                 "lazy_modules": {}}
    for path in sorted(p for folder in BESIDE for p in (ROOT / folder).glob("*.py")):
        tree = ast.parse(path.read_text())
        for key, found in (("path_edits", _path_edits(tree)), ("tests_imports", _tests_imports(tree))):
            if found:
                out[key][str(path.relative_to(ROOT))] = found
    for path in sorted(pkg.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        tree = ast.parse(text)
        lines = len(text.splitlines())
        if lines > 450:
            out["modules_over_450"][rel] = lines
        local = _local_imports(tree, package)
        if local:
            out["function_level_imports"][rel] = local
        private = _module_private_reads(tree, path, package)
        if private:
            out["module_private_reads"][rel] = private
        declared = _lazy_modules(tree, package)
        if declared:
            out["lazy_modules"][rel] = declared
        if path.parent.name != "cache":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 200:
                out["classes_over_200"][f"{rel}:{node.name}"] = node.end_lineno - node.lineno + 1
        for key, found in (("private_reads", _private_reads(tree)), ("store_probes", _store_probes(tree))):
            if found:
                out[key][rel] = found
    out["counts"] = {k: sum(len(v) if isinstance(v, list) else 1 for v in d.values())
                     for k, d in out.items() if k != "counts"}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--package", default="tinygpt_mlx")
    args = ap.parse_args()
    m = measure(args.package)
    for key, n in m["counts"].items():
        print(f"{key}: {n}")
        for where, what in m[key].items():
            print(f"    {where}: {what}")
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(m, indent=1) + "\n")
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
