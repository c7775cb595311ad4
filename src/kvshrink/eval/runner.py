"""Running a suite: build the samples once, run every method spec on each, write rows as they finish."""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from . import cost as cost_task
from .backend import KVShrinkBackend, cache_figures
from .engine import eos_token_ids, greedy_decode, score_continuation
from .results import RowWriter, now, prompt_digest, read_rows, row_key
from .scoring import distribution_agreement, free_running_kl, perplexity, score_answer, token_agreement
from .suites import Suite
from .tasks import Builder, Sample

REFERENCE = "full"
COMPARED_METRICS = ("ppl", "agreement")  # tasks whose rows compare next-token distributions with full's
ANSWER_CHARS = 300


@dataclass
class RunOptions:
    seed: int = 0
    max_new_tokens: int | None = None  # NIAH/RULER answer budget override
    limit: int | None = None           # at most this many samples per task
    threads: int | None = None
    model_ref: str | None = None
    device: str | None = None          # e.g. "cuda" (default: CPU)
    dtype: str | None = None           # model dtype: float32 (default), bfloat16, float16
    progress: bool = True
    interleave: bool = False           # cost: every method in one process per repeat, one step of each in turn


def with_reference(specs: list[str]) -> list[str]:
    """``full`` first (every ratio and the agreement are taken against it), no duplicates."""
    ordered = [REFERENCE] + [s for s in specs if s != REFERENCE]
    return list(dict.fromkeys(ordered))


def build_samples(builder: Builder, suite: Suite, limit: int | None, progress: bool) -> list[Sample]:
    jobs = []
    for task, plan in suite.tasks.items():
        task_jobs = []
        for length in plan.lengths:
            for index in range(plan.samples):
                if task == "niah":
                    task_jobs += [(builder.niah, (length, d, index)) for d in plan.depths]
                elif task == "ruler":
                    task_jobs += [(builder.ruler, (st, length, index)) for st in plan.subtasks]
                elif task == "ppl":
                    task_jobs.append((builder.ppl, (length, index)))
                elif task == "agreement":
                    task_jobs += [(builder.agreement, (dom, length, index)) for dom in plan.subtasks]
        jobs += task_jobs[:limit] if limit else task_jobs
    samples = []
    for fn, args in tqdm(jobs, desc="building prompts", disable=not progress or not jobs, file=sys.stderr):
        sample = fn(*args)
        if task_new_tokens := _agreement_tokens(suite, sample):
            sample.max_new_tokens = task_new_tokens
        samples.append(sample)
    return samples


def _agreement_tokens(suite: Suite, sample: Sample) -> int | None:
    if sample.task == "agreement":
        return suite.tasks["agreement"].new_tokens
    return None


def check_context(samples: list[Sample], suite: Suite, max_positions: int | None) -> None:
    """A clear error before any work when a prompt plus its answer would not fit the model."""
    if not max_positions:
        return
    for s in samples:
        if s.positions_needed > max_positions:
            extra = s.positions_needed - len(s.input_ids)
            raise ValueError(
                f"{s.task} at length {s.length} needs {s.positions_needed} positions ({extra} for the "
                f"answer/scored tokens) but the model has {max_positions}; use lengths up to "
                f"{max_positions - extra}"
            )
    cost = suite.tasks.get("cost")
    if cost:
        for length in cost.lengths:
            if length + (cost.new_tokens or 0) > max_positions:
                raise ValueError(f"cost at length {length} plus {cost.new_tokens} decoded tokens exceeds "
                                 f"the model's {max_positions} positions")


def group_by_sample(todo: list[tuple[Sample, str, str]]) -> list[tuple[Sample, str, list[str]]]:
    """``(sample, spec, digest)`` runs -> ``(sample, digest, specs)`` in first-seen order."""
    groups: dict[int, tuple[Sample, str, list[str]]] = {}
    for s, spec, digest in todo:
        groups.setdefault(id(s), (s, digest, []))[2].append(spec)
    return list(groups.values())


