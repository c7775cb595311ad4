import time, torch
torch.set_num_threads(1)
import kvshrink
from kvshrink.cli import document_prompt, question_ids, answer_from, prefill
from kvshrink.cache.persist import load_cache
m, tok = kvshrink.load_model()
doc = open('doc8k.txt').read()
prefix, template = document_prompt(tok, doc)
kvshrink.make_cache("shard", m)  # one-time set-up
t = time.perf_counter(); c = load_cache('doc8k.kvs', m); load = time.perf_counter() - t
print(f"load {load:.2f} s, {c.summary()}", flush=True)
for q in open('q8k.txt').read().splitlines():
    text, ttft = answer_from(m, tok, c.fork(), prefix, question_ids(tok, template, q), 16)
    print(f"fork TTFT {ttft:.2f} s: {q} -> {text}", flush=True)
fresh = kvshrink.make_cache("shard", m)
t = time.perf_counter()
prefill(m, fresh, torch.tensor([prefix]), 8192)
text, ttft = answer_from(m, tok, fresh, prefix, question_ids(tok, template, open('q8k.txt').read().splitlines()[0]), 16, t)
print(f"fresh one-call prefill + Q1 TTFT {ttft:.2f} s -> {text}", flush=True)
