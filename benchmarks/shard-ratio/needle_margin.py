"""How close each NIAH answer is to going wrong: the needle prompts of ``kvshrink eval niah`` (the essay grid),
answered greedily by ``full``; each spec then reads the same prompt and is teacher-forced along ``full``'s answer.
At each answer step (the value's digits and the token after them) the margin is the log-probability of
``full``'s token less the best other token's, in nats; a needle's margin is the smallest over its steps. A
negative margin is a needle the spec answers differently; a pass or a miss alone does not say how near it was.

    python benchmarks/shard-ratio/needle_margin.py LENGTH SEEDS DEPTHS OUT.jsonl SPEC [SPEC ...]

SEEDS and DEPTHS are comma lists (``0,1,2`` and ``20,50,80``: the suite's seed and its needle depths in
percent). On the embedded model, float32; ``THREADS`` (environment) sets torch's threads (default 2). One JSON
line per needle is appended to OUT.jsonl: ``full``'s answer and margin, and each spec's margin.

    python benchmarks/shard-ratio/needle_margin.py table OUT.jsonl

draws the results as a table: a row per needle, the mean over the needles ``full`` finds, and how many of
those each spec answers differently.
"""
import json
import os
import statistics
import sys

import torch
from transformers import DynamicCache

import kvshrink
from kvshrink.cache import parse_method_spec
from kvshrink.eval.tasks import Builder

STEPS = 9  # a space, seven digits and the token after them


def answer(model, ids: torch.Tensor, cache, forced: list[int] | None = None) -> tuple[list[int], list[float]]:
    """``STEPS`` tokens after ``ids`` (greedy, or ``forced``) and, at each, the margin of the token taken."""
    tokens, margins = [], []
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        for step in range(STEPS):
            logprobs = logits[0, -1].float().log_softmax(-1)
            token = int(logprobs.argmax()) if forced is None else forced[step]
            others = logprobs.clone()
            others[token] = -float("inf")
            tokens.append(token)
            margins.append(float(logprobs[token] - others.max()))
            if step + 1 < STEPS:
                logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
    return tokens, margins


def answer_steps(tok, tokens: list[int]) -> list[int]:
    """The steps from the first token holding a digit to the one after the last (the value and its end)."""
    digits = [i for i, t in enumerate(tokens) if any(c.isdigit() for c in tok.decode([t]))]
    return list(range(min(digits), min(max(digits) + 2, len(tokens)))) if digits else []


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    specs = list(rows[0]["specs"])
    print("| seed, depth | full's answer (margin) | " + " | ".join(f"`{s}`" for s in specs) + " |")
    print("| --- " * (2 + len(specs)) + "|")
    for r in rows:
        found = "found" if r["expected"] in r["full"] else "missed"
        print(f"| {r['seed']}, {r['depth']:g}% | `{r['full'].strip()[:9]}` {found} ({r['full_min']:.2f}) | "
              + " | ".join(f"{r['specs'][s]:.2f}" for s in specs) + " |")
    found = [r for r in rows if r["expected"] in r["full"]]
    if not found:
        return
    print("| mean over full's finds | | " + " | ".join(
        f"{statistics.mean(r['specs'][s] for r in found):.2f}" for s in specs) + " |")
    print("| answered otherwise | | " + " | ".join(str(sum(r["specs"][s] < 0 for r in found)) for s in specs) + " |")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "table":
        return table(argv[1])
    if len(argv) < 5:
        raise SystemExit(__doc__)
    length, out, specs = int(argv[0]), argv[3], argv[4:]
    seeds, depths = [int(s) for s in argv[1].split(",")], [float(d) for d in argv[2].split(",")]
    torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    model, tok = kvshrink.load_model(None, dtype="float32")
    for seed in seeds:
        builder = Builder(tok, seed=seed)
        for depth in depths:
            sample = builder.niah(length, depth)
            ids = torch.tensor([sample.input_ids])
            tokens, margins = answer(model, ids, DynamicCache())
            steps = answer_steps(tok, tokens)
            record = dict(seed=seed, depth=depth, expected=sample.expected[0],
                          full=tok.decode(tokens), full_min=min(margins[i] for i in steps) if steps else None,
                          specs={})
            for spec in specs:
                method, options = parse_method_spec(spec)
                _, spec_margins = answer(model, ids, kvshrink.make_cache(method, model, **options), tokens)
                record["specs"][spec] = round(min(spec_margins[i] for i in steps), 3) if steps else None
            print(json.dumps(record), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
