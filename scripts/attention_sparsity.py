"""How much of a decode step's attention an exact "skip tokens whose score cannot matter" rule could ever skip: one
step of the embedded model with the full cache after LENGTH prompt tokens, eager attention, and for gaps T of
10-30 nats the share of the middle tokens (past the first 4, before the last 512) whose probability is below
exp(-T) times the row's largest, per layer (mean over heads) and overall. A bound exact to float32 needs T of about
25 + ln(LENGTH) nats. Usage:
    PYTHONPATH=src .venv/bin/python scripts/attention_sparsity.py LENGTH
(docs/results.md, "Session 25")."""
import sys

import torch
from transformers import DynamicCache

from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.tasks import TokenCorpus

torch.set_num_threads(2)
length = int(sys.argv[1])
model, tokenizer = KVShrinkBackend(None).load_model()
ids = TokenCorpus(tokenizer).ids[:length]
with torch.no_grad():
    cache = DynamicCache()
    out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    model.set_attn_implementation("eager")
    step = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True, output_attentions=True)
for gap in (10, 15, 20, 25, 30):
    shares = []
    for probs in step.attentions:                              # [1, heads, 1, length + 1]
        logp = probs[0, :, 0].double().clamp_min(1e-300).log()
        below = (logp.max(-1, keepdim=True).values - logp)[:, 4:-512] > gap
        shares.append(below.double().mean(-1))
    shares = torch.stack(shares)
    print(f"gap {gap} nats: {shares.mean():.3f} of middle tokens skippable; per layer "
          + " ".join(f"{x:.2f}" for x in shares.mean(-1)))
