"""The structure the cache core's redesign reached stays reached (scripts/structure.py,
docs/architecture.md): no private attribute of another object read in cache/, and no layer
code probing which store it holds; and the measurement code (benchmarks/) and the tools (scripts/) import the package without
editing sys.path, and import no module of tests/."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import script_module

ROOT = Path(__file__).resolve().parents[1]


def test_cache_reads_no_private_field_and_probes_no_store(tmp_path):
    out = tmp_path / "structure.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "structure.py"), "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = json.loads(out.read_text())
    assert m["private_reads"] == {} and m["store_probes"] == {}
    assert m["counts"]["private_reads"] == 0 and m["counts"]["store_probes"] == 0
    assert m["path_edits"] == {} and m["counts"]["path_edits"] == 0
    assert m["tests_imports"] == {} and m["counts"]["tests_imports"] == 0   # benchmarks import the package (#54)
    assert m["function_level_imports"] == {} and m["counts"]["function_level_imports"] == 0
    assert m["module_private_reads"] == {} and m["counts"]["module_private_reads"] == 0


def test_function_level_imports_are_found():
    """The import count is not vacuous: an import statement of the package, a relative one and a
    `lazy(...)` declaration inside a function are each caught; the same at module level is not."""
    structure = script_module("structure")
    code = ("from tinygpt_mlx.lazy import lazy\nm = lazy('tinygpt_mlx.cache')\nimport tinygpt_mlx.config\n"
            "def f():\n    from tinygpt_mlx import cache\n    import tinygpt_mlx.generate\n"
            "    from ..format import save\n    g = lazy('tinygpt_mlx.generate')\n    import json\n")
    tree = ast.parse(code)
    assert len(structure._local_imports(tree, "tinygpt_mlx")) == 4
    assert structure._lazy_modules(tree, "tinygpt_mlx") == ["m = tinygpt_mlx.cache (line 2)"]


def test_private_names_of_other_modules_are_found():
    """The module-private count is not vacuous: a private name read through a package module bound
    by a relative import, an absolute one, `import ... as` and `lazy(...)` is caught (worker.py read
    `batch._EVENED` and `generate._call` before session 43); a private attribute of an object, of
    `self`, of a name imported from a module (a function, a class) or of another package's module
    is not, nor a dunder."""
    structure = script_module("structure")
    code = ("from . import batch\nfrom .. import generate as engine\nfrom ..cache import kivi\n"
            "import tinygpt_mlx.quant as quant\nfrom .config import ServerConfig\nimport os\n"
            "from tinygpt_mlx.lazy import lazy\nm = lazy('tinygpt_mlx.cache')\n"
            "a = batch._EVENED\nb = engine._call\nc = kivi._x\nd = quant._y\ne = m._z\n"
            "f = ServerConfig._w\ng = os._exit\nh = self._v\ni = batch.__name__\nj = batch.kept_nbytes\n"
            "def k(obj):\n    return obj._u\n")
    found = structure._module_private_reads(ast.parse(code), ROOT / "tinygpt_mlx" / "server" / "worker.py",
                                           "tinygpt_mlx")
    assert [f.split(" (")[0] for f in found] == ["batch._EVENED", "engine._call", "kivi._x", "quant._y", "m._z"]


def test_path_edits_are_found():
    """The sys.path count is not vacuous: each way of editing the path is caught, reading it is not."""
    structure = script_module("structure")
    code = ("import sys\nsys.path.insert(0, 'a')\nsys.path.append('b')\nsys.path[:0] = ['c']\n"
            "sys.path += ['d']\nsys.path = ['e']\nprint(sys.path[0])\n")
    assert len(structure._path_edits(ast.parse(code))) == 5


def test_tests_imports_are_found():
    """The tests-import count is not vacuous: each way of importing the test suite is caught, in a
    function too; a module merely named like it (`testsuite`) or a relative import is not."""
    structure = script_module("structure")
    code = ("from tests import test_distributed as td\nimport tests.conftest\nimport testsuite\n"
            "from . import tests\ndef f():\n    from tests.conftest import TEXT\n")
    assert len(structure._tests_imports(ast.parse(code))) == 3


def test_measurement_scripts_refuse_bad_arguments():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "structure.py"), "--package", "nope"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == f"structure.py: no package folder 'nope' under {ROOT}"
    r = subprocess.run([sys.executable, "-m", "benchmarks.plan_mutations", "--fields", "width"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "invalid choice: 'width'" in r.stderr
