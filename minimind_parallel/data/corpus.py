"""A pretraining corpus that every machine already has: the documentation strings of Python's
standard library, written as MiniMind-style jsonl (one `{"text": ...}` per line).

One document per documented object (module, public class, function, method or property defined in
that module): its qualified name, a blank line, then its cleaned docstring; and one per topic of
the language reference that `help()` shows (`pydoc_data.topics`). Modules are visited in
sorted order, packages depth first, members sorted by name, and identical docstrings kept once, so
the file is the same on every run of the same Python build (which optional extension modules a
build has can change which modules import).

    python -m minimind_parallel.data.corpus --out data/stdlib.jsonl [--max_docs N] [--max_bytes B]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import pkgutil
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

from .jsonl import write_jsonl

# Modules never imported: side effects on import (open a browser, print, start IDLE, write grammar
# caches into the install), slow test suites, or content that depends on what else is installed.
SKIPPED_MODULES = frozenset({
    "antigravity", "this", "idlelib", "turtledemo", "turtle", "tkinter", "lib2to3", "distutils",
    "ensurepip", "venv", "test", "tests", "encodings", "xxsubtype", "xxlimited",
})
MIN_DOC_CHARS = 40  # shorter docstrings ("Return self==value.") teach little


def _skipped(name: str) -> bool:
    return any(part.startswith("_") or part in SKIPPED_MODULES for part in name.split("."))


def _import_quietly(name: str) -> ModuleType | None:
    """The module, or None when it fails to import (wrong platform, missing extension, exits)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except (Exception, SystemExit):
            return None


def stdlib_modules() -> Iterator[ModuleType]:
    """Public standard-library modules that import, in sorted order, each package before its submodules."""
    def visit(name: str) -> Iterator[ModuleType]:
        module = None if _skipped(name) else _import_quietly(name)
        if module is None:
            return
        yield module
        for sub in sorted(m.name for m in pkgutil.iter_modules(getattr(module, "__path__", None) or [])):
            yield from visit(f"{name}.{sub}")

    for top in sorted(sys.stdlib_module_names):
        yield from visit(top)


def _own_doc(obj) -> str | None:
    """The object's own docstring, cleaned (inspect.getdoc would inherit a base class's)."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else None


def _members(owner, module_name: str) -> Iterator[tuple[str, object]]:
    """Public classes and functions defined in `module_name`, and the methods and properties of classes."""
    for name in sorted(vars(owner)):
        obj = vars(owner)[name]
        if name.startswith("_"):
            continue
        if isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
        if isinstance(obj, property) or (inspect.isroutine(obj) and inspect.isclass(owner)):
            yield name, obj
        elif (inspect.isclass(obj) or inspect.isroutine(obj)) and getattr(obj, "__module__", None) == module_name:
            yield name, obj
            if inspect.isclass(obj):
                yield from ((f"{name}.{sub}", member) for sub, member in _members(obj, module_name))


def module_documents(module: ModuleType) -> Iterator[tuple[str, str]]:
    """(qualified name, cleaned docstring) of the module and of what it defines."""
    yield module.__name__, _own_doc(module)
    if module.__name__ == "pydoc_data.topics":  # the language reference's help() topics, as plain text
        yield from ((f"help topic {name}", inspect.cleandoc(text)) for name, text in sorted(module.topics.items()))
    for name, obj in _members(module, module.__name__):
        yield f"{module.__name__}.{name}", _own_doc(obj)


def stdlib_documents(*, max_docs: int | None = None, max_bytes: int | None = None) -> Iterator[str]:
    """Document texts in corpus order, each docstring once, until a cap on documents or utf-8 bytes."""
    seen: set[str] = set()
    count = size = 0
    for module in stdlib_modules():
        for name, doc in module_documents(module):
            # " at 0x" marks a repr with a memory address (an auto-generated dataclass doc): not reproducible
            if doc is None or len(doc) < MIN_DOC_CHARS or doc in seen or " at 0x" in doc:
                continue
            seen.add(doc)
            text = f"{name}\n\n{doc}"
            size += len(text.encode("utf-8"))
            if (max_docs is not None and count >= max_docs) or (max_bytes is not None and size > max_bytes):
                return
            count += 1
            yield text


def write_corpus(path: str, *, max_docs: int | None = None, max_bytes: int | None = None) -> int:
    """Write the corpus to `path` atomically as jsonl; returns the number of documents."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading deprecated attributes (typing.io) warns
        return write_jsonl(path, ({"text": text} for text in stdlib_documents(max_docs=max_docs, max_bytes=max_bytes)))

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the jsonl file to write")
    parser.add_argument("--max_docs", type=int, default=None, help="at most this many documents")
    parser.add_argument("--max_bytes", type=int, default=64 << 20, help="at most this many bytes of text")
    args = parser.parse_args(argv)
    count = write_corpus(args.out, max_docs=args.max_docs, max_bytes=args.max_bytes)
    print(f"wrote {count} documents to {args.out}")


if __name__ == "__main__":
    main()
