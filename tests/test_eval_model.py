"""The evaluation harness on the embedded model: the quick suite end to end (the CI run), and the
proof that the harness can fail: a cache that randomly evicts 90% of the tokens scores clearly lower."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from kvshrink.eval.runner import RunOptions, Runner
from kvshrink.eval.suites import resolve_suite

pytestmark = pytest.mark.model

DAMAGED = "test_random_evict"


def read_rows(folder) -> list[dict]:
    with open(os.path.join(folder, "rows.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture
def random_evict_method():
    """A test-only method: after each step keep a random ``keep`` share of the tokens seen.

    Registered for this test only and removed afterwards, so users never see it."""
    from kvshrink.cache import registry
    from kvshrink.cache.base import CacheLayer
    from kvshrink.cache.store import ExactStore, partial_or_none

    class RandomEvictLayer(CacheLayer):
        def __init__(self, spec, keep: float = 0.1):
            super().__init__(spec)
            self.keep_share = keep
            self.store = ExactStore()
            self.gen = torch.Generator().manual_seed(1234 + spec.layer_idx)

        def past_partials(self, query, ctx):
            return partial_or_none(self.store, query, ctx.scaling, ctx.pad_len)

        def commit(self, key, value, ctx):
            self.store.append(key, value, ctx.new_index)
            target = max(1, math.ceil(self.keep_share * self.seen))
            if len(self.store) > target:
                pos = torch.randperm(len(self.store), generator=self.gen)[:target].sort().values
                self.store.keep(pos.to(key.device).expand(key.shape[0], -1))

        def nbytes(self):
            return self.store.nbytes()

        def clear(self):
            self.store.reset()

    registry.register_method(DAMAGED, "test only: random eviction",
                             {"keep": registry.Option(0.1, "share of tokens kept")})(RandomEvictLayer)
    yield DAMAGED
    registry._METHODS.pop(DAMAGED, None)


def test_a_damaged_cache_scores_clearly_lower_than_full(real_model, random_evict_method, tmp_path):
    model, tok = real_model
    suite = resolve_suite("quick", ["niah", "ppl"], lengths=[1024], depths=[25, 75])
    runner = Runner(str(tmp_path), [f"{DAMAGED}:keep=0.1"], suite, RunOptions(threads=1, progress=False),
                    model=model, tokenizer=tok)
    assert runner.run() == 6  # full + damaged on 2 NIAH prompts and 1 ppl text
    rows = read_rows(tmp_path)
    niah = {spec: [r["score"] for r in rows if r["spec"] == spec and r["task"] == "niah"]
            for spec in ("full", f"{DAMAGED}:keep=0.1")}
    assert niah["full"] == [100.0, 100.0]
    assert sum(niah[f"{DAMAGED}:keep=0.1"]) / 2 <= 50.0
    ppl = {r["spec"]: r for r in rows if r["task"] == "ppl"}
    assert ppl["full"]["ppl_ratio"] == 1.0
    assert ppl[f"{DAMAGED}:keep=0.1"]["ppl_ratio"] > 1.3
    damaged = next(r for r in rows if r["spec"].startswith(DAMAGED))
    assert damaged["ratio"] > 3 * next(r for r in rows if r["spec"] == "full")["ratio"]
    # A rerun finds every row done and runs nothing.
    again = Runner(str(tmp_path), [f"{DAMAGED}:keep=0.1"], suite, RunOptions(threads=1, progress=False),
                   model=model, tokenizer=tok)
    assert again.run() == 0


def test_quick_suite_end_to_end(tmp_path, capsys):
    """The quick suite end to end at its shorter length (512; the 1024 cells run the same code): every task, two
    RULER subtasks and two agreement domains (test_eval_tasks builds every one's prompts), report files, and
    full = 100 on the NIAH grid."""
    from kvshrink.eval.cli import main

    out = tmp_path / "quick"
    assert main(["eval", "--suite", "quick", "--methods", "full,streaming:window=128", "--out", str(out),
                 "--lengths", "512", "--subtasks", "niah_multikey,vt,prose,code", "--threads", "1",
                 "--no-progress"]) == 0
    rows = read_rows(out)
    assert {r["task"] for r in rows} == {"niah", "ruler", "ppl", "agreement", "cost"}
    assert {r["length"] for r in rows if r["task"] != "agreement"} == {512}
    full_niah = [r["score"] for r in rows if r["spec"] == "full" and r["task"] == "niah"]
    assert len(full_niah) == 3 and all(s == 100.0 for s in full_niah)
    cost = [r for r in rows if r["task"] == "cost"]
    assert len(cost) == 2 and all(r["peak_rss_mb"] > 0 and r["decode_ms_per_token"] > 0 for r in cost)
    assert {r["subtask"] for r in rows if r["task"] in ("ruler", "agreement")} == {"niah_multikey", "vt", "prose", "code"}
    agree = [r["agreement"] for r in rows if r["spec"] == "full" and r["task"] == "agreement"]
    assert agree and all(a == 100.0 for a in agree)
    for name in ("summary.md", "results.csv", "config.json", "pareto.png", "cost_vs_length.png",
                 "niah_full.png", "niah_streaming_window_128.png"):
        assert (out / name).exists(), name
    printed = capsys.readouterr().out
    assert "| full |" in printed and "| streaming:window=128 |" in printed


def test_interleaved_cost_pairs_every_method_with_full_in_one_process(real_model, tmp_path):
    """`eval cost --interleave`: one process a repeat decodes every method one step of each in turn; each row has
    the bytes and times a separate process gives (no peak memory), ratios against that process's full, and a
    rerun finds every row done."""
    model, tok = real_model
    suite = resolve_suite("quick", ["cost"], lengths=[512], repeats=1)
    options = RunOptions(threads=1, progress=False, interleave=True)
    specs = ["streaming:window=128", "shard"]
    assert Runner(str(tmp_path), specs, suite, options, model=model, tokenizer=tok).run() == 3
    rows = read_rows(tmp_path)
    assert sorted(r["spec"] for r in rows) == ["full", "shard", "streaming:window=128"]
    full = next(r for r in rows if r["spec"] == "full")
    for r in rows:
        assert r["interleaved"] and r["peak_rss_mb"] is None and r["decoded_tokens"] == 8
        assert r["decode_ms_per_token"] > 0 and r["prefill_s"] > 0 and r["nbytes"] > 0
        assert r["decode_ratio"] == pytest.approx(r["decode_ms_per_token"] / full["decode_ms_per_token"])
    assert next(r for r in rows if r["spec"] == "shard")["ratio"] > 3 * full["ratio"]
    assert Runner(str(tmp_path), specs, suite, options, model=model, tokenizer=tok).run() == 0
