"""Many workers answering questions about a few documents through one `CacheStore`.

    .venv/bin/python scripts/store_bench.py --store redis://127.0.0.1:6379/0 --workers 4 \\
        --questions 20 --docs 3 --out benchmarks/store/load-n4.json

The documents are slices of examples/document/essays-8k.txt (``--doc-chars`` each); question ``j`` is
about document ``j % docs`` and worker ``r`` asks questions ``j % workers == r``, all workers starting at
the same instant (after loading the model). For each question a worker takes the document's cache from the store
(`CacheStore.cache_for`: stored entry, or a prefill made once across workers) and answers greedily;
time to first token counts from before the store lookup. This process first answers every question
without a store (the single-process answers, and the time to first token of a fresh prefill),
then checks every worker's answer against it and counts prefills per document. Each run uses its own
store namespace. Prints one JSON summary; ``--out`` writes it with every worker's records.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

QUESTIONS = ["What is the main topic of this text?", "Summarize the text in one sentence.",
             "Which people are mentioned?", "What year is mentioned?", "What is the author's opinion?",
             "Name one example the text gives.", "What is the first word of the text?"]
ROOT = Path(__file__).resolve().parent.parent


def documents(count: int, chars: int) -> list[str]:
    text = (ROOT / "examples/document/essays-8k.txt").read_text()
    step = len(text) // max(count, 1)
    return [text[i * step:i * step + chars] for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def questions(count: int, docs: int) -> list[tuple[int, str]]:
    return [(j % docs, QUESTIONS[j % len(QUESTIONS)]) for j in range(count)]


def options_of(text: str) -> dict:
    from kvshrink.cache.option_text import parse_options

    return parse_options(text or "")


def worker(args) -> None:
    """One worker: its share of the questions, one JSON record per line on stdout."""
    import kvshrink
    from kvshrink.cli import answer_from, document_prompt, prefill, question_ids

    torch.set_num_threads(1)
    model, tok = kvshrink.load_model()
    options = options_of(args.option)
    kvshrink.make_cache(args.method, model, **options)  # the method's one-time set-up, before the clock
    store = kvshrink.CacheStore(args.store, namespace=args.namespace)
    docs = [document_prompt(tok, d) for d in documents(args.docs, args.doc_chars)]
    print(json.dumps({"ready": args.rank}), flush=True)
    sys.stdin.readline()  # every worker starts at once
    for j, (d, question) in enumerate(questions(args.questions, args.docs)):
        if j % args.workers != args.rank:
            continue
        prefix, template = docs[d]
        start = time.perf_counter()
        cache, how = store.cache_for(model, prefix, args.method,
                                     prefill=lambda m, c, ids: prefill(m, c, ids, args.chunk), **options)
        got = time.perf_counter() - start
        text, ttft = answer_from(model, tok, cache, prefix, question_ids(tok, template, question),
                                 args.max_new_tokens, start)
        print(json.dumps({"rank": args.rank, "question": j, "doc": d, "how": how, "cache_s": got,
                          "ttft_s": ttft, "answer": text}), flush=True)
    print(json.dumps({"rank": args.rank, "stats": {k: v for k, v in vars(store.stats).items()}}), flush=True)


def reference(args, model, tok) -> tuple[dict[int, str], list[float], list[dict]]:
    """Single-process answers (one prefill per document, a fork of it per question), the time to first
    token of a fresh prefill (document + its first question), and the bytes of each document's cache."""
    import kvshrink
    from kvshrink.cache.persist import cache_to_bytes
    from kvshrink.cli import answer_from, document_prompt, prefill, question_ids

    options = options_of(args.option)
    kvshrink.make_cache(args.method, model, **options)  # the method's one-time set-up, before the clock
    docs = [document_prompt(tok, d) for d in documents(args.docs, args.doc_chars)]
    asked = questions(args.questions, args.docs)
    answers, ttfts, sizes = {}, [], []
    for d, (prefix, template) in enumerate(docs):
        mine = [(j, q) for j, (doc, q) in enumerate(asked) if doc == d]
        start = time.perf_counter()
        cache = kvshrink.make_cache(args.method, model, **options)
        prefill(model, cache, torch.tensor([prefix]), args.chunk)
        for i, (j, question) in enumerate(mine):
            answers[j], ttft = answer_from(model, tok, cache.fork(), prefix, question_ids(tok, template, question),
                                           args.max_new_tokens, start if i == 0 else None)
            if i == 0:
                ttfts.append(ttft)
        sizes.append({"tokens": len(prefix), "fp16_bytes": cache.fp16_nbytes(),
                      "file_bytes": len(cache_to_bytes(cache)), "prefix": prefix})
    return answers, ttfts, sizes


