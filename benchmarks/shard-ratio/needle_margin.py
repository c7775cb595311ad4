"""How close each answer is to going wrong: NIAH needle prompts (the essay grid of ``kvshrink eval niah``) or
RULER prompts (``kvshrink eval ruler``), answered greedily by ``full``; each spec then reads the same prompt and
is teacher-forced along ``full``'s answer. At each answer step the margin is the log-probability of ``full``'s
token less the best other token's, in nats. A NIAH answer's steps are the value's digits and the token after
them; a RULER answer's are the tokens that spell the expected items ``full`` wrote (a variable name, a word).
An answer's margin is the smallest over its steps. A negative margin is an answer the spec gives differently;
a pass or a miss alone does not say how near it was.

    python benchmarks/shard-ratio/needle_margin.py LENGTH SEEDS PROMPTS OUT.jsonl SPEC [SPEC ...]

SEEDS and PROMPTS are comma lists: the suite's seeds (``0,1,2``), and needle depths in percent (``20,50,80``)
or RULER subtasks (``vt,niah_multikey``; the first sample of each). ``MODEL`` (environment): ``smol`` (the
embedded SmolLM2-135M-Instruct, the default) or a model path; float32. ``THREADS`` (environment) sets torch's
threads (default 2). Each prompt is prefilled once for all specs (``kvshrink.eval.fanout``: prefill attention is
exact in every method). One JSON line per prompt is appended to OUT.jsonl: ``full``'s answer and margin, each
spec's margin, and each spec's ratio after the prompt.

    python benchmarks/shard-ratio/needle_margin.py table OUT.jsonl

draws the results as a table: a row per prompt, the mean over the answers ``full`` gets right, and how many of
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
from kvshrink.eval.fanout import FanoutCache
from kvshrink.eval.tasks import Builder

NIAH_STEPS = 9  # a space, seven digits and the token after them


def answer(model, logits: torch.Tensor, cache, steps: int, stop: int | None = None,
           forced: list[int] | None = None) -> tuple[list[int], list[float]]:
    """Up to ``steps`` tokens after the prompt whose last ``logits`` are given (greedy, ending at ``stop``, or
    ``forced``) and, at each, the margin of the token taken."""
    tokens, margins = [], []
    with torch.no_grad():
        while len(tokens) < (steps if forced is None else len(forced)):
            logprobs = logits[0, -1].float().log_softmax(-1)
            token = int(logprobs.argmax()) if forced is None else forced[len(tokens)]
            others = logprobs.clone()
            others[token] = -float("inf")
            tokens.append(token)
            margins.append(float(logprobs[token] - others.max()))
            if token == stop and forced is None:
                break
            logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
    return tokens, margins


def digit_steps(tok, tokens: list[int]) -> list[int]:
    """The steps from the first token holding a digit to the one after the last (the value and its end)."""
    digits = [i for i, t in enumerate(tokens) if any(c.isdigit() for c in tok.decode([t]))]
    return list(range(min(digits), min(max(digits) + 2, len(tokens)))) if digits else []


def item_steps(tok, tokens: list[int], expected: list[str]) -> list[int]:
    """The steps whose tokens spell the first occurrence of each of ``expected`` in the decoded answer."""
    ends = [len(tok.decode(tokens[:i + 1])) for i in range(len(tokens))]
    text, steps = tok.decode(tokens), set()
    for item in expected:
        start = text.find(item)
        if start < 0:
            continue
        stop = start + len(item)
        steps.update(i for i, end in enumerate(ends) if end > start and end - len(tok.decode([tokens[i]])) < stop)
    return sorted(steps)


def prompt_of(builder: Builder, length: int, prompt: str):
    """The NIAH sample at depth ``prompt`` (a number) or the first sample of RULER subtask ``prompt``."""
    try:
        depth = float(prompt)
    except ValueError:   # not a number: a subtask name (an unknown one is refused by name)
        return builder.ruler(prompt, length)
    return builder.niah(length, depth)


def measure(model, tok, sample, specs: list[str]) -> dict:
    """One record: ``full``'s answer to ``sample`` and its margin, and each spec's margin and ratio."""
    ids = torch.tensor([sample.input_ids])
    caches = [kvshrink.make_cache(method, model, **options)
              for method, options in (parse_method_spec(spec) for spec in specs)]
    full = DynamicCache()
    with torch.no_grad():
        logits = model(ids, past_key_values=FanoutCache([full, *caches]), use_cache=True, logits_to_keep=1).logits
    niah = sample.task == "niah"
    tokens, margins = answer(model, logits, full, NIAH_STEPS if niah else sample.max_new_tokens, tok.eos_token_id)
    steps = digit_steps(tok, tokens) if niah else item_steps(tok, tokens, sample.expected)
    record = dict(expected=sample.expected[0] if niah else sample.expected, full=tok.decode(tokens),
                  full_min=min(margins[i] for i in steps) if steps else None, specs={},
                  ratios={spec: round(cache.compression_ratio(), 3) for spec, cache in zip(specs, caches)})
    for spec, cache in zip(specs, caches):
        _, margins = answer(model, logits, cache, 0, forced=tokens)
        record["specs"][spec] = round(min(margins[i] for i in steps), 3) if steps else None
    return record


def found(record: dict) -> bool:
    """Whether ``full`` answered right (every expected item, for RULER)."""
    expected = record["expected"]
    return all(item in record["full"] for item in ([expected] if isinstance(expected, str) else expected))


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    specs = list(rows[0]["specs"])
    print("| seed, prompt | full's answer (margin) | " + " | ".join(f"`{s}`" for s in specs) + " |")
    print("| --- " * (2 + len(specs)) + "|")
    for r in rows:
        prompt = f"{r['depth']:g}%" if r.get("subtask") is None else r["subtask"]
        full_min = "-" if r["full_min"] is None else f"{r['full_min']:.2f}"
        print(f"| {r['seed']}, {prompt} | `{r['full'].strip()[:24]}` {'found' if found(r) else 'missed'} "
              f"({full_min}) | " + " | ".join("-" if r["specs"][s] is None else f"{r['specs'][s]:.2f}"
                                              for s in specs) + " |")
    right = [r for r in rows if found(r) and r["full_min"] is not None]
    if not right:
        return
    print("| mean over full's finds | | " + " | ".join(
        f"{statistics.mean(r['specs'][s] for r in right):.2f}" for s in specs) + " |")
    print("| answered otherwise | | " + " | ".join(str(sum(r["specs"][s] < 0 for r in right)) for s in specs) + " |")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "table":
        return table(argv[1])
    if len(argv) < 5:
        raise SystemExit(__doc__)
    length, out, specs = int(argv[0]), argv[3], argv[4:]
    seeds, prompts = [int(s) for s in argv[1].split(",")], argv[2].split(",")
    torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    name = os.environ.get("MODEL", "smol")
    model, tok = kvshrink.load_model(None if name == "smol" else name, dtype="float32")
    for seed in seeds:
        builder = Builder(tok, seed=seed)
        for prompt in prompts:
            sample = prompt_of(builder, length, prompt)
            record = dict(seed=seed, depth=sample.depth, subtask=None if sample.task == "niah" else sample.subtask,
                          **measure(model, tok, sample, specs))
            print(json.dumps(record), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
