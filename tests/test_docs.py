"""The documents stay in step with the code and with the data their tables are drawn from; the README stays a
short, working user's page."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from kvshrink.cache.registry import options_markdown
from kvshrink.eval.published import headline_table, stale_docs

ROOT = Path(__file__).resolve().parents[1]


def test_options_doc_is_generated_from_the_declared_options():
    doc = (ROOT / "docs" / "options.md").read_text()
    assert doc == options_markdown(), "docs/options.md is stale: run `kvshrink methods --markdown > docs/options.md`"


def test_every_method_and_option_is_in_the_options_doc():
    import kvshrink

    doc = (ROOT / "docs" / "options.md").read_text()
    for name, info in kvshrink.methods().items():
        if not info.module.startswith("kvshrink."):
            continue  # e.g. the worked example registered by its test
        assert f"## `{name}`" in doc
        for opt in info.options:
            assert f"| `{opt}` |" in doc


# ---- published tables: each is drawn from a committed data file under benchmarks/ ----------------------


PUBLISHED_DOCS = ["README.md", "docs/benchmarks.md"]


def test_published_tables_are_drawn_from_their_committed_data():
    paths = [str(ROOT / p) for p in PUBLISHED_DOCS]
    assert stale_docs(paths, str(ROOT)) == [], (
        "a published table differs from its data: run `kvshrink report --docs README.md docs/benchmarks.md`")


def test_every_table_marker_names_a_data_file_under_benchmarks():
    for p in PUBLISHED_DOCS:
        markers = re.findall(r"<!-- table:([a-z]+) (\S+) -->", (ROOT / p).read_text())
        assert markers, f"{p} has no published table"
        for kind, path in markers:
            assert path.startswith("benchmarks/") and path.endswith(".json"), (p, path)


def test_every_figure_line_of_a_published_table_comes_from_data(tmp_path):
    """A table edited by hand (or data changed without redrawing) is found stale; a missing file says so."""
    data = {"model": "m", "date": "2026-01-01", "commit": "abc", "machine": {"cpu_model": "cpu", "cpu_count": 2},
            "versions": {"torch": "x"}, "commands": ["kvshrink eval ppl --threads 1", "kvshrink eval cost --threads 1"],
            "rows": [{"spec": "full", "task": "ppl", "length": 256, "kl": 0.0, "top1": 100.0, "ratio": 0.5},
                     {"spec": "streaming", "task": "ppl", "length": 256, "kl": 0.25, "top1": 80.0, "ratio": 4.0},
                     {"spec": "full", "task": "cost", "length": 256, "decode_ratio": 1.0, "prefill_ratio": 1.0},
                     {"spec": "streaming", "task": "cost", "length": 256, "decode_ratio": 0.5, "prefill_ratio": 1.1}]}
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "a.json").write_text(json.dumps(data))
    doc = tmp_path / "doc.md"
    doc.write_text("x\n<!-- table:headline benchmarks/a.json -->\nold\n<!-- end table -->\n"
                   "<!-- table:headline benchmarks/missing.json -->\n<!-- end table -->\n")
    assert stale_docs([str(doc)], str(tmp_path), write=True) == [str(doc)]
    text = doc.read_text()
    assert "| `streaming` |" in text and "4.00x" in text and "0.250 (80.0)" in text and "2.00x" in text
    assert "Not measured yet" in text and "benchmarks/missing.json" in text
    assert "cpu, 2 cores, 1 torch thread;" in text               # the run's settings, read from its commands
    assert stale_docs([str(doc)], str(tmp_path)) == []
    doc.write_text(text.replace("4.00x", "5.00x"))
    assert stale_docs([str(doc)], str(tmp_path)) == [str(doc)]


def test_an_export_names_the_commit_of_each_run_that_filled_its_folder(tmp_path, monkeypatch):
    """Two runs into one folder on two commits: the exported file names both, in order, not the exporter's."""
    from kvshrink.eval import published, results

    row = {"spec": "full", "task": "ppl", "length": 256, "kl": 0.0, "top1": 100.0, "ratio": 0.5}
    (tmp_path / results.ROWS).write_text(json.dumps(row) + "\n")
    for commit in ("aaaa", "bbbb", "aaaa"):
        monkeypatch.setattr(results, "code_commit", lambda commit=commit: commit)
        results.write_config(str(tmp_path), {"argv": ["kvshrink", "eval", "ppl"]})
    monkeypatch.setattr(published, "code_commit", lambda: "cccc")
    data = published.export_results(str(tmp_path), str(tmp_path / "out.json"))
    assert data["commit"] == "aaaa, bbbb" and len(data["commands"]) == 3


