"""The scripts behind published figures under benchmarks/, run end to end on the embedded model at a tiny
setting (the session's model: conftest shares ``kvshrink.load_model``): each writes records of the shape its
results file holds. scripts/ are run by test_docs, test_gpu_path and test_store_load."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import kvshrink

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.model


def load_script(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kl_continuation_writes_one_record_per_spec_and_reuses_full(tmp_path, capsys):
    """benchmarks/shard-ratio/kl_continuation.py: a short prefix, two specs; a second run reads ``full``'s
    distributions from the file the first one saved."""
    script = load_script("benchmarks/shard-ratio/kl_continuation.py")
    out = tmp_path / "kl.jsonl"
    specs = ["shard:evict=0,sinks=4,window=16,min_block=32", "kivi:bits=2"]
    script.main(["smol", "160", str(out), *specs])
    refs = list(tmp_path.glob("ref-*.pt"))
    assert [p.name for p in refs] == ["ref-smol-160-float32.pt"]
    saved = refs[0].stat().st_mtime_ns
    script.main(["smol", "160", str(out), specs[0]])
    assert refs[0].stat().st_mtime_ns == saved                      # reused, not recomputed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed == records and [r["spec"] for r in records] == specs + specs[:1]
    for r in records:
        assert set(r) == {"model", "dtype", "text", "length", "spec", "ratio", "kl", "top1", "seconds", "share"}
        assert (r["model"], r["dtype"], r["text"], r["length"]) == ("smol", "float32", "licenses", 160)
        assert r["ratio"] > 1 and r["kl"] >= 0 and 0 <= r["top1"] <= 100
        assert r["share"] and all(v >= 0 for v in r["share"].values())
        assert sum(r["share"].values()) == pytest.approx(1, abs=0.01)
    shard = records[0]
    assert {"window", "sinks"} <= set(shard["share"]) and any(k.startswith("middle_k") for k in shard["share"])
    assert records[2]["kl"] == pytest.approx(shard["kl"], abs=1e-5)  # the same spec, the same answer
    with pytest.raises(SystemExit):                                  # a usage message, not a traceback
        script.main(["smol", "160"])


def test_kl_continuation_on_the_calibration_text_measures_what_kl_budget_measures(tmp_path, monkeypatch):
    """TEXT=calibration: the prefix and continuation `calibrate_shard` uses, so a spec's KL is the KL the
    calibration finds for it (a short prefix here; the continuation is the calibration's 256 tokens)."""
    from kvshrink.methods.shard import sensitivity

    script = load_script("benchmarks/shard-ratio/kl_continuation.py")
    monkeypatch.setenv("TEXT", "calibration")
    out = tmp_path / "kl.jsonl"
    rung = ",".join(f"{k}={v}" for k, v in sensitivity.LADDER[0].items())
    script.main(["smol", "160", str(out), f"shard:evict=0,min_block=32,{rung}"])
    record = json.loads(out.read_text())
    assert [p.name for p in tmp_path.glob("ref-*.pt")] == ["ref-smol-calibration-160-float32.pt"]
    monkeypatch.setattr(sensitivity, "PREFIX_TOKENS", 160)
    model, tokenizer = kvshrink.load_model()
    found = sensitivity.calibrate_shard(model, tokenizer, 1e9, evict=0, min_block=32)
    assert record["text"] == "calibration" and record["kl"] == pytest.approx(found.tried[0][1], abs=1e-5)
    monkeypatch.setenv("TEXT", "poems")
    with pytest.raises(SystemExit, match="TEXT must be"):
        script.main(["smol", "160", str(out), "kivi:bits=2"])


def test_kl_continuation_calibrates_each_shard_spec_under_kl_budget(tmp_path, monkeypatch):
    """With KL_BUDGET set, a Shard spec's options go through calibrate_shard first, and the record says what it
    chose (a short calibration text here: the rule, not the figure, is under test)."""
    from kvshrink.methods.shard import sensitivity

    script = load_script("benchmarks/shard-ratio/kl_continuation.py")
    monkeypatch.setattr(sensitivity, "PREFIX_TOKENS", 256)
    monkeypatch.setattr(sensitivity, "CONTINUATION_TOKENS", 32)
    monkeypatch.setenv("KL_BUDGET", "1e9")
    out = tmp_path / "kl.jsonl"
    script.main(["smol", "160", str(out), "shard:evict=0,sinks=4,min_block=32"])
    record = json.loads(out.read_text())
    assert record["spec"] == "shard:evict=0,sinks=4,min_block=32" and record["kl_budget"] == 1e9
    cheapest = ",".join(f"{k}={v}" for k, v in sensitivity.LADDER[0].items())
    assert record["calibrated"] == f"shard:evict=0,sinks=4,min_block=32,{cheapest}"
    assert len(record["calibration_kl"]) == 1                     # the cheapest rung was within the budget
    with pytest.raises(SystemExit, match="not a shard spec"):
        script.main(["smol", "160", str(out), "kivi:bits=2"])


def test_shard_ratio_tables_match_their_readme(capsys):
    """benchmarks/shard-ratio/table.py draws each of the README's tables from the JSONL file named above it."""
    script = load_script("benchmarks/shard-ratio/table.py")
    folder = ROOT / "benchmarks" / "shard-ratio"
    readme = (folder / "README.md").read_text()
    for name in ("smollm2-8k.jsonl", "qwen2.5-1.5b-4k.jsonl", "qwen2.5-1.5b-8k.jsonl", "keys-values-smollm2-4k.jsonl",
                 "calibrated-sr25-87bc510.jsonl"):
        script.main([str(folder / name)])
        table = capsys.readouterr().out.strip()
        assert table.count("\n") >= 2 and table in readme, name
    with pytest.raises(SystemExit):
        script.main([])


def test_value_error_finds_the_common_part_of_the_values_worth_removing(tmp_path, monkeypatch, capsys):
    """benchmarks/shard-ratio/value_error.py on a short prefix: values coded less their mean miss by less."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "shard-ratio"))
    script = load_script("benchmarks/shard-ratio/value_error.py")
    monkeypatch.setattr(script, "LENGTH", 300)
    out = tmp_path / "value.jsonl"
    script.main(["smol", str(out)])
    record = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    assert 0 <= record["mean_share_min"] <= record["mean_share_median"] <= record["mean_share_max"] < 1
    assert record["vq2_centred_vs_vq2"] < 1 and record["pca1.5_vs_vq2"] > record["pca2.0_vs_vq2"] > 0
    with pytest.raises(SystemExit):
        script.main(["smol"])


def test_cold_start_measure_writes_its_phases(tmp_path, capsys):
    """benchmarks/cold_start/measure.py in this process (its phases then time a warm start)."""
    script = load_script("benchmarks/cold_start/measure.py")
    out = tmp_path / "cold.jsonl"
    record = script.main(["shard:sinks=4,window=16", "--out", str(out)])
    assert json.loads(out.read_text()) == record
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    assert record["method"] == "shard:sinks=4,window=16" and record["numba_cache"] in ("empty", "as found")
    phases = [record[k] for k in ("import_load_s", "make_cache_s", "generate8_s")]
    assert all(p >= 0 for p in phases) and record["total_s"] == pytest.approx(sum(phases), abs=0.2)
    assert len(record["load_start"]) == len(record["load_end"]) == 3
    assert record["code"] is None or len(record["code"]) >= 7
    assert set(record) <= set(json.loads((ROOT / "benchmarks/cold_start/results.jsonl").read_text()
                                         .splitlines()[0])) | {"method"}


def test_read_prediction_measures_each_layer(tmp_path, monkeypatch, capsys):
    """benchmarks/shard-ratio/read_prediction.py on a short prefix: one record per layer; more cold share
    takes more tokens and more of the later reads, and the most read tokens hold more than their share."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "shard-ratio"))
    script = load_script("benchmarks/shard-ratio/read_prediction.py")
    out = tmp_path / "reads.jsonl"
    script.main(["smol", "400", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["layer"] for r in records] == list(range(30))
    for r in records:
        cold = [r[f"cold={c}"] for c in script.COLD_SHARES]
        assert all(a["frac"] <= b["frac"] and a["cont"] <= b["cont"] + 1e-4 for a, b in zip(cold, cold[1:]))
        assert all(0 <= c["proxy"] <= 1 and c["cont"] <= 1 for c in cold)
        for s in script.SALIENT_SHARES:
            assert r[f"salient={s}"]["self"] >= s - 1e-4 and 0 < r[f"salient={s}"]["cont"] <= 1
    assert "cold=0.1" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script.main(["smol", "80", str(out)])


def test_needle_margin_of_full_is_its_own_answer_margin(tmp_path, capsys):
    """benchmarks/shard-ratio/needle_margin.py on one short needle: ``full`` teacher-forced along its own answer
    keeps its own margin, and each spec gets one, in one record per needle."""
    script = load_script("benchmarks/shard-ratio/needle_margin.py")
    out = tmp_path / "margins.jsonl"
    script.main(["600", "0", "50,vt", str(out), "full", "kivi:bits=2"])
    record, ruler = [json.loads(line) for line in out.read_text().splitlines()]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-2]) == record
    assert record["expected"] in record["full"] and record["full_min"] > 0
    assert record["specs"]["full"] == pytest.approx(record["full_min"], abs=1e-3)
    assert isinstance(record["specs"]["kivi:bits=2"], float)
    assert record["ratios"]["full"] < 1 < record["ratios"]["kivi:bits=2"]
    assert ruler["subtask"] == "vt" and len(ruler["expected"]) == 5 and set(ruler["specs"]) == {"full", "kivi:bits=2"}
    script.main(["table", str(out)])
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 6 and "`kivi:bits=2`" in table[0] and table[2].startswith("| 0, 50% |")
    assert table[3].startswith("| 0, vt |")
    assert table[-1] == f"| answered otherwise | | 0 | {int(record['specs']['kivi:bits=2'] < 0)} |"
    with pytest.raises(SystemExit):
        script.main(["600", "0", "50", str(out)])


def test_the_steps_of_an_answers_items_spell_them():
    """needle_margin.item_steps: the answer steps of each expected item are the tokens that spell it (a RULER
    answer's margin is taken over them), the separators between the items left out."""
    script = load_script("benchmarks/shard-ratio/needle_margin.py")
    _, tok = kvshrink.load_model()
    tokens = tok.encode(" VAR KYKWA, VAR XJTBP, and VAR GESCC.", add_special_tokens=False)
    steps = script.item_steps(tok, tokens, ["XJTBP", "KYKWA", "QQQQQ"])
    spelled = tok.decode([tokens[i] for i in steps])
    assert "KYKWA" in spelled and "XJTBP" in spelled and "," not in spelled and "GESCC" not in spelled
