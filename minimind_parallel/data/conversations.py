"""A conversation corpus that every machine already has: questions about the Python standard
library answered by its docstrings, written as MiniMind's SFT jsonl (one
`{"conversations": [{"role": ..., "content": ...}, ...]}` per line).

Each documented module, class, function, method and property of the pretraining corpus
(`data.corpus`, in its order) gives one question ("What does os.path.join do?", phrased one of a
few ways, chosen by the entry's position) answered by the first paragraph of its docstring (its
lines joined, cut at a sentence end near MAX_ANSWER_CHARS). Every FOLLOW_UP_EVERY-th row asks the
next entry as a second turn, and every SYSTEM_EVERY-th row opens with a system turn, so the rows
exercise multi-turn masking and system prompts. `posixpath` (what `os.path` is on this platform)
is asked about as `os.path`. The file is the same on every run of the same Python build.

    python -m minimind_parallel.data.conversations --out data/conversations.jsonl [--max_rows N]
"""
from __future__ import annotations

import argparse
import re
import warnings
from collections.abc import Iterator

from .corpus import MIN_DOC_CHARS, module_documents, stdlib_modules
from .jsonl import write_jsonl

MAX_ANSWER_CHARS = 240
FOLLOW_UP_EVERY = 5
SYSTEM_EVERY = 7
SYSTEM_PROMPT = "You answer questions about the Python standard library."
ALIASES = {"posixpath": "os.path"}   # the module a user names, for the one that defines it
QUESTIONS = ("What does {name} do?", "Explain {name}.", "What is {name} for?")
MODULE_QUESTIONS = ("What is the {name} module for?", "Explain the {name} module.")


def first_paragraph(doc: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """The docstring's first paragraph on one line, cut after the last sentence that ends within
    `limit` characters (or at `limit` when no sentence does)."""
    paragraph = " ".join(line.strip() for line in doc.split("\n\n")[0].splitlines())
    if len(paragraph) <= limit:
        return paragraph
    ends = [m.end() for m in re.finditer(r"[.!?](\s|$)", paragraph[:limit + 1])]
    return paragraph[:ends[-1]].strip() if ends else paragraph[:limit].rstrip()


def public_name(name: str) -> str:
    for module, alias in ALIASES.items():
        if name == module or name.startswith(module + "."):
            return alias + name[len(module):]
    return name


def question_answers() -> Iterator[tuple[str, str]]:
    """(question, answer) for each documented entry, in corpus order, each docstring once."""
    seen: set[str] = set()
    k = 0
    for module in stdlib_modules():
        for name, doc in module_documents(module):
            if doc is None or len(doc) < MIN_DOC_CHARS or doc in seen or " at 0x" in doc or name.startswith("help "):
                continue
            seen.add(doc)
            answer = first_paragraph(doc)
            if not answer:
                continue
            phrasings = MODULE_QUESTIONS if name == module.__name__ else QUESTIONS
            yield phrasings[k % len(phrasings)].format(name=public_name(name)), answer
            k += 1


def conversations(max_rows: int | None = None) -> Iterator[list[dict]]:
    """The rows: one question and answer each, a second one every FOLLOW_UP_EVERY-th, a system turn
    every SYSTEM_EVERY-th."""
    pairs = question_answers()
    row = 0
    for question, answer in pairs:
        if max_rows is not None and row >= max_rows:
            return
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if row % SYSTEM_EVERY == SYSTEM_EVERY - 1 else []
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if row % FOLLOW_UP_EVERY == FOLLOW_UP_EVERY - 1:
            follow = next(pairs, None)
            if follow is not None:
                messages += [{"role": "user", "content": follow[0]}, {"role": "assistant", "content": follow[1]}]
        row += 1
        yield messages


def write_conversations(path: str, *, max_rows: int | None = None) -> int:
    """Write the corpus to `path` atomically as jsonl; returns the number of rows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading deprecated attributes warns
        return write_jsonl(path, ({"conversations": messages} for messages in conversations(max_rows)))

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the jsonl file to write")
    parser.add_argument("--max_rows", type=int, default=None, help="at most this many conversations")
    args = parser.parse_args(argv)
    print(f"wrote {write_conversations(args.out, max_rows=args.max_rows)} conversations to {args.out}")


if __name__ == "__main__":
    main()
