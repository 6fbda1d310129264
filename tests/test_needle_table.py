"""scripts/needle_table.py: needle cells gathered from their JSONs' own records (config, tail,
context, seed, depth), a rerun counted once from the file git added last, and the issue grid's
missing cells."""

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("needle_table", ROOT / "scripts" / "needle_table.py")
nt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nt)

RET = {"hot_budget": 1024, "retrieve_tokens": 256, "top_pages": 256, "rope_mode": "shifted", "rope_auto": True}
INT4 = {"key_bits": 4, "value_bits": 4, "group_size": 32}


@pytest.mark.parametrize("policy, config, tail, fits, want", [
    ("full", {"storage": "fp32"}, None, True, "full"),
    ("full", {"storage": "fp32", "kivi": INT4}, 0, True, "int4"),
    ("full", {"storage": "fp32", "kivi": {**INT4, "exact_topk": 64}}, 0, True, "int4+top64"),
    ("full", {"storage": "fp32", "kivi": {**INT4, "value_bits": 2}}, 0, True, "k4v2"),
    ("streaming", {"storage": "fp32", "streaming_llm": {"window": 1024}}, None, True, "streaming"),
    ("streaming", {"storage": "fp32", "streaming_llm": {"window": 256}}, None, True, "streaming window256"),
    ("retrieval", {"storage": "fp32", "retrieval": RET}, 0, True, "retrieval"),
    ("retrieval", {"storage": "fp32", "retrieval": RET, "kivi": INT4}, 0, False, "int4+retrieval"),
    ("retrieval", {"storage": "fp32", "retrieval": {**RET, "retrieve_tokens": 1024, "top_pages": 1024}}, 0, True,
     "retrieval fetch1024/pages1024"),
    ("retrieval", {"storage": "fp32", "retrieval": {**RET, "hot_budget": 2048}}, 64, True, "retrieval hot2048 tail64"),
    # positions fixed by the run: the default where they are the ones rope_auto picks
    ("retrieval", {"storage": "fp32", "retrieval": {**RET, "rope_auto": False}}, None, False, "retrieval"),
    ("retrieval", {"storage": "fp32", "retrieval": {**RET, "rope_auto": False}}, None, True, "retrieval :shifted"),
    ("retrieval", {"storage": "fp32", "retrieval": {**RET, "rope_auto": False, "rope_mode": "absolute"}}, None, True,
     "retrieval"),
    ("retrieval", {"storage": "fp32", "retrieval": {**RET, "rope_auto": False, "rope_mode": "absolute"}}, None, False,
     "retrieval :absolute"),
    ("full", {"storage": "bf16"}, None, True, "full bf16"),
])
def test_label_names_the_policy_and_what_differs_from_the_grid_defaults(policy, config, tail, fits, want):
    assert nt.label(policy, config, tail, fits) == want


def _grid(policy: str, config: dict, cells: list[tuple], tail=0, model="m") -> dict:
    return {"model": model, "context_length": 32768, "task": "passkey", "prefill_tail": tail,
            "policies": {policy: config},
            "cells": [{"policy": policy, "context": n, "depth": d, "seed": s, "passed": p, "answer": "1",
                       "output": " 1." if p else " 2.", "prompt_tokens": n - 10} for n, s, d, p in cells]}


def _commit(repo: Path, name: str, data: dict, when: int) -> None:
    (repo / name).write_text(json.dumps(data))
    env = {**os.environ, "GIT_AUTHOR_DATE": f"{when} +0000", "GIT_COMMITTER_DATE": f"{when} +0000",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "add", name], cwd=repo, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", name], cwd=repo, check=True, env=env)


def test_a_rerun_counts_once_from_the_file_added_last_and_disagreements_are_listed(tmp_path, capsys):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    full = {"storage": "fp32"}
    # z_old.json sorts after a_new.json by name: only git's order can make a_new.json the newest
    _commit(tmp_path, "z_old.json", _grid("full", full, [(8192, 0, 0.1, False), (8192, 0, 0.3, True)]), 1_700_000_000)
    _commit(tmp_path, "a_new.json", _grid("full", full, [(8192, 0, 0.1, True)]), 1_700_100_000)
    _commit(tmp_path, "other_model.json", _grid("full", full, [(8192, 1, 0.1, True)], model="x"), 1_700_200_000)
    (tmp_path / "untracked.json").write_text(json.dumps(
        _grid("retrieval", {"storage": "fp32", "retrieval": RET}, [(65536, 2, 0.5, False), (65536, 2, 0.7, True)])))
    (tmp_path / "probe.json").write_text(json.dumps({"model": "m", "results": []}))   # not a grid: skipped

    cells, disagree, files = nt.gather(tmp_path, "m")
    assert sorted(os.path.basename(f) for f in files) == ["a_new.json", "untracked.json", "z_old.json"]
    assert cells[("full", 8192, 0, 0.1)]["passed"] and cells[("full", 8192, 0, 0.1)]["file"] == "a_new.json"
    assert cells[("full", 8192, 0, 0.1)]["runs"] == 2 and cells[("full", 8192, 0, 0.3)]["runs"] == 1
    assert disagree == [(("full", 8192, 0, 0.1), [("z_old.json", False), ("a_new.json", True)])]
    assert len(cells) == 4

    rows = nt.table(cells)
    assert rows[0] == "| policy | 8K | 64K |"
    assert rows[2] == "| full | **2/2** (s0 2/2) |  |"
    assert rows[3] == "| retrieval |  | **1/2** (s2 1/2) |"

    gaps = nt.missing(cells)
    assert len(gaps) == 375 - 4 and ("full", 8192, 0, 0.1) not in gaps and ("full", 8192, 0, 0.5) in gaps

    assert nt.main(["--results", str(tmp_path), "--model", "m", "--missing"]) == 0
    out = capsys.readouterr().out
    assert "reruns that disagree" in out and "z_old.json fail, a_new.json pass" in out
    assert "371 of the issue grid's 375 cells not run" in out


