"""The training corpus and the synthetic needle documents (no CLI, no framework imports).

Corpus: `scripts/fetch_corpus.sh` writes plain UTF-8 text files (KJV Bible, fortunes, GCIDE
dictionary) to `data/corpus/` and a held-out split to `data/heldout.txt`; `load_text` reads a
file or a directory of `*.txt` files and `clean_text` normalises it.

Needles: `make_needle_doc(rng, filler, n_chars, depth)` hides one short fact ("The pass key is
48213. Remember it.", "The secret number of Alice is 7731.", ...) at `depth` (0 = start,
1 = end) inside an excerpt of real filler text and ends with a question whose greedy
continuation is the answer:

    prompt = "...filler... The pass key is 48213. Remember it. ...filler...\\n\\n"
             "What is the pass key? The pass key is"
    answer = "48213"                      # the model should continue with " 48213"

Training mixes such documents into the data (`tinygpt_mlx.train`), and the needle evaluation
calls the same function with new random values and held-out filler. `make_needle_doc_tokens`
fits a document to a token budget with any `encode` function; `evaluate.passkey` measures
greedy retrieval with an MLX model.
"""

from __future__ import annotations

import random
import re
import unicodedata
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from .chat_template import plain_text

EOT = "<|endoftext|>"

# ---------------------------------------------------------------------------------- corpus


def clean_text(text: str) -> str:
    """Normalise newlines and Unicode (NFC), drop control characters and trailing spaces,
    and collapse runs of blank lines to one."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = text.replace("\t", " ")
    text = "".join(ch for ch in text if ch == "\n" or unicodedata.category(ch)[0] != "C")
    text = re.sub(r"[ \u00a0]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


def corpus_files(path: Union[str, Path]) -> list[Path]:
    """The text files of a corpus: `path` itself, or the sorted `*.txt` files under it."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise FileNotFoundError(f"{path}: no *.txt files (run scripts/fetch_corpus.sh)")
        return files
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such corpus file or directory (run scripts/fetch_corpus.sh)")
    return [path]


def load_documents(path: Union[str, Path]) -> list[str]:
    """One cleaned text per corpus file (each file is one source, e.g. kjv, fortunes)."""
    return [clean_text(p.read_text(encoding="utf-8", errors="replace")) for p in corpus_files(path)]


def load_text(path: Union[str, Path]) -> str:
    """The whole corpus as one cleaned string, sources separated by a blank line."""
    return "\n".join(load_documents(path))


def split_heldout(text: str, fraction: float = 0.02) -> tuple[str, str]:
    """(train, heldout): the last `fraction` of the lines of `text` are held out."""
    lines = text.splitlines(keepends=True)
    cut = len(lines) - max(1, int(len(lines) * fraction))
    return "".join(lines[:cut]), "".join(lines[cut:])


# --------------------------------------------------------------------------------- needles

NAMES = ("Alice", "Bob", "Carol", "David", "Esther", "Frank", "Grace", "Henry", "Irene",
         "James", "Kate", "Louis", "Mary", "Nathan", "Olivia", "Peter", "Ruth", "Samuel",
         "Thomas", "Victor", "Walter", "Zoe")
THINGS = ("red door", "old safe", "front gate", "blue box", "garden shed", "north tower",
          "iron chest", "library", "cellar", "locker")

# (fact, question): {v} is the value, {name}/{thing} are filled at random. Every question
# ends with the words that the answer continues, so greedy decoding yields " {v}".
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("The pass key is {v}. Remember it. {v} is the pass key.",
     "What is the pass key? The pass key is"),
    ("The pass key is {v}. Remember it.", "What is the pass key? The pass key is"),
    ("Remember this: the pass key is {v}.", "What is the pass key? The pass key is"),
    ("The secret number of {name} is {v}.",
     "What is the secret number of {name}? The secret number of {name} is"),
    ("{name}'s lucky number is {v}.", "What is {name}'s lucky number? {name}'s lucky number is"),
    ("The code for the {thing} is {v}. Do not forget it.",
     "What is the code for the {thing}? The code for the {thing} is"),
    ("The magic number is {v}.", "What is the magic number? The magic number is"),
    ("{name} lives in room number {v}.",
     "In which room does {name} live? {name} lives in room number"),
)
PASSKEY_TEMPLATE = 1  # index of the plain "The pass key is N. Remember it." template


