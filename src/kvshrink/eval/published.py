"""Published tables: a results folder exported as one small JSON file (committed under benchmarks/), and the
Markdown tables of README.md and docs/ rendered from those files between markers, so a table cannot drift
from its data.

A marker names the table's kind and its data file, relative to the repository root::

    <!-- table:headline benchmarks/headline/smollm2.json -->
    ...rendered table, rewritten by ``kvshrink report --docs FILE...``...
    <!-- end table -->

A data file that does not exist yet renders as "not measured", with the command that measures it.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import statistics

from .report import markdown_table, spec_order
from .results import CONFIG, code_commit, read_rows

# What a row keeps of a results row: what the published tables read, and what identifies the sample.
KEPT_FIELDS = ("spec", "method", "task", "length", "actual_tokens", "sample", "ppl_ratio", "kl", "top1",
               "nbytes", "fp16_nbytes", "ratio", "prefill_s", "decode_ms_per_token", "prefill_ratio",
               "decode_ratio", "device", "dtype")

# What each method keeps, in a few words (exact spec first, then the method's name).
KEEPS = {
    "full": "every token, in the model's dtype (the reference)",
    "shard": "sinks and window exact; middle: PCA-coded keys (RoPE undone), vector-quantized values, the "
             "most-read tokens in 8 bits, the least-read coded cheaper (how much: calibrated per model) or "
             "dropped when decoding follows the prompt",
    "shard:evict=0": "the same, every middle token kept (as a document compressed before its questions)",
    "lrqk": "fast tier: rank-r key factors, top-k slots and a window (every token in a slow tier: host "
            "memory or disk, not counted)",
    "kivi": "low-bit groups (keys per channel, values per token), the recent tokens exact",
    "streaming": "attention sinks and a recent window; the rest evicted",
    "turboquant": "every token: norm, random rotation, Lloyd-Max codes",
    "h2o": "sinks, a recent window and the most-attended tokens (fixed budget)",
    "scissorhands": "the tokens whose attention persisted (fixed budget)",
    "hf-quantized": "transformers' QuantizedCache (quanto), the recent tokens exact",
}

MARKER = re.compile(r"<!-- table:(?P<kind>[a-z]+) (?P<path>\S+) -->\n.*?<!-- end table -->", re.S)


# ---- export ---------------------------------------------------------------------------------


def export_results(out_dir: str, dest: str, model: str | None = None) -> dict:
    """Write ``dest``: the run's commands, date, commit, machine and versions, and its rows (the fields the
    published tables read). Returns what was written."""
    rows = read_rows(out_dir)
    if not rows:
        raise ValueError(f"no result rows in {out_dir!r}: run `kvshrink eval ... --out {out_dir}` first")
    with open(os.path.join(out_dir, CONFIG), encoding="utf-8") as fh:
        config = json.load(fh)
    runs = config.get("runs", [])
    data = {
        "model": model or config.get("options", {}).get("model_ref") or "SmolLM2-135M-Instruct (embedded)",
        "date": (runs[0]["started"] if runs else _dt.datetime.now(_dt.timezone.utc).isoformat())[:10],
        # each run's commit, in order (a folder filled by several runs may span several)
        "commit": ", ".join(dict.fromkeys(r["commit"] for r in runs if r.get("commit"))) or code_commit(),
        "commands": [" ".join(r["argv"]) for r in runs if r.get("argv")],
        "machine": config.get("machine", {}),
        "versions": config.get("versions", {}),
        "rows": [{k: r.get(k) for k in KEPT_FIELDS if r.get(k) is not None} for r in rows],
    }
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    with open(dest, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
    return data


# ---- figures from the exported rows -----------------------------------------------------------


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _pick(rows: list[dict], spec: str, task: str, length: int, field: str) -> float | None:
    return _median(r.get(field) for r in rows if r["spec"] == spec and r["task"] == task and r["length"] == length)


def lengths_of(rows: list[dict]) -> list[int]:
    return sorted({r["length"] for r in rows})


def figures(rows: list[dict], spec: str, length: int) -> dict:
    """One method at one length: compression (on the perplexity text, after its teacher-forced steps), KL and
    top-1 against ``full``, and decode speed / prefill time against ``full`` in the same interleaved run
    (medians over samples and repeats; speed is full's time per token over the method's)."""
    decode = _pick(rows, spec, "cost", length, "decode_ratio")
    return {
        "ratio": _pick(rows, spec, "ppl", length, "ratio") or _pick(rows, spec, "cost", length, "ratio"),
        "kl": _pick(rows, spec, "ppl", length, "kl"),
        "top1": _pick(rows, spec, "ppl", length, "top1"),
        "speed": 1.0 / decode if decode else None,
        "prefill": _pick(rows, spec, "cost", length, "prefill_ratio"),
        "ms": _pick(rows, spec, "cost", length, "decode_ms_per_token"),
    }


def keeps(spec: str) -> str:
    return KEEPS.get(spec) or KEEPS.get(spec.split(":", 1)[0], "")


def _f(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def _k(n: int) -> str:
    return f"{round(n / 1024)}K" if n >= 1000 else str(n)


def headline_table(data: dict) -> str:
    """The README's at-a-glance table: what each method keeps, compression, quality and decode speed."""
    rows = data["rows"]
    lengths = lengths_of(rows)
    ls = " / ".join(_k(n) for n in lengths)
    header = ["method", "what it keeps", f"compression {ls}", f"KL from full, nats (top-1 %) {_k(lengths[-1])}",
              f"decode speed vs full {ls}"]
    body = []
    for spec in spec_order(rows):
        per = [figures(rows, spec, n) for n in lengths]
        last = per[-1]
        quality = f"{_f('{:.3f}', last['kl'])} ({_f('{:.1f}', last['top1'])})"
        body.append([f"`{spec}`", keeps(spec), " / ".join(_f("{:.2f}x", p["ratio"]) for p in per), quality,
                     " / ".join(_f("{:.2f}x", p["speed"]) for p in per)])
    return markdown_table(header, body)


