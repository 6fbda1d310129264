"""The structure the cache core's redesign reached stays reached (scripts/structure.py,
docs/architecture.md): no private attribute of another object read in cache/, and no layer
code probing which store it holds, no module over 450 lines and no class in cache/ over 200."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cache_reads_no_private_field_and_probes_no_store(tmp_path):
    out = tmp_path / "structure.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "structure.py"), "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = json.loads(out.read_text())
    assert m["private_reads"] == {} and m["store_probes"] == {}
    assert m["counts"]["private_reads"] == 0 and m["counts"]["store_probes"] == 0
    assert m["counts"]["modules_over_450"] == 0, m["modules_over_450"]
    assert m["counts"]["classes_over_200"] == 0, m["classes_over_200"]


def test_measurement_scripts_refuse_bad_arguments():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "structure.py"), "--package", "nope"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == f"structure.py: no package folder 'nope' under {ROOT}"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan_mutations.py"), "--fields", "width"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice: 'width'" in r.stderr