def test_refusals_name_the_folder_or_the_model(tmp_path, capsys):
    assert nt.main(["--results", str(tmp_path / "nope")]) == 2
    assert "nope: not a folder" in capsys.readouterr().err
    assert nt.main(["--results", str(tmp_path), "--model", "qq"]) == 1
    assert "no needle cells of model 'qq'" in capsys.readouterr().err


def test_configs_the_label_does_not_name_are_told_apart(tmp_path):
    """Two runs under one label whose configs differ elsewhere (a page summary) are not reruns of
    one cell: the config most cells ran keeps the label, the other names what differs."""
    minmax = {"storage": "fp32", "retrieval": {**RET, "summary": "minmax"}}
    mean = {"storage": "fp32", "retrieval": {**RET, "summary": "mean"}}
    cells = [(8192, 0, d, True) for d in (0.1, 0.3)]
    (tmp_path / "a.json").write_text(json.dumps(_grid("retrieval", minmax, cells)))
    (tmp_path / "b.json").write_text(json.dumps(_grid("retrieval", mean, cells[:1])))
    # where the store lives does not change a cell: the same label, a rerun
    (tmp_path / "c.json").write_text(json.dumps(_grid("retrieval", {**minmax, "retrieval": {
        **minmax["retrieval"], "cold_store": "disk"}}, cells[1:])))
    got, disagree, _ = nt.gather(tmp_path, "m")
    assert set(got) == {("retrieval", 8192, 0, 0.1), ("retrieval", 8192, 0, 0.3),
                        ("retrieval [retrieval.summary=mean]", 8192, 0, 0.1)}
    assert got[("retrieval", 8192, 0, 0.3)]["runs"] == 2 and not disagree


def test_a_file_that_records_no_prompt_settings_counts_as_needle_s_defaults(tmp_path):
    """Files written before digits, chat and lead_in were recorded ran `needle`'s defaults: a grid
    that records the defaults (a resumed one) is the same row; one that records others is apart."""
    full = {"storage": "fp32"}
    old = _grid("full", full, [(65536, 0, 0.1, False)])
    new = {**_grid("full", full, [(65536, 0, 0.3, True)]), "digits": 5, "chat": False, "lead_in": None}
    chat = {**_grid("full", full, [(65536, 0, 0.5, True)]), "digits": 5, "chat": True, "lead_in": None}
    for name, grid in (("old", old), ("new", new), ("chat", chat)):
        (tmp_path / f"{name}.json").write_text(json.dumps(grid))
    got, _, _ = nt.gather(tmp_path, "m")
    assert set(got) == {("full", 65536, 0, 0.1), ("full", 65536, 0, 0.3), ("full [chat=True]", 65536, 0, 0.5)}, got


def test_fits_counts_the_answer_as_the_run_does():
    """rope_auto's choice: prompt + answer tokens + 1 inside the context (run_cell)."""
    assert nt._fits({"context": 32768, "prompt_tokens": 32761, "answer": "12345"}, 32768)
    assert not nt._fits({"context": 32768, "prompt_tokens": 32762, "answer": "12345"}, 32768)


def test_commands_run_each_group_of_missing_cells_with_the_columns_flags():
    gaps = [("int4", 131072, 2, 0.1), ("int4", 131072, 2, 0.7), ("streaming", 32768, 0, 0.9)]
    got = nt.commands(gaps, "M.gguf")
    assert got == [
        "posttrainllm needle M.gguf --contexts 131072 --depths 0.1,0.7 --first-seed 2 --policies full --kv-quantize int4"
        " --past-context --seeds 1 --streaming-llm-sink 4 --kiv-hot-budget 1024 --prefill-chunk 512"
        " --json docs/results/gemma3_needle_128k_int4_seed2_d17.json --resume",
        "posttrainllm needle M.gguf --contexts 32768 --depths 0.9 --first-seed 0 --policies streaming"
        " --seeds 1 --streaming-llm-sink 4 --kiv-hot-budget 1024 --prefill-chunk 512"
        " --json docs/results/gemma3_needle_32k_streaming_seed0_d9.json --resume"]


def test_against_lists_the_cells_each_policy_misses_that_the_full_cache_finds(tmp_path, capsys):
    """`--against full`: per policy and context, over the cells both ran, what only the full cache
    finds (listed by seed and depth) and what only the policy finds; cells only one of them ran
    are left out."""
    full, ret = {"storage": "fp32"}, {"storage": "fp32", "retrieval": RET}
    (tmp_path / "full.json").write_text(json.dumps(_grid("full", full, [
        (8192, 0, 0.1, True), (8192, 0, 0.3, True), (8192, 1, 0.5, False), (16384, 0, 0.1, True)])))
    (tmp_path / "ret.json").write_text(json.dumps(_grid("retrieval", ret, [
        (8192, 0, 0.1, True), (8192, 0, 0.3, False), (8192, 1, 0.5, True), (8192, 2, 0.9, False),
        (16384, 0, 0.1, True)])))
    cells, _, _ = nt.gather(tmp_path, "m")
    rows = nt.against(cells, "full")
    assert rows[2:] == ["| retrieval | 8K | 3 | 1 | 1 (s0 d0.3) | 1 (s1 d0.5) |",
                        "| retrieval | 16K | 1 | 1 | 0 | 0 |"]
    assert nt.main(["--results", str(tmp_path), "--model", "m", "--against", "full"]) == 0
    assert "| retrieval | 8K | 3 | 1 | 1 (s0 d0.3) | 1 (s1 d0.5) |" in capsys.readouterr().out
