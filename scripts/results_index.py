"""Write docs/results/README.md: every file under docs/results/ with the doc pages that cite it,
the command that wrote it (where a page shows one) and the commit that last changed it.

A page cites a file by its name, by a path under docs/results/, or by a pattern such as
`smollm2_cold_store_8k_*.json` or `smollm2_weights_{dense,packed}.json`. tests/test_results_index.py
checks that the index is current (its commit column aside) and that no result is left uncited.
    python scripts/results_index.py            # rewrite the index
    python scripts/results_index.py --check    # exit 1 if it is stale, listing uncited files
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
INDEX = RESULTS / "README.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"^\s*(?:[A-Z_]+=\S+\s+)*(python|posttrainllm|bash|mlx\.launch)\b")


def results() -> list[str]:
    """Every result, as its path under docs/results/ (a folder's files one by one)."""
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file() and p != INDEX)


def _expand(pattern: str) -> list[str]:
    """`a_{x,y}.json` -> [a_x.json, a_y.json] (one brace group at a time)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [q for alt in m[1].split(",") for q in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _specific(pattern: str) -> bool:
    """A pattern that names something: a stem of 4+ characters besides its wildcards (not `*.json`)."""
    stem = os.path.basename(pattern).rsplit(".", 1)[0]
    return len(re.sub(r"[*?\[\]]", "", stem)) >= 4


def _commands(text: str) -> list[str]:
    """Commands a page shows: lines of its fenced blocks (joined at trailing backslashes) and
    inline code spans, those that start with python (`python -m benchmarks.NAME ...` included),
    posttrainllm, bash or mlx.launch, after any VAR=value prefixes."""
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        out += [c.strip() for c in block.replace("\\\n", " ").splitlines() if COMMAND.match(c)]
    out += [c.strip() for c in re.findall(r"`([^`\n]+)`", text.replace("\\\n", " ")) if COMMAND.match(c)]
    return [re.sub(r"\s+", " ", c) for c in out]


def citations() -> dict[str, dict]:
    """{result: {"pages": [...], "commands": [...]}} from every page's mentions."""
    files = results()
    out: dict[str, dict] = {f: {"pages": [], "commands": []} for f in files}
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        tokens = set(re.findall(r"[\w.{},*/-]+\.(?:json|txt|png|jsonl)\b", text))
        # a folder of results is cited whole by its path (`docs/results/kiv_limits/`)
        folders = {f.split("/")[0] for f in files if "/" in f}
        cited_folders = {d for d in folders if re.search(rf"results/{re.escape(d)}(?!\w)", text)}
        cmds = _commands(text)
        name = str(page.relative_to(ROOT))
        for f in files:
            base = os.path.basename(f)
            hit = f.split("/")[0] in cited_folders and "/" in f or any(
                (fnmatch.fnmatch(f, pat) or fnmatch.fnmatch(base, os.path.basename(pat))) and _specific(pat)
                for tok in tokens for pat in _expand(tok))
            if hit:
                out[f]["pages"].append(name)
                out[f]["commands"] += [c for c in cmds if _names(c, base)]
    return out


def _names(command: str, base: str) -> bool:
    """Whether `command` writes the result named `base`: it holds the whole name, or the name's
    stem (7+ characters) not followed by more of a name, so that `a_448_r1.json` in a command
    does not make it `a_448.json`'s."""
    stem = base.rsplit(".", 1)[0]
    return base in command or (len(stem) > 6 and re.search(rf"{re.escape(stem)}(?!\w)", command) is not None)


def last_commit(path: Path) -> str:
    r = subprocess.run(["git", "log", "-1", "--format=%h %as", "--", str(path)], cwd=ROOT,
                       capture_output=True, text=True)
    return r.stdout.strip() or "(uncommitted)"


def render(cites: dict[str, dict], commits: bool = True) -> str:
    """The index's text; with `commits` False its commit column holds "-" (what `--check` compares
    leaves that column out, and one `git log` per file is most of the script's time)."""
    lines = ["# docs/results: what each file is, where it is cited, what wrote it", "",
             "Made by `python scripts/results_index.py` (tests/test_results_index.py checks it is current).",
             "A command is shown where a citing page prints one that names the file; otherwise read the",
             "page. Commit: the last one that changed the file.", "",
             "| file | cited in | command | commit |", "|---|---|---|---|"]
    for f, c in cites.items():
        cmd = c["commands"][0] if c["commands"] else ""
        cmd = f"`{cmd}`" if cmd else "(see the page)"
        pages = ", ".join(c["pages"]) or "**nowhere**"
        commit = last_commit(RESULTS / f) if commits else "-"
        lines.append(f"| `{f}` | {pages} | {cmd.replace('|', chr(92) + '|')} | {commit} |")
    return "\n".join(lines) + "\n"


def _sans_commits(text: str) -> list[str]:
    return [line.rsplit(" | ", 1)[0] if line.startswith("| `") else line for line in text.splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the index is stale or a file is uncited")
    args = ap.parse_args()
    cites = citations()
    text = render(cites, commits=not args.check)
    uncited = [f for f, c in cites.items() if not c["pages"]]
    if args.check:
        # the commit column is left out of the comparison: a results file's commit is known only
        # after it is committed, and a shallow clone knows none
        stale = not INDEX.exists() or _sans_commits(INDEX.read_text(encoding="utf-8")) != _sans_commits(text)
        for f in uncited:
            print(f"uncited: docs/results/{f}", file=sys.stderr)
        if stale:
            print("docs/results/README.md is stale: run python scripts/results_index.py", file=sys.stderr)
        return 1 if stale or uncited else 0
    tmp = INDEX.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, INDEX)
    print(f"wrote {INDEX.relative_to(ROOT)}: {len(cites)} files, {len(uncited)} uncited", file=sys.stderr)
    for f in uncited:
        print(f"uncited: docs/results/{f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
