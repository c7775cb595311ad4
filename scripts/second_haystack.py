"""A needle check on a second haystack, written so a Shard setting is not tuned to the standard grid:
the haystack is the plain-text documentation of Python standard-library modules (not the essays), the
needle and question are worded differently from the grid's "special magic number", and the depths
are offset from the grid's. For each depth: the full cache's greedy answer and each spec's, and
whether the needle's 7 digits are in it. Usage:

    PYTHONPATH=src .venv/bin/python scripts/second_haystack.py LENGTH SPEC [SPEC ...]
"""

from __future__ import annotations

import pydoc
import random
import sys
import importlib

import torch

import kvshrink
from kvshrink.eval.tasks import chat_ids, fit_to_length
from kvshrink.eval.data import insert_at_depth

MODULES = ("argparse", "collections", "json", "logging", "textwrap", "threading", "subprocess", "shutil",
           "pathlib", "datetime", "functools", "itertools", "csv", "heapq", "zipfile", "tarfile")
PLACES = ("Harbour Street", "Linden Hill", "Marsh Gate", "Oakridge", "Quarry Lane", "Willow Bend")
DEPTHS = (10, 30, 55, 70, 90)


def haystack() -> str:
    text = []
    for name in MODULES:
        doc = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        text.append(" ".join(line.strip() for line in doc.splitlines() if line.strip()))
    return "\n\n".join(text)


def prompt(tok, length: int, depth: int, seed: int = 1) -> tuple[list[int], str]:
    rng = random.Random(f"second-haystack:{length}:{depth}:{seed}")
    place, code = rng.choice(PLACES), str(rng.randint(1_000_000, 9_999_999))
    needle = f"Note for staff: the door code of the {place} archive room is {code}."
    words = haystack().split(" ")

    def build(n: int):
        context = insert_at_depth(" ".join(words[:n]), needle, depth / 100)
        user = (f"Below is a long technical manual. Somewhere in it is a note about a door code.\n\n{context}\n\n"
                f"What is the door code of the {place} archive room? Reply with the code only.")
        return chat_ids(tok, user, f"The door code of the {place} archive room is"), [code]

    ids, (code,) = fit_to_length(build, length, guess=length // 2)
    return ids, code


def main() -> None:
    length, specs = int(sys.argv[1]), ["full", *sys.argv[2:]]
    torch.set_num_threads(2)
    model, tok = kvshrink.load_model()
    found = {s: [] for s in specs}
    for depth in DEPTHS:
        ids, code = prompt(tok, length, depth)
        x = torch.tensor([ids])
        for spec in specs:
            name, options = kvshrink.parse_method_spec(spec)
            cache = kvshrink.make_cache(name, model, **options)
            with torch.no_grad():
                out = model.generate(x, attention_mask=torch.ones_like(x), past_key_values=cache,
                                     max_new_tokens=16, do_sample=False)
            answer = tok.decode(out[0, x.shape[1]:], skip_special_tokens=True).strip()
            found[spec].append(code in answer)
            print(f"L={len(ids)} depth={depth:3d} code={code} {spec:45s} {'FOUND' if code in answer else 'miss '} "
                  f"{cache.nbytes() / 2**20:7.2f} MiB  {answer!r}", flush=True)
    for spec in specs:
        same = found[spec] == found["full"]
        print(f"{spec:45s} found {sum(found[spec])}/{len(DEPTHS)}  {'same needles as full' if same else 'DIFFERS from full'}")


if __name__ == "__main__":
    main()