def random_value(rng: random.Random, digits: Optional[int] = None) -> str:
    """A random number as text, 3-6 digits (or exactly `digits`), no leading zero."""
    n = digits or rng.randint(3, 6)
    return str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(n - 1))


def _excerpt(rng: random.Random, filler: str, n_chars: int) -> str:
    """`n_chars` characters of `filler` from a random line start (wrapping around)."""
    if n_chars <= 0:
        return ""
    if not filler:
        raise ValueError("filler text is empty")
    while len(filler) < n_chars + 1:
        filler = filler + "\n" + filler
    start = rng.randrange(0, len(filler) - n_chars)
    nl = filler.find("\n", start, start + 200)
    if nl != -1 and nl + 1 + n_chars <= len(filler):
        start = nl + 1
    return filler[start:start + n_chars]


def _boundary(text: str, pos: int) -> int:
    """A position near `pos` just after a sentence end or newline (or `pos` itself)."""
    if pos <= 0 or pos >= len(text):
        return max(0, min(pos, len(text)))
    m = re.compile(r"[.!?;]\s|\n").search(text, pos)
    if m and m.end() - pos < 200:
        return m.end()
    sp = text.find(" ", pos)
    return sp + 1 if sp != -1 and sp - pos < 50 else pos


def make_needle_doc(rng: random.Random, filler: str, n_chars: int, depth: Optional[float] = None,
                    template: Optional[int] = None, value: Optional[str] = None,
                    distractors: int = 0) -> tuple[str, str]:
    """A needle-in-a-haystack document of about `n_chars` characters.

    rng          a `random.Random`; everything not given is drawn from it
    filler       real text to take the haystack from (use held-out text for evaluation)
    n_chars      total length of the prompt in characters (the haystack shrinks to fit)
    depth        where the fact goes, 0.0 = first thing, 1.0 = just before the question;
                 None draws it uniformly
    template     index into `TEMPLATES` (None = random, `PASSKEY_TEMPLATE` = plain pass key)
    value        the answer (None = `random_value(rng)`)
    distractors  other facts of the same template with other names/values (templates that
                 have a {name} or {thing} only) placed at random depths

    Returns (prompt, answer): `prompt` ends with the question, e.g. "... The pass key is",
    and the correct greedy continuation is " " + answer.
    """
    depth, fact_t, question_t, name, thing, value = _draw_fact(rng, depth, template, value)
    fact = fact_t.format(v=value, name=name, thing=thing)
    question = question_t.format(name=name, thing=thing)
    others: list[str] = []
    if distractors and ("{name}" in fact_t or "{thing}" in fact_t):
        key = "{name}" if "{name}" in fact_t else "{thing}"
        pool = [x for x in (NAMES if key == "{name}" else THINGS) if x not in (name, thing)]
        for other in rng.sample(pool, min(distractors, len(pool))):
            v = random_value(rng, len(value))
            others.append(fact_t.format(v=v, name=other, thing=other))
    tail = "\n\n" + question
    budget = n_chars - len(fact) - 2 - len(tail) - sum(len(o) + 2 for o in others)
    hay = _excerpt(rng, filler, max(0, budget))
    inserts = [(depth, fact)] + [(rng.random(), o) for o in others]
    return _insert(hay, inserts).rstrip() + tail, value


def _depth(rng: random.Random, depth: Optional[float]) -> float:
    """`depth`, checked, or a uniform draw from `rng`."""
    depth = rng.random() if depth is None else depth
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    return depth


def _draw_fact(rng: random.Random, depth: Optional[float], template: Optional[int], value: Optional[str]):
    """(depth, fact template, question template, name, thing, value): what is not given, drawn."""
    depth = _depth(rng, depth)
    fact_t, question_t = TEMPLATES[rng.randrange(len(TEMPLATES)) if template is None else template]
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    return depth, fact_t, question_t, name, thing, value if value is not None else random_value(rng)


def _insert(hay: str, inserts: list[tuple[float, str]]) -> str:
    """`hay` with each (depth, text) inserted at a sentence boundary near depth * len(hay)."""
    # Insert from the back so earlier positions stay valid.
    for d, text in sorted(inserts, key=lambda x: -x[0]):
        pos = _boundary(hay, int(d * len(hay))) if d < 1.0 else len(hay)
        left, right = hay[:pos], hay[pos:]
        sep_l = "" if not left or left.endswith((" ", "\n")) else " "
        sep_r = "" if right.startswith((" ", "\n")) or not right else " "
        hay = left + sep_l + text + sep_r + right
    return hay


