#!/usr/bin/env bash
# Fetch the training corpus from Debian text packages and write plain UTF-8 text.
#
#   scripts/fetch_corpus.sh [OUT_DIR]        (default: data)
#   scripts/fetch_corpus.sh --shipped-heldout [FILE]
#       only the KJV's held-out tail (public domain), written to FILE (default
#       tinygpt_mlx/data/heldout_kjv.txt): the text shipped with the package as the default
#       needle --filler and perplexity --text
#
# Sources (all public domain or free licences, installed with apt-get):
#   bible-kjv    the King James Bible, printed as plain text by the `bible` program
#   fortunes     the classic fortune-cookie files (plain text, "%"-separated)
#   dict-gcide   GNU Collaborative International Dictionary of English (dictzip = gzip);
#                every 3rd entry is kept, markup stripped, capped at GCIDE_MAX_BYTES
# Output:
#   OUT_DIR/corpus/{kjv,fortunes,gcide}.txt   training text (the first 98% of each source)
#   OUT_DIR/heldout.txt                       held-out text (the last 2% of each source)
# data/ is gitignored: the corpus is never committed.
set -euo pipefail

SHIPPED=""
if [ "${1:-}" = "--shipped-heldout" ]; then
    SHIPPED=${2:-"$(cd "$(dirname "$0")/.." && pwd)/tinygpt_mlx/data/heldout_kjv.txt"}
    set --
fi
OUT=${1:-data}
HELDOUT_PERCENT=${HELDOUT_PERCENT:-2}
GCIDE_MAX_BYTES=${GCIDE_MAX_BYTES:-8000000}
PACKAGES="bible-kjv fortunes dict-gcide"
[ -z "$SHIPPED" ] || PACKAGES="bible-kjv"

missing=""
command -v bible >/dev/null 2>&1 || missing="$missing bible-kjv"
if [ -z "$SHIPPED" ]; then
    [ -f /usr/share/games/fortunes/fortunes ] || missing="$missing fortunes"
    [ -f /usr/share/dictd/gcide.dict.dz ] || missing="$missing dict-gcide"
fi
if [ -n "$missing" ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "installing:$missing" >&2
    $SUDO apt-get install -y --no-install-recommends $PACKAGES >&2 || {
        $SUDO apt-get update >&2 && $SUDO apt-get install -y --no-install-recommends $PACKAGES >&2; }
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# KJV: one verse per line, reference stripped, a blank line between chapters.
bible -f Gen1:1-Rev22:21 | awk '
    NF == 0 { next }
    {
        ref = $1; sub(/:[0-9]+$/, "", ref)
        if (ref != prev && NR > 1) print ""
        prev = ref
        sub(/^[^ ]+ /, "")
        print
    }' > "$TMP/kjv.txt"

# Lines of a source kept for training (the first 100 - HELDOUT_PERCENT %); the rest are held out.
keep_lines() { local lines; lines=$(wc -l < "$1"); echo $(( lines - lines * HELDOUT_PERCENT / 100 )); }

if [ -n "$SHIPPED" ]; then
    tail -n +"$(( $(keep_lines "$TMP/kjv.txt") + 1 ))" "$TMP/kjv.txt" > "$SHIPPED"
    wc -c "$SHIPPED" >&2
    exit 0
fi
mkdir -p "$OUT/corpus"

# Fortunes: every English fortune file except ASCII art; "%" separators become blank lines.
for f in /usr/share/games/fortunes/*; do
    case "$f" in *.dat|*.u8|*ascii-art*|*translate-me*) continue ;; esac
    [ -f "$f" ] || continue
    iconv -f utf-8 -t utf-8 -c "$f"
    echo "%"
done | tr '\t' ' ' | sed -e 's/[[:space:]]*$//' -e 's/^%$//' | cat -s > "$TMP/fortunes.txt"

# GCIDE: entries are blank-line-separated paragraphs; drop licence text and source tags,
# turn "Word \Pro*nun"ci*a*tion\, n." into "Word, n.", unwrap {cross references}.
set +o pipefail  # awk stops early at the byte cap; gzip then dies of SIGPIPE
gzip -dc /usr/share/dictd/gcide.dict.dz | iconv -f utf-8 -t utf-8 -c | awk -v max="$GCIDE_MAX_BYTES" '
    BEGIN { RS = ""; n = 0; bytes = 0; started = 0 }
    !started && !/^A \\/ { next }
    { started = 1 }
    /^00-database|GCIDE|General Public License|Free Software Foundation|Begin file|MICRA/ { next }
    {
        n++
        if (n % 3 != 1) next
        gsub(/\[(1913 Webster|WordNet 1\.5|PJC|Webster 1913 Suppl\.|[A-Za-z0-9 .]+ Webster)\]/, "")
        gsub(/ \\[^\\\n]*\\/, "")
        gsub(/[{}]/, "")
        gsub(/\n[ \t]+/, "\n")
        gsub(/\n+/, "\n")
        sub(/\n$/, "")
        bytes += length($0) + 2
        if (bytes > max) exit
        print $0 "\n"
    }' > "$TMP/gcide.txt"
set -o pipefail

: > "$OUT/heldout.txt"
for name in kjv fortunes gcide; do
    keep=$(keep_lines "$TMP/$name.txt")
    head -n "$keep" "$TMP/$name.txt" > "$OUT/corpus/$name.txt"
    tail -n +"$(( keep + 1 ))" "$TMP/$name.txt" >> "$OUT/heldout.txt"
    echo >> "$OUT/heldout.txt"
done
wc -c "$OUT"/corpus/*.txt "$OUT/heldout.txt" >&2
