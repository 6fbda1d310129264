"""README's "### Python API" block runs as written, on the shipped model, in a fresh interpreter."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_api_blocks(markdown: str) -> list[str]:
    """The ```python blocks between "### Python API" and the next heading of level 1-3
    (lines inside code fences are never headings: `# comment` is Python)."""
    blocks, block, fence, inside = [], None, None, False
    for line in markdown.splitlines(keepends=True):
        if fence is None and line.startswith("```"):
            fence = line.strip()[3:]
            block = [] if inside and fence == "python" else None
        elif fence is not None and line.startswith("```"):
            if block is not None:
                blocks.append("".join(block))
            fence, block = None, None
        elif fence is not None:
            if block is not None:
                block.append(line)
        elif line.rstrip() == "### Python API":
            inside = True
        elif inside and re.match(r"#{1,3} ", line):
            break
    assert inside, 'README.md has no "### Python API" section'
    return blocks


def test_extractor_finds_only_that_section():
    md = ("## Use\n```python\nbefore()\n```\n### Python API\ntext\n```python\n# comment\na = 1\n```\n"
          "```bash\nnot python\n```\n```python\nb = 2\n```\n## Layout\n```python\nafter()\n```\n")
    assert python_api_blocks(md) == ["# comment\na = 1\n", "b = 2\n"]


def test_readme_python_api_runs_as_written():
    blocks = python_api_blocks((ROOT / "README.md").read_text())
    assert blocks, "no ```python block under ### Python API"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-c", "\n\n".join(blocks)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    numbers = [i for i, line in enumerate(lines) if re.fullmatch(r"\d+ \d+ \d+", line)]
    assert len(numbers) == 1, r.stdout
    i = numbers[0]
    current_length, stored_count, nbytes = map(int, lines[i].split())
    assert current_length >= stored_count > 0 and nbytes > 0
    assert "4821" in "\n".join(lines[:i])            # the greedy text recalls the pass key, as promised
    assert "".join(lines[i + 1:]).strip()            # the streamed, sampled text