def detail_table(data: dict) -> str:
    """docs/benchmarks.md: every figure of the run per method and length."""
    rows = data["rows"]
    header = ["method", "length", "compression", "KL nats", "top-1 %", "decode ms/token", "decode speed vs full",
              "prefill time / full"]
    body = []
    for spec in spec_order(rows):
        for n in lengths_of(rows):
            p = figures(rows, spec, n)
            body.append([f"`{spec}`", str(n), _f("{:.2f}x", p["ratio"]), _f("{:.4f}", p["kl"]),
                         _f("{:.1f}", p["top1"]), _f("{:.1f}", p["ms"]), _f("{:.2f}x", p["speed"]),
                         _f("{:.2f}", p["prefill"])])
    return markdown_table(header, body)


def provenance(data: dict, path: str) -> str:
    m = data.get("machine", {})
    cpu = m.get("cpu_model") or m.get("processor") or "unknown CPU"
    cuda = ", ".join(m.get("cuda_devices", []))
    where = f"{cuda} ({cpu})" if cuda else f"{cpu}, {m.get('cpu_affinity', m.get('cpu_count'))} cores"
    threads = _flag_values(data.get("commands", []), "--threads")
    if threads and not cuda:
        where += f", {'/'.join(threads)} torch thread{'s' if threads != ['1'] else ''}"
    return (f"{data['model']}, measured {data['date']} on `{data.get('commit') or 'unknown commit'}`, "
            f"{where}; torch {data.get('versions', {}).get('torch', '?')}. Data: [`{path}`]({path}).")


def _flag_values(commands: list[str], flag: str) -> list[str]:
    """The distinct values ``flag`` took in the run's command lines, in order."""
    values: list[str] = []
    for command in commands:
        words = command.split()
        for word, value in zip(words, words[1:]):
            if word == flag and value not in values:
                values.append(value)
    return values


TABLES = {"headline": headline_table, "detail": detail_table}


def render_block(kind: str, path: str, root: str, link_prefix: str = "") -> str:
    if kind not in TABLES:
        raise ValueError(f"unknown table kind {kind!r} in a table marker; allowed: {', '.join(TABLES)}")
    full_path = os.path.join(root, path)
    if not os.path.exists(full_path):
        name = os.path.splitext(os.path.basename(path))[0]
        body = (f"Not measured yet: `scripts/headline.sh {name} [MODEL]` writes `{path}`, then "
                f"`kvshrink report --docs` draws this table.")
    else:
        with open(full_path, encoding="utf-8") as fh:
            data = json.load(fh)
        body = TABLES[kind](data) + "\n\n" + provenance(data, link_prefix + path)
    return f"<!-- table:{kind} {path} -->\n{body}\n<!-- end table -->"


def render_doc(text: str, root: str, link_prefix: str = "") -> str:
    """``text`` with every marked table redrawn from its data file."""
    return MARKER.sub(lambda m: render_block(m["kind"], m["path"], root, link_prefix), text)


def _link_prefix(doc_path: str, root: str) -> str:
    depth = os.path.relpath(os.path.dirname(os.path.abspath(doc_path)), root).count(os.sep) + 1
    return "" if os.path.dirname(os.path.abspath(doc_path)) == os.path.abspath(root) else "../" * depth


def stale_docs(paths: list[str], root: str, write: bool = False) -> list[str]:
    """The documents whose marked tables differ from their data (rewritten when ``write``)."""
    stale = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        new = render_doc(text, root, _link_prefix(path, root))
        if new != text:
            stale.append(path)
            if write:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(new)
    return stale