def test_report_docs_check_fails_on_a_stale_table_and_redraws_it(tmp_path, monkeypatch):
    from kvshrink.eval.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.md").write_text("<!-- table:detail benchmarks/none.json -->\nhand-made\n<!-- end table -->\n")
    assert main(["report", "--docs", "doc.md", "--check"]) == 1
    assert "hand-made" in (tmp_path / "doc.md").read_text()
    assert main(["report", "--docs", "doc.md"]) == 0
    assert main(["report", "--docs", "doc.md", "--check"]) == 0
    assert "Not measured yet" in (tmp_path / "doc.md").read_text()


def test_headline_script_writes_the_data_a_table_is_drawn_from(tmp_path):
    """scripts/headline.sh end to end on the embedded model, tiny: two methods, one short length."""
    env = dict(os.environ, KVSHRINK=f"{sys.executable} -m kvshrink.eval", LENGTHS="256", REPEATS="1",
               METHODS="full,streaming:window=32", THREADS="1", SCRATCH=str(tmp_path / "run"),
               DEST=str(tmp_path / "bench"), PYTHONPATH=str(ROOT / "src"))
    subprocess.run(["bash", str(ROOT / "scripts" / "headline.sh"), "tiny"], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=900)
    data = json.loads((tmp_path / "bench" / "tiny.json").read_text())
    assert {(r["spec"], r["task"]) for r in data["rows"]} == {
        (s, t) for s in ("full", "streaming:window=32") for t in ("ppl", "cost")}
    assert any("eval ppl" in c for c in data["commands"]) and any("eval cost" in c for c in data["commands"])
    table = headline_table(data)
    assert "| `streaming:window=32` |" in table and "| `full` |" in table
    stream = next(r for r in data["rows"] if r["spec"] == "streaming:window=32" and r["task"] == "ppl")
    assert stream["ratio"] > 1.0 and stream["kl"] > 0.0


# ---- the README is a user's page: short, working, linked, about the software ------------------------------


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_is_at_most_200_lines():
    assert len(_readme().splitlines()) <= 200


def test_readme_quick_start_runs_on_the_embedded_model(capsys):
    """The first Python block under "Quick start", executed as a newcomer would paste it."""
    section = _readme().split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md (quick start)", "exec"), {})
    printed = capsys.readouterr().out
    assert "x smaller than an fp16 cache" in printed
    assert float(printed.rsplit("x smaller", 1)[0].split()[-1]) > 1.0


def _user_docs() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in docs if p.name != "options.md"]


def test_every_relative_link_of_the_docs_exists():
    for doc in _user_docs():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to missing {target}"


HISTORY = re.compile(r"\b(?:[Ss]ession \d+|[Ii]ssues? #?\d+|as before)\b|\(was [\d.]+, then")


def test_docs_scripts_and_examples_do_not_tell_the_project_history():
    files = _user_docs() + sorted((ROOT / "scripts").iterdir()) + sorted(p for p in (ROOT / "examples").rglob("*")
                                                                         if p.suffix in (".py", ".md"))
    for path in files:
        if path.is_file():
            hits = HISTORY.findall(path.read_text(errors="replace"))
            assert not hits, f"{path.relative_to(ROOT)} mentions development history: {hits[:3]}"