# ------------------------------------------------------------------ beyond one needle
# KIV's README names two limits: "can't aggregate many scattered results" and "drops on dense
# repetitive data (phone books)". These documents test them: several facts of one keyed
# template, asked for one or all of them, and a haystack that is all look-alike entries.

#: keyed templates (index into TEMPLATES) and how to ask for all their facts at once
ALL_QUESTIONS = {3: "What are the secret numbers of {names}?",
                 4: "What are the lucky numbers of {names}?",
                 7: "In which rooms do {names} live?"}
SURNAMES = ("Adams", "Baker", "Clark", "Davis", "Evans", "Fisher", "Green", "Hall", "Irving", "Jones",
            "King", "Lewis", "Moore", "Nolan", "Owens", "Parker", "Quinn", "Reed", "Scott", "Turner",
            "Upton", "Vance", "Walker", "Young", "Allen", "Brooks", "Carter", "Dixon", "Ellis", "Foster",
            "Grant", "Hayes", "Ingram", "Jordan", "Keller", "Lane", "Mason", "Nash", "Oliver", "Price")
TASKS = ("passkey", "keyed", "keyed-all", "phonebook")


def _names(items: Sequence[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def make_keyed_doc(rng: random.Random, filler: str, n_chars: int, depth: Optional[float] = None,
                   template: int = 3, facts: int = 4, ask_all: bool = False,
                   value: Optional[str] = None, digits: Optional[int] = None) -> tuple[str, str]:
    """`facts` facts of one keyed template (different names, values of one length) in real
    filler. The asked fact sits at `depth`, the others at random depths. `ask_all=False`: the
    question asks for one name and the answer is its value. `ask_all=True`: the question asks
    for every name (in a random order) and the answer states them one by one:

        "...What are the secret numbers of Bob, Alice and Zoe? The secret number of Bob is"
        -> " 4821. The secret number of Alice is 7731. The secret number of Zoe is 5120."

    Returns (prompt, answer), the greedy continuation being " " + answer."""
    if template not in ALL_QUESTIONS:
        raise ValueError(f"template {template} has no key; choose from {sorted(ALL_QUESTIONS)}")
    if not 1 <= facts <= len(NAMES):
        raise ValueError(f"facts must be in 1..{len(NAMES)}, got {facts}")
    depth = _depth(rng, depth)
    fact_t, question_t = TEMPLATES[template]
    names = rng.sample(NAMES, facts)
    value = value if value is not None else random_value(rng, digits)
    values = [value] + [random_value(rng, len(value)) for _ in names[1:]]
    facts_text = [fact_t.format(name=n, v=v) for n, v in zip(names, values)]
    if ask_all:
        order = rng.sample(range(facts), facts)
        question = ALL_QUESTIONS[template].format(names=_names([names[i] for i in order]))
        head = fact_t.format(name=names[order[0]], v="{v}").split("{v}")[0].rstrip()
        question += " " + head
        answer = " ".join([values[order[0]] + "."] + [facts_text[i] for i in order[1:]])
    else:
        question, answer = question_t.format(name=names[0]), value
    tail = "\n\n" + question
    hay = _excerpt(rng, filler, max(0, n_chars - len(tail) - sum(len(f) + 2 for f in facts_text)))
    inserts = [(depth, facts_text[0])] + [(rng.random(), f) for f in facts_text[1:]]
    return _insert(hay, inserts).rstrip() + tail, answer


def make_phonebook_doc(rng: random.Random, n_chars: int, depth: Optional[float] = None,
                       value: Optional[str] = None, digits: int = 5) -> tuple[str, str]:
    """A phone book: nothing but look-alike "First Last: NNNNN" lines, one of them asked for
    (at `depth`). Other names may repeat at long lengths; the asked one never does.
    Returns (prompt, answer), the greedy continuation being " " + answer."""
    depth = _depth(rng, depth)
    target = f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}"
    value = value if value is not None else random_value(rng, digits)
    question = f"\n\nWhat is the number of {target}? The number of {target} is"
    lines: list[str] = []
    size = len(question) + len(target) + len(value) + 3
    while size < n_chars:
        name = f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}"
        if name == target:
            continue
        line = f"{name}: {random_value(rng, digits)}"
        lines.append(line)
        size += len(line) + 1
    lines.insert(round(depth * len(lines)), f"{target}: {value}")
    return "\n".join(lines) + question, value


