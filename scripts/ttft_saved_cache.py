"""Time to first token of questions answered from a saved Shard cache, against a fresh prefill.

Run from the repository root after `kvshrink compress --method shard --prompt-file
examples/document/essays-8k.txt --out /tmp/essays-8k.kvs` (README, "One document, many questions"):

    .venv/bin/python scripts/ttft_saved_cache.py /tmp/essays-8k.kvs

The document is 7,900 tokens of the Paul Graham essays with three facts planted at 20/55/85% depth;
examples/document/questions.txt asks for them. One torch thread.
"""
import sys
import time

import torch

import kvshrink
from kvshrink.cache.persist import load_cache
from kvshrink.cli import answer_from, document_prompt, prefill, question_ids

torch.set_num_threads(1)
path = sys.argv[1]
m, tok = kvshrink.load_model()
doc = open("examples/document/essays-8k.txt").read()
questions = open("examples/document/questions.txt").read().splitlines()
prefix, template = document_prompt(tok, doc)
kvshrink.make_cache("shard", m)  # one-time set-up of the process, outside both timings
t = time.perf_counter(); c = load_cache(path, m); load = time.perf_counter() - t
print(f"load {load:.2f} s, {c.summary()}", flush=True)
for q in questions:
    text, ttft = answer_from(m, tok, c.fork(), prefix, question_ids(tok, template, q), 16)
    print(f"fork TTFT {ttft:.2f} s: {q} -> {text}", flush=True)
fresh = kvshrink.make_cache("shard", m)
t = time.perf_counter()
prefill(m, fresh, torch.tensor([prefix]), 8192)
text, ttft = answer_from(m, tok, fresh, prefix, question_ids(tok, template, questions[0]), 16, t)
print(f"fresh one-call prefill + Q1 TTFT {ttft:.2f} s -> {text}", flush=True)
