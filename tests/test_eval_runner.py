"""The runner on a tiny random Llama (no real model): rows, references, resume, context check."""
from __future__ import annotations

import json

import pytest

from kvshrink.eval.runner import RunOptions, Runner
from kvshrink.eval.suites import resolve_suite

from conftest import tiny_model
from test_eval_tasks import WordTokenizer


@pytest.fixture(scope="module")
def setup():
    tok = WordTokenizer()
    tok(open(__file__).read())  # any text; ids grow as the essays are read
    model = tiny_model(vocab_size=40000, max_position_embeddings=1024)
    return model, tok


def run(tmp_path, setup, specs, tasks, lengths):
    model, tok = setup
    suite = resolve_suite("quick", tasks, lengths=lengths)
    runner = Runner(str(tmp_path), specs, suite, RunOptions(progress=False, limit=2), model=model, tokenizer=tok)
    return runner.run(), [json.loads(l) for l in open(tmp_path / "rows.jsonl")]


def test_rows_hold_every_figure_and_a_rerun_skips_them(tmp_path, setup):
    written, rows = run(tmp_path, setup, ["streaming:window=32,sinks=4"], ["niah", "ppl", "agreement"], [300])
    # full is added as the reference; --limit 2: 2 NIAH depths + 1 ppl + 2 agreement domains, 2 specs
    assert written == 10 and len(rows) == 10
    assert [r["spec"] for r in rows[:2]] == ["full", "streaming:window=32,sinks=4"]
    for r in rows:
        assert r["nbytes"] > 0 and r["fp16_nbytes"] > 0 and r["prefill_s"] > 0
        assert abs(r["ratio"] - r["fp16_nbytes"] / r["nbytes"]) < 1e-6
        assert r["method"] in ("full", "streaming")
    stream = [r for r in rows if r["method"] == "streaming"]
    full = [r for r in rows if r["method"] == "full"]
    assert all(s["ratio"] > 3 * f["ratio"] for s, f in zip(stream, full))
    assert all(r["agreement"] == 100.0 and r["first_divergence"] is None and r["free_kl"] == 0.0
               for r in full if r["task"] == "agreement")
    # free-running: the method's own greedy tokens, its next-token distributions against full's while the
    # histories are the same
    assert all(r["free_kl"] >= 0.0 for r in stream if r["task"] == "agreement")
    assert next(r for r in full if r["task"] == "ppl")["ppl_ratio"] == 1.0
    s_ppl = next(r for r in stream if r["task"] == "ppl")
    f_ppl = next(r for r in full if r["task"] == "ppl")
    assert s_ppl["ppl_ratio"] == pytest.approx(s_ppl["ppl"] / f_ppl["ppl"])
    # next-token distributions against full's on the same teacher-forced text
    assert f_ppl["kl"] == 0.0 and f_ppl["top1"] == 100.0
    assert s_ppl["kl"] > 0 and 0 <= s_ppl["top1"] <= 100
    assert stream[0]["options"] == {"window": "32", "sinks": "4"}
    assert stream[0]["cache_options"] == {"sinks": 4, "window": 32}  # resolved, as the cache ran
    again, rows2 = run(tmp_path, setup, ["streaming:window=32,sinks=4"], ["niah", "ppl", "agreement"], [300])
    assert again == 0 and len(rows2) == 10


def test_a_length_beyond_the_context_is_refused(tmp_path, setup):
    with pytest.raises(ValueError, match="positions"):
        run(tmp_path, setup, ["full"], ["niah"], [1020])


def test_an_unknown_method_or_option_is_refused_before_any_work(tmp_path, setup):
    with pytest.raises(ValueError, match="available"):
        run(tmp_path / "a", setup, ["nosuch"], ["niah"], [300])
    with pytest.raises(ValueError, match="valid options"):
        run(tmp_path / "b", setup, ["streaming:windw=3"], ["niah"], [300])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


class SeparateBackend(__import__("kvshrink.eval.backend", fromlist=["KVShrinkBackend"]).KVShrinkBackend):
    """The default backend without the shared prefill: every method runs its own prompt."""

    prefill_together = None


def test_shared_prefill_gives_the_same_rows_as_separate_runs(tmp_path, setup):
    model, tok = setup
    suite = resolve_suite("quick", ["niah", "ppl"], lengths=[300])
    specs = ["streaming:window=32,sinks=4", "kivi:bits=2,group=16,residual=32"]
    rows = {}
    for name, backend in (("shared", None), ("separate", SeparateBackend())):
        runner = Runner(str(tmp_path / name), specs, suite, RunOptions(progress=False, limit=2),
                        backend=backend, model=model, tokenizer=tok)
        runner.run()
        rows[name] = [json.loads(l) for l in open(tmp_path / name / "rows.jsonl")]
    assert all(r["prefill_shared"] for r in rows["shared"])
    assert not any(r["prefill_shared"] for r in rows["separate"])
    for a, b in zip(rows["shared"], rows["separate"]):
        assert (a["spec"], a["task"], a["nbytes"], a.get("answer")) == (b["spec"], b["task"], b["nbytes"], b.get("answer"))
        if a["task"] == "ppl":
            assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-4)


def test_interleave_without_the_cost_task_is_refused(tmp_path, capsys):
    """`--interleave` changes only how the cost task runs: asked of a run without it, a clear error, nothing run."""
    from kvshrink.cli import main

    out = tmp_path / "niah"
    assert main(["eval", "niah", "--suite", "quick", "--methods", "full", "--interleave", "--out", str(out)]) == 2
    assert "--interleave applies to the cost task only; this run has niah" in capsys.readouterr().err
    assert not out.exists()


def test_interleaved_repeats_prefill_every_method_first_in_turn():
    """`cost.prefill_order`: repeat r prefills from the r-th method on (wrapping), so over as many repeats as
    methods each one is prefilled first once and the set is never changed."""
    from kvshrink.eval.cost import prefill_order

    specs = ["full", "shard", "lrqk"]
    orders = [prefill_order(specs, repeat) for repeat in range(4)]
    assert orders[:3] == [["full", "shard", "lrqk"], ["shard", "lrqk", "full"], ["lrqk", "full", "shard"]]
    assert orders[3] == orders[0]
    assert {order[0] for order in orders[:3]} == set(specs) and all(sorted(o) == sorted(specs) for o in orders)
    assert specs == ["full", "shard", "lrqk"]        # the job's list is not reordered in place


def test_a_method_added_to_a_finished_run_is_still_compared_with_full(tmp_path, setup):
    run(tmp_path, setup, ["streaming:window=32,sinks=4"], ["ppl", "agreement"], [300])
    written, rows = run(tmp_path, setup, ["streaming:window=32,sinks=4", "streaming:window=16,sinks=4"],
                        ["ppl", "agreement"], [300])
    added = [r for r in rows if r["spec"] == "streaming:window=16,sinks=4"]
    assert written == len(added) == 3  # full's rows are not written again
    assert next(r for r in added if r["task"] == "ppl")["kl"] > 0
    assert all(r["free_kl"] >= 0 for r in added if r["task"] == "agreement")
