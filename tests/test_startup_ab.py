"""benchmarks/startup_ab.py's JSON says how it was run, as the other benchmarks' JSONs do (docs
cite it: the benchmark's own command, LD_PRELOAD, the load average at start and at the end).
The runs themselves are faked here (each is a real `sample` process of seconds)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from benchmarks import startup_ab

ROOT = Path(__file__).resolve().parents[1]


def test_startup_ab_json_names_its_command_ld_preload_and_load(tmp_path, monkeypatch):
    walls = iter([2.0, 1.0, 1.2, 2.2])           # a b b a
    monkeypatch.setattr(startup_ab, "run_once", lambda tree, hide_torch: {
        "wall_s": next(walls), "peak_rss_mib": 97.0, "imported": [], "text": "same"})
    monkeypatch.setenv("LD_PRELOAD", "/x/libopenblas.so.0")
    out = tmp_path / "ab.json"
    args = ["--tree-a", str(ROOT), "--tree-b", str(ROOT), "--rounds", "1", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "startup_ab.py"), *args])
    startup_ab.main()
    got = json.loads(out.read_text())
    assert got["benchmark_command"] == " ".join(["python -m benchmarks.startup_ab", *args])
    assert got["LD_PRELOAD"] == os.environ["LD_PRELOAD"] == "/x/libopenblas.so.0"
    assert len(got["load_average_at_start"]) == 3 and all(x >= 0 for x in got["load_average_at_start"])
    assert len(got["summary"]["load_after"]) == 3
    assert got["summary"]["a"]["median_wall_s"] == 2.1 and got["summary"]["b"]["median_wall_s"] == 1.1
    assert got["summary"]["b_over_a_wall"] == round(1.1 / 2.1, 3) and got["summary"]["same_text"] is True