def run(args) -> dict:
    import kvshrink

    torch.set_num_threads(1)
    model, tok = kvshrink.load_model()
    answers, fresh_ttfts, sizes = reference(args, model, tok)
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    common = [sys.executable, __file__, "--store", args.store, "--workers", str(args.workers),
              "--questions", str(args.questions), "--docs", str(args.docs), "--doc-chars", str(args.doc_chars),
              "--method", args.method, "--option", args.option, "--max-new-tokens", str(args.max_new_tokens),
              "--chunk", str(args.chunk), "--namespace", namespace]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    procs = [subprocess.Popen(common + ["--rank", str(r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env) for r in range(args.workers)]
    for p in procs:
        if not p.stdout.readline().startswith('{"ready"'):
            raise RuntimeError("a worker failed before it was ready")
    start = time.perf_counter()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    records, stats = [], []
    for p in procs:
        out, _ = p.communicate(timeout=args.timeout)
        if p.returncode != 0:
            raise RuntimeError(f"a worker failed with exit status {p.returncode}")
        for line in out.splitlines():
            rec = json.loads(line)
            (stats if "stats" in rec else records).append(rec)
    store = kvshrink.CacheStore(args.store, namespace=namespace)
    options = options_of(args.option)
    for s in sizes:
        info = store.entry_info(model, s.pop("prefix"), args.method, **options) or {}
        s["stored_bytes"] = info.get("stored_bytes")
        s["chunks"] = info.get("chunks")
    computed = {d: sum(1 for r in records if r["doc"] == d and r["how"] == "computed") for d in range(args.docs)}
    ttfts = [r["ttft_s"] for r in records]
    from_store = [r["ttft_s"] for r in records if r["how"] != "computed"]
    summary = {
        "store": args.store.split("://")[0] if "://" in args.store else "folder",
        "workers": args.workers, "questions": args.questions, "docs": args.docs, "method": args.method,
        "options": options, "max_new_tokens": args.max_new_tokens, "answered": len(records),
        "hits": sum(r["how"] == "hit" for r in records), "waited": sum(r["how"] == "waited" for r in records),
        "computed": sum(r["how"] == "computed" for r in records), "computed_per_doc": computed,
        "answers_equal_single_process": all(r["answer"] == answers[r["question"]] for r in records),
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p95_s": percentile(ttfts, 0.95),
        "ttft_from_store_p50_s": percentile(from_store, 0.5) if from_store else None,
        "ttft_from_store_p95_s": percentile(from_store, 0.95) if from_store else None,
        "ttft_fresh_prefill_p50_s": percentile(fresh_ttfts, 0.5), "ttft_fresh_prefill_p95_s": percentile(fresh_ttfts, 0.95),
        "bytes_per_doc": sizes,
        "wall_s": time.perf_counter() - start,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"summary": summary, "records": records, "worker_stats": stats},
                                             indent=1) + "\n")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--doc-chars", type=int, default=1200)
    p.add_argument("--method", default="shard")
    p.add_argument("--option", default="")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=None)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--namespace", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        worker(args)
    else:
        print(json.dumps(run(args), indent=1))


if __name__ == "__main__":
    main()
