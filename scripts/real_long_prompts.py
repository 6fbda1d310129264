"""Long prompts of 1,000-2,000 tokens (by MODEL's tokenizer) from six kinds of text found on a
Debian machine, written as JSONL (one JSON string per line, newlines kept) for
`posttrainllm compare --prompts`.

Six prompts from each source, 36 in all, each starting at a line boundary and cut at a length
drawn uniformly from [1000, 2000) tokens with a fixed seed:
    licences   /usr/share/common-licenses (Apache-2.0, GPL-3, MPL-2.0, LGPL-2.1, GFDL-1.3, Artistic)
    scripture  the King James Bible's held-out tail shipped with the package
    code       Python's standard library (argparse, textwrap, heapq, json.decoder, difflib, fractions)
    manual     vim's help files (pattern, autocmd, channel, spell, various, options)
    reference  perl's perldiag.pod, at six offsets
    changelog  gzip, dpkg, diffutils, GnuTLS and D-Bus change logs (/usr/share/doc)

The set used in docs/kivi.md is committed (docs/results/smollm2_long_prompts.jsonl), since the
files it is cut from differ between machines.

    python scripts/real_long_prompts.py ~/.cache/posttrainllm/SmolLM2-135M-Instruct.Q4_1.gguf OUT.jsonl
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import sysconfig
from pathlib import Path

from tinygpt_mlx.loading import load

STDLIB = Path(sysconfig.get_paths()["stdlib"])
PKG = Path(__file__).resolve().parent.parent / "tinygpt_mlx" / "data"
LICENCES = Path("/usr/share/common-licenses")
VIMDOC = next(Path("/usr/share/vim").glob("vim*/doc"), Path("/usr/share/vim/doc"))
PERLDIAG = next(Path("/usr/share/perl").glob("*/pod/perldiag.pod"), Path("perldiag.pod"))
DOC = Path("/usr/share/doc")

# (kind, file, fraction of the file where the prompt starts)
SOURCES = (
    *[("licences", LICENCES / n, 0.0) for n in ("Apache-2.0", "GPL-3", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic")],
    *[("scripture", PKG / "heldout_kjv.txt", f) for f in (0.0, 0.15, 0.3, 0.45, 0.6, 0.75)],
    *[("code", STDLIB / n, 0.2) for n in ("argparse.py", "textwrap.py", "heapq.py", "json/decoder.py",
                                          "difflib.py", "fractions.py")],
    *[("manual", VIMDOC / f"{n}.txt", 0.1) for n in ("pattern", "autocmd", "channel", "spell", "various", "options")],
    *[("reference", PERLDIAG, f) for f in (0.05, 0.2, 0.35, 0.5, 0.65, 0.8)],
    *[("changelog", DOC / n, 0.0) for n in ("gzip/changelog.gz", "dpkg/changelog.gz", "diffutils/changelog.gz",
                                            "libgnutls30/NEWS.gz", "dbus-daemon/NEWS.gz", "libmpfr6/changelog.gz")],
)


def read(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    tok = load(a.model).tokenizer
    rng = random.Random(a.seed)
    out = []
    for kind, path, where in SOURCES:
        length = rng.randrange(1000, 2000)
        if not path.exists():
            sys.exit(f"real_long_prompts: {path} not found (source of a {kind} prompt)")
        text = read(path)
        start = text.find("\n", int(len(text) * where)) + 1 if where else 0
        ids = tok.encode(text[start:start + length * 8])
        if len(ids) < length:
            sys.exit(f"real_long_prompts: {path} from {where:.0%} holds {len(ids)} tokens, fewer than {length}")
        out.append(tok.decode(ids[:length]))
        print(f"{kind:10s} {path}  {length} tokens", file=sys.stderr)
    Path(a.out).write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in out), encoding="utf-8")


if __name__ == "__main__":
    main()
