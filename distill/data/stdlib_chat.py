"""A chat corpus every Python installation already holds: questions about the standard
library's public functions and classes, answered from their own docstrings
(`data.source: "{stdlib_chat}"`), so chat runs work with no download.

The modules are read as source with `ast`, never imported. Each conversation is about one
module: a system turn, then one or two questions (what a function or class does, how it
is called), each answered by the docstring's first paragraph or by the signature as the
source writes it. The corpus is the same for the same interpreter (sorted files, a seeded
choice of phrasings) and is written once, atomically, to `corpus_path()`'s cache file.
"""

from __future__ import annotations

import ast
import os
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from distill import storage
from distill.observability.metrics_log import dumps

PLACEHOLDER = "{stdlib_chat}"
VERSION = 1  # bump when the conversations change: a new cache file
SYSTEM = "Answer questions on the Python standard library."
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib",
             "turtledemo", "lib2to3", "ensurepip", "pydoc_data"}  # fmt: skip
MAX_ANSWER = 400  # characters of a docstring's first paragraph kept
WHAT = ("What does `{name}` do?", "Explain `{name}`.", "What is `{name}` for?",
        "In the Python standard library, what does `{name}` do?")  # fmt: skip
HOW = ("How do I call `{name}`?", "What is the signature of `{name}`?",
       "Which arguments does `{name}` take?")  # fmt: skip


def corpus_path(stdlib: str | None = None) -> Path:
    """The JSONL file of the corpus, written on first use under `distill.storage.cache_dir`,
    one per standard library."""
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    tag = re.sub(r"[^A-Za-z0-9.]+", "-", Path(stdlib).resolve().as_posix()).strip("-")
    path = storage.cache_dir() / f"stdlib-chat-v{VERSION}-{tag}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for record in conversations(Path(stdlib)):
                f.write(dumps(record, ensure_ascii=False) + "\n")
        tmp.replace(path)  # readers see the whole file or none
    return path


def conversations(stdlib: Path, seed: int = 0) -> Iterator[dict]:
    """{"messages": [...]} records, one or more per module with documented names."""
    rng = random.Random(seed)
    for file in _modules(stdlib):
        module = _module_name(stdlib, file)
        facts = list(_facts(file, module))
        while facts:
            n = rng.randint(1, 2)
            take, facts = facts[:n], facts[n:]
            messages = [{"role": "system", "content": SYSTEM}]
            for name, doc, signature in take:
                if signature and rng.random() < 0.3:
                    q, a = rng.choice(HOW), f"`{name}{signature}`"
                else:
                    q, a = rng.choice(WHAT), doc
                messages += [{"role": "user", "content": q.format(name=name)},
                             {"role": "assistant", "content": a}]  # fmt: skip
            yield {"messages": messages}


def _modules(stdlib: Path) -> list[Path]:
    """The standard library's public module files, in sorted order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("_"))
        found += [
            Path(dirpath) / n
            for n in filenames
            if n.endswith(".py") and (n[0] != "_" or n == "__init__.py")
        ]
    return sorted(found, key=lambda p: p.as_posix())


def _module_name(stdlib: Path, file: Path) -> str:
    """`json/__init__.py` -> `json`, `json/decoder.py` -> `json.decoder`."""
    parts = file.relative_to(stdlib).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _facts(file: Path, module: str) -> Iterator[tuple[str, str, str | None]]:
    """(qualified name, its docstring's first paragraph, its signature or None) of each
    documented public function, class and method of `file`, in source order."""
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in tree.body:
        yield from _documented(node, module)
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for member in node.body:
                yield from _documented(member, f"{module}.{node.name}")


def _documented(node, prefix: str) -> Iterator[tuple[str, str, str | None]]:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return
    if node.name.startswith("_"):
        return
    doc = _first_paragraph(ast.get_docstring(node) or "")
    if len(doc) < 20:
        return
    signature = None
    if not isinstance(node, ast.ClassDef):
        args = ast.unparse(node.args)
        signature = f"({args.removeprefix('self, ').removeprefix('self')})"
    yield f"{prefix}.{node.name}", doc, signature


def _first_paragraph(doc: str) -> str:
    """The docstring's first paragraph on one line, cut at a sentence end past MAX_ANSWER."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    if len(text) > MAX_ANSWER:
        cut = text.rfind(". ", 0, MAX_ANSWER)
        text = text[: cut + 1] if cut > 0 else text[:MAX_ANSWER]
    return text
