"""Chat prompts: the one template helper `sample`, `chat` (chat.py) and the server share.

Templates. An mlx-lm model whose tokenizer has a chat template gets it, tokenized exactly as
`mlx_lm.generate` does (`apply_chat_template(..., tokenize=False)`, then `encode(text,
add_special_tokens=False)`: the template writes any BOS itself). Everything else (native
`.tinygpt` models, or `--no-chat-template`) gets the plain turn format (`plain_text`):

    System: ...
    User: ...
    Assistant: ...
    User: ...
    Assistant:

with "\\nUser:" as a stop string, so the model does not write the user's next line.

Prompt-cache files (docs/prompt-cache.md). `posttrainllm cache-prompt` on a templated model
saves the document as the opening of the user's message (`open_turn`): the file's tokens are
those of the prompt `sample --prompt "DOCUMENT\n\nQUESTION"` would feed that every question
shares, and its `PromptTurn` record names the template, the system message and the document,
so that `sample --prompt-cache FILE --prompt QUESTION` feeds exactly what that one-shot prompt
feeds after them (`PromptTurn.prompt_ids`).
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Optional

PLAIN_STOP = "\nUser:"
# A placeholder reply: one private-use character, neither alphanumeric nor whitespace, so no
# template strips it and the plain format joins it to "Assistant:" directly.
PLACEHOLDER = "\ue000"


def wrapper_of(tokenizer: Any) -> Any:
    """mlx-lm's TokenizerWrapper behind our `Tokenizer`, or None (native)."""
    return getattr(tokenizer, "_wrapper", None)


def has_template(tokenizer: Any) -> bool:
    """Whether the tokenizer brings its own chat template (mlx-lm models that ship one)."""
    w = wrapper_of(tokenizer)
    return bool(w is not None and (getattr(w, "has_chat_template", False) or getattr(w, "chat_template", None)))