class Runner:
    def __init__(self, out_dir: str, specs: list[str], suite: Suite, options: RunOptions,
                 backend=None, model=None, tokenizer=None):
        self.out_dir = out_dir
        self.specs = with_reference(specs)
        self._reference_logprobs = None  # full's next-token log-probabilities on the current ppl or agreement sample
        self.suite = suite
        self.opt = options
        self.backend = backend or KVShrinkBackend(options.model_ref, options.device, options.dtype)
        self.model, self.tok = model, tokenizer
        self.methods = {spec: self.backend.parse(spec) for spec in self.specs}  # unknown method -> error
        self.writer = RowWriter(out_dir)

    # -- setup -----------------------------------------------------------------------------------
    def load(self) -> None:
        if self.model is None:
            self.model, self.tok = self.backend.load_model()
        self.model.eval()
        for spec in self.specs:  # unknown options fail here, before any long work
            self.backend.make_cache(spec, self.model)

    def samples(self) -> list[Sample]:
        builder = Builder(self.tok, self.opt.seed, self.opt.max_new_tokens,
                          ppl_tokens=self.suite.ppl_tokens)
        samples = build_samples(builder, self.suite, self.opt.limit, self.opt.progress)
        check_context(samples, self.suite, getattr(self.model.config, "max_position_embeddings", None))
        return samples

    # -- quality tasks ---------------------------------------------------------------------------
    def run(self) -> int:
        """Run what is not in the folder yet; returns the number of new rows."""
        import torch

        if self.opt.threads:
            torch.set_num_threads(self.opt.threads)
        self.load()
        samples = self.samples()
        done = {row_key(r): r for r in read_rows(self.out_dir)}
        todo = []
        for s in samples:
            digest = prompt_digest(s.input_ids, s.target_ids)
            for spec in self.specs:
                if (spec, s.task, s.subtask, s.length, s.depth, s.index, digest) not in done:
                    todo.append((s, spec, digest))
        written = 0
        stop = eos_token_ids(self.model, self.tok)
        bar = tqdm(total=len(todo), desc="evaluating", unit="run", disable=not self.opt.progress, file=sys.stderr)
        for s, digest, specs in group_by_sample(todo):
            self._reference_logprobs = None  # full's on this sample, for the methods' kl/top1 or free_kl
            if REFERENCE not in specs and s.metric in COMPARED_METRICS:  # full's row is from an earlier run:
                self.run_one(s, REFERENCE, digest, None, stop)         # its distributions again (not written)
            prefilled = self.shared_prefill(s, specs)
            for spec in specs:
                bar.set_postfix_str(f"{spec} {s.task}/{s.subtask} L={s.length}", refresh=False)
                reference = done.get((REFERENCE, s.task, s.subtask, s.length, s.depth, s.index, digest))
                cache, pre = prefilled.pop(spec, (None, None))
                row = self.run_one(s, spec, digest, reference, stop, cache, pre)
                self.writer.write(row)
                done[row_key(row)] = row
                written += 1
                bar.update(1)
        bar.close()
        if "cost" in self.suite.tasks:
            written += self.run_cost(done)
        return written

    def base_row(self, spec: str, task: str, subtask: str, length: int, depth, index, digest) -> dict:
        name, options = self.methods[spec]
        return {"spec": spec, "method": name, "options": options, "task": task, "subtask": subtask,
                "length": length, "depth": depth, "sample": index, "seed": self.opt.seed,
                "prompt_sha": digest}

    def shared_prefill(self, s: Sample, specs: list[str]) -> dict[str, tuple[Any, tuple]]:
        """Run the sample's prompt once for every spec (``{spec: (cache, (logits, seconds))}``).

        Prefill attention is exact in every method, so each cache ends up as its own prefill would
        leave it; per-method prefill time is measured by the ``cost`` task instead. Empty when the
        backend cannot share a prefill or a method's prefill is not exact (each then runs alone)."""
        share = getattr(self.backend, "prefill_together", None)  # None: this backend cannot share
        if share is None or len(specs) < 2:
            return {}
        from kvshrink.eval.fanout import FanoutMismatch

        caches = [self.backend.make_cache(spec, self.model) for spec in specs]
        try:
            pre = share(self.model, caches, s.input_ids)
        except FanoutMismatch as exc:
            print(f"kvshrink eval: shared prefill not possible ({exc}); running each method alone",
                  file=sys.stderr)
            return {}
        return {spec: (cache, pre) for spec, cache in zip(specs, caches)}

    def compare_distributions(self, spec: str, logprobs) -> dict:
        """``kl`` and ``top1`` against full's next-token distributions on the same sample (kept in memory
        for the sample's other methods; full runs again when its row came from an earlier run)."""
        if spec == REFERENCE:
            self._reference_logprobs = logprobs
            return {"kl": 0.0, "top1": 100.0}
        if self._reference_logprobs is None:
            return {}
        kl, top1 = distribution_agreement(self._reference_logprobs, logprobs)
        return {"kl": kl, "top1": top1}

    def compare_free_running(self, spec: str, logprobs, first: int | None) -> dict:
        """``free_kl``: KL(full || method) per step of the two free-running greedy decodes while their histories
        are the same (`scoring.free_running_kl`; full's kept in memory for the sample's other methods, full
        running again when its row came from an earlier run)."""
        if spec == REFERENCE:
            self._reference_logprobs = logprobs
            return {"free_kl": 0.0}
        if self._reference_logprobs is None:
            return {}
        return {"free_kl": free_running_kl(self._reference_logprobs, logprobs, first)}

    def run_one(self, s: Sample, spec: str, digest: str, reference: dict | None, stop: set[int],
                cache=None, prefilled: tuple | None = None) -> dict:
        row = self.base_row(spec, s.task, s.subtask, s.length, s.depth, s.index, digest)
        row["actual_tokens"] = len(s.input_ids)
        row["started"] = now()
        row["prefill_shared"] = prefilled is not None
        if cache is None:
            cache = self.backend.make_cache(spec, self.model)
        if s.metric == "ppl":
            res = score_continuation(self.model, cache, s.input_ids, s.target_ids, prefilled=prefilled,
                                     keep_logprobs=True)
            ppl = perplexity(res.nll_sum, res.count)
            row.update(ppl=ppl, scored_tokens=res.count,
                       ppl_ratio=ppl / reference["ppl"] if reference else (1.0 if spec == REFERENCE else None))
            row.update(self.compare_distributions(spec, res.logprobs))
        else:
            # Agreement decodes its full length: stopping at EOS would make short answers "agree".
            res = greedy_decode(self.model, cache, s.input_ids, s.max_new_tokens,
                                stop_ids=set() if s.metric == "agreement" else stop, prefilled=prefilled,
                                keep_logprobs=s.metric == "agreement")
            answer = self.tok.decode(res.tokens, skip_special_tokens=True)
            row["answer"] = answer[:ANSWER_CHARS]
            if s.metric == "agreement":
                ref_tokens = reference["tokens"] if reference else res.tokens
                share, first = token_agreement(ref_tokens, res.tokens)
                row.update(tokens=res.tokens, agreement=share, first_divergence=first)
                row.update(self.compare_free_running(spec, res.logprobs, first))
            else:
                row.update(score=score_answer(s.metric, answer, s.expected), expected=s.expected)
        row.update(cache_figures(cache))
        row.update(prefill_s=res.prefill_s, decode_ms_per_token=res.decode_ms_per_token,
                   peak_rss_mb=None, finished=now())
        del cache
        gc.collect()
        return row

    # -- cost ------------------------------------------------------------------------------------
    def run_cost(self, done: dict) -> int:
        plan = self.suite.tasks["cost"]
        digest = f"cost:{plan.new_tokens}" + (":interleaved" if self.opt.interleave else "")
        jobs = []
        for repeat in range(plan.repeats):
            for spec in self.specs:
                missing = [L for L in plan.lengths
                           if (spec, "cost", "prefill+decode", L, None, repeat, digest) not in done]
                if missing:
                    jobs.append((repeat, [spec], missing))
        if self.opt.interleave:     # one job a repeat: every method missing at any of its lengths, full included
            by_repeat: dict[int, tuple[list, list]] = {}
            for repeat, specs, lengths in jobs:
                held = by_repeat.setdefault(repeat, ([], []))
                held[0].extend(specs)
                held[1].extend(L for L in lengths if L not in held[1])
            jobs = [(repeat, with_reference(specs), sorted(lengths)) for repeat, (specs, lengths) in by_repeat.items()]
        written = 0
        bar = tqdm(jobs, desc="cost (one process each)", unit="proc", disable=not self.opt.progress,
                   file=sys.stderr)
        for repeat, specs, lengths in bar:
            bar.set_postfix_str(f"{', '.join(specs)} repeat {repeat}", refresh=False)
            job = {"lengths": lengths, "new_tokens": plan.new_tokens, "seed": self.opt.seed,
                   "threads": self.opt.threads, "model": self.opt.model_ref, "device": self.opt.device,
                   "dtype": self.opt.dtype, "repeat": repeat,
                   **({"specs": specs} if self.opt.interleave else {"spec": specs[0]})}
            started = now()
            for measured in cost_task.run_job(job):
                spec = measured.pop("spec", specs[0])
                row = self.base_row(spec, "cost", "prefill+decode", measured["length"], None, repeat, digest)
                ref = done.get((REFERENCE, "cost", "prefill+decode", measured["length"], None, repeat, digest))
                row.update(measured, started=started, finished=now())
                row["prefill_ratio"] = cost_task.paired_ratio(row["prefill_s"], ref and ref["prefill_s"])
                row["decode_ratio"] = cost_task.paired_ratio(row["decode_ms_per_token"],
                                                             ref and ref["decode_ms_per_token"])
                if spec == REFERENCE:
                    row["prefill_ratio"] = row["decode_ratio"] = 1.0
                key = row_key(row)
                # an interleaved job measures every method again when one was missing (a resumed run): rows
                # already written stay, but the methods measured now are paired with this process's full
                if key not in done:
                    self.writer.write(row)
                    written += 1
                done[key] = row
        return written