def make_task_doc(rng: random.Random, filler: str, n_chars: int, task: str = "passkey",
                  depth: Optional[float] = None, value: Optional[str] = None,
                  digits: Optional[int] = None, facts: int = 4, template: Optional[int] = None
                  ) -> tuple[str, str]:
    """One document of a `TASKS` kind: "passkey" (`make_needle_doc`, plain pass key unless
    `template`), "keyed" / "keyed-all" (`make_keyed_doc`, the secret-number template unless
    `template`) or "phonebook" (`make_phonebook_doc`, no filler)."""
    if task == "passkey":
        value = value if value is not None else random_value(rng, digits)
        return make_needle_doc(rng, filler, n_chars, depth,
                               template=PASSKEY_TEMPLATE if template is None else template, value=value)
    if task in ("keyed", "keyed-all"):
        return make_keyed_doc(rng, filler, n_chars, depth, template=3 if template is None else template,
                              facts=facts, ask_all=task == "keyed-all", value=value, digits=digits)
    if task == "phonebook":
        return make_phonebook_doc(rng, n_chars, depth, value=value, digits=digits or 5)
    raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def make_chat_doc(rng: random.Random, filler: str, n_chars: int, depth: Optional[float] = None,
                  template: Optional[int] = None, value: Optional[str] = None) -> tuple[str, str]:
    """A conversation in the plain chat format (`chat_template.plain_text`): a user turn states
    a fact (any of `TEMPLATES`) at `depth` of the conversation, the other turns are lines of
    `filler`, and the last user turn asks for it. Returns (prompt ending in "Assistant:",
    answer), e.g. answer "The pass key is 48213": the reply the model should give."""
    depth, fact_t, question_t, name, thing, value = _draw_fact(rng, depth, template, value)
    ask, head = question_t.format(name=name, thing=thing).split("? ", 1)
    lines = [ln.strip()[:200] for ln in _excerpt(rng, filler, max(400, 2 * n_chars)).splitlines()
             if len(ln.strip()) > 8]
    turns: list[str] = []
    size = len(ask) + len(fact_t) + 40
    while size < n_chars and lines:
        turns.append(lines.pop(0))
        size += len(turns[-1]) + 12
    turns = turns[:len(turns) // 2 * 2]              # whole (user, assistant) rounds
    at = 2 * round(depth * (len(turns) // 2))
    turns[at:at] = [fact_t.format(v=value, name=name, thing=thing), "I will remember it."]
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(turns)]
    messages.append({"role": "user", "content": ask + "?"})
    return plain_text(messages), f"{head} {value}"


def values_right(text: str, answer: str) -> int:
    """How many of the answer's numbers the text states in order, position by position."""
    want, got = re.findall(r"\d+", answer), re.findall(r"\d+", text)
    return sum(1 for w, g in zip(want, got) if w == g)


def make_needle_doc_tokens(rng: random.Random, filler: str, encode: Callable[[str], Sequence[int]],
                           n_tokens: int, depth: Optional[float] = None,
                           chars_per_token: float = 3.5, **kwargs) -> tuple[str, str]:
    """Like `make_needle_doc` but the prompt encodes to at most `n_tokens` tokens (and close
    to it): the character budget is refined from the measured characters per token."""
    return fit_tokens(lambda n_chars: make_needle_doc(rng, filler, n_chars, depth, **kwargs),
                      rng, encode, n_tokens, chars_per_token)


def fit_tokens(make: Callable[[int], tuple[str, str]], rng: random.Random,
               encode: Callable[[str], Sequence[int]], n_tokens: int,
               chars_per_token: float = 3.5) -> tuple[str, str]:
    """`make(n_chars)` (drawing from `rng`) with `n_chars` refined until the prompt encodes to at
    most `n_tokens` tokens and close to it; `rng` restarts from its state for every try."""
    state = rng.getstate()
    n_chars = max(16, int(n_tokens * chars_per_token))
    best = None
    for _ in range(6):
        rng.setstate(state)
        prompt, answer = make(n_chars)
        n = len(encode(prompt))
        if n <= n_tokens:
            best = (prompt, answer)
            if n >= n_tokens * 0.97:
                break
        n_chars = max(16, int(n_chars * (n_tokens / max(n, 1)) * (0.99 if n > n_tokens else 1.0)))
    if best is None:
        raise ValueError(f"cannot fit a needle document into {n_tokens} tokens")
    return best