def plain_text(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The plain turn format: "Role: content" lines, then "Assistant:" (with
    `add_generation_prompt`). An assistant message starting with a space, a newline or
    punctuation follows "Assistant:" directly: that is how the model generated it (its answer
    began right after "Assistant:"), so the history reproduces the generated text."""
    lines = []
    for m in messages:
        role, content = str(m.get("role", "user")).capitalize(), m.get("content", "")
        sep = " " if role != "Assistant" or (content[:1].isalnum()) else ""
        lines.append(f"{role}:{sep}{content}")
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n".join(lines)


def render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
           use_template: bool = True) -> str:
    """The chat's text: the model's template (where it has one and `use_template`), else plain."""
    if use_template and has_template(tokenizer):
        return wrapper_of(tokenizer).apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)
    return plain_text(messages, add_generation_prompt)


def encode_fragment(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a piece of text inside a conversation: no BOS or other added tokens (special
    tokens written in the text, e.g. "<|im_end|>", are still recognised)."""
    w = wrapper_of(tokenizer)
    if w is None:
        return tokenizer.encode(text)
    return list(w.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer: Any, messages: list[dict], use_template: bool = True) -> list[int]:
    """A whole chat prompt's ids, ending in the generation prompt (as `mlx_lm.generate` makes
    them for a templated model)."""
    text = render(tokenizer, messages, True, use_template)
    if use_template and has_template(tokenizer):
        return encode_fragment(tokenizer, text)
    return tokenizer.encode(text)


def stop_strings(tokenizer: Any, use_template: bool = True) -> tuple[str, ...]:
    """The stop strings a chat format implies: "\\nUser:" for the plain one, none for a template
    (its end-of-turn token is the tokenizer's EOS)."""
    return () if use_template and has_template(tokenizer) else (PLAIN_STOP,)


def user_prompt_ids(tokenizer: Any, prompt: str, system: Optional[str] = None,
                    use_template: bool = True) -> list[int]:
    """`sample`'s prompt: the chat template around one user message (and `system`) for a
    templated model, as `mlx_lm.generate` does; otherwise the text as written (after `system`
    and a blank line, if given): a native model is a base language model."""
    if use_template and has_template(tokenizer):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return prompt_ids(tokenizer, msgs)
    return tokenizer.encode(f"{system}\n\n{prompt}" if system else prompt)


def turn_text(tokenizer: Any, messages: list[dict], user: str, use_template: bool = True) -> tuple[str, str]:
    """The text from the end of the last reply to the next generation prompt, and the rule used:
    "prefix" (the template's own text: full conversation minus the conversation so far) or
    "alone" (the template re-renders earlier turns: end of turn + the new message alone).
    `messages` ends with the user message the last reply answered."""
    asst = {"role": "assistant", "content": PLACEHOLDER}
    new = {"role": "user", "content": user}
    before = render(tokenizer, messages, True, use_template) + PLACEHOLDER
    after = render(tokenizer, messages + [asst, new], True, use_template)
    if after.startswith(before):
        return after[len(before):], "prefix"
    closed = render(tokenizer, messages + [asst], False, use_template)
    eot = closed[closed.rindex(PLACEHOLDER) + 1:] if PLACEHOLDER in closed else ""
    system = [m for m in messages[:1] if m.get("role") == "system"]
    return eot + render(tokenizer, system + [new], True, use_template), "alone"


# ----- prompt-cache files: the user's turn left open after a document ----------------------------
#: Between a prompt-cache file's document and the question that completes the user's message.
DOCUMENT_SEPARATOR = "\n\n"
#: Questions starting with a letter, a space, a line break, a digit, punctuation, a quote, a
#: non-ASCII letter: a file keeps only the tokens all their prompts share, so that where the
#: tokenizer joins the document's end to what follows (".\n\n" is one piece for Llama 3's
#: pre-tokenizer, "\n\n" before a letter two for GPT-2's) the join is left to the question.
PROBES = ("What", " Which", "who", "\n", "\n\nQ", "1.", "?", '"', "-", "(", "\u00e9t\u00e9", "\u6771")


def template_id(tokenizer: Any) -> Optional[str]:
    """sha256 of the model's chat template text, or None where it has none."""
    if not has_template(tokenizer):
        return None
    return hashlib.sha256(str(wrapper_of(tokenizer).chat_template).encode()).hexdigest()


@dataclass(frozen=True)
class PromptTurn:
    """Where a prompt-cache file's tokens stand in the chat format (the file's `chat` record).

    `template`: `template_id` of the chat template the tokens were made with; None: raw text.
    `turn`: "text" (raw text, continued as written), "user" (cache-prompt: the system message,
    if any, then the user's message opened by `document`; a question completes and closes it)
    or "reply" (the assistant's reply as far as it was generated: `sample --save-prompt-cache`
    after a templated prompt)."""
    template: Optional[str] = None
    turn: str = "text"
    system: Optional[str] = None
    document: Optional[str] = None

    TURNS = ("text", "user", "reply")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "PromptTurn":
        """The record read back; ValueError names what is wrong with it."""
        if not isinstance(d, dict) or set(d) - {"template", "turn", "system", "document"}:
            raise ValueError(f"chat record {d!r}")
        turn = cls(d.get("template"), d.get("turn", "text"), d.get("system"), d.get("document"))
        strings = (turn.template, turn.system, turn.document)
        if turn.turn not in cls.TURNS or any(v is not None and not isinstance(v, str) for v in strings) \
                or (turn.turn != "text") != (turn.template is not None) \
                or (turn.turn == "user") != (turn.document is not None):
            raise ValueError(f"chat record {d!r}")
        return turn

    @property
    def templated(self) -> bool:
        return self.template is not None

    def message(self, prompt: str) -> str:
        """The user's message `prompt` completes (an open "user" turn): the document, a blank
        line, the prompt; a prompt that repeats the document at its start (then whitespace, or
        nothing) is the whole message."""
        doc = self.document or ""
        if prompt.startswith(doc) and (len(prompt) == len(doc) or prompt[len(doc)].isspace()):
            return prompt
        return doc + DOCUMENT_SEPARATOR + prompt

    def prompt_ids(self, tokenizer: Any, prompt: str) -> list[int]:
        """The whole one-shot prompt's ids: `sample --prompt MESSAGE [--system SYSTEM]`'s."""
        return user_prompt_ids(tokenizer, self.message(prompt), self.system)


def open_turn(tokenizer: Any, document: str, system: Optional[str] = None) -> tuple[list[int], PromptTurn]:
    """A templated prompt-cache file's tokens and record: the document (trailing whitespace
    dropped) opens the user's message; the tokens are those every `PROBES` question's whole
    prompt starts with (the template's head and the document, up to where the tokenizer might
    join the document's end to what follows)."""
    turn = PromptTurn(template_id(tokenizer), "user", system, document.rstrip())
    runs = [user_prompt_ids(tokenizer, turn.document + DOCUMENT_SEPARATOR + q, system) for q in PROBES]
    n = min(len(r) for r in runs)
    for r in runs[1:]:
        n = next((i for i in range(n) if r[i] != runs[0][i]), n)
    return runs[0][:n], turn
