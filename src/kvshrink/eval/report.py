"""Summary tables and plots from a results folder (``kvshrink report DIR`` redraws them)."""
from __future__ import annotations

import math
import os
import statistics
from collections import defaultdict

from kvshrink.extras import require

from .results import read_rows, write_csv

SUMMARY = "summary.md"
REFERENCE = "full"


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spec_order(rows: list[dict]) -> list[str]:
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    return sorted(specs, key=lambda s: (s != REFERENCE, specs.index(s)))


def summarize(rows: list[dict]) -> list[dict]:
    """One summary record per method spec (see ``SUMMARY_COLUMNS``)."""
    by_spec = defaultdict(list)
    for r in rows:
        by_spec[r["spec"]].append(r)
    out = []
    for spec in spec_order(rows):
        rs = by_spec[spec]
        quality = [r for r in rs if r["task"] in ("niah", "ruler")]
        cost = [r for r in rs if r["task"] == "cost"]
        out.append({
            "spec": spec,
            "niah": _mean(r.get("score") for r in rs if r["task"] == "niah"),
            "ruler": _mean(r.get("score") for r in rs if r["task"] == "ruler"),
            "ppl_ratio": _mean(r.get("ppl_ratio") for r in rs if r["task"] == "ppl"),
            "kl": _mean(r.get("kl") for r in rs if r["task"] == "ppl"),
            "top1": _mean(r.get("top1") for r in rs if r["task"] == "ppl"),
            "agreement": _mean(r.get("agreement") for r in rs if r["task"] == "agreement"),
            "free_kl": _mean(r.get("free_kl") for r in rs if r["task"] == "agreement"),
            "ratio": _mean(r.get("ratio") for r in quality) or _mean(r.get("ratio") for r in cost),
            "decode_ratio": _max_length_median(cost, "decode_ratio"),
            "prefill_ratio": _max_length_median(cost, "prefill_ratio"),
            "peak_delta_mb": _max_length_median(cost, "peak_rss_delta_mb"),
        })
    return out


def _max_length_median(rows: list[dict], field: str):
    if not rows:
        return None
    longest = max(r["length"] for r in rows)
    return _median(r.get(field) for r in rows if r["length"] == longest)


SUMMARY_COLUMNS = (
    ("spec", "method spec", "{}"),
    ("niah", "NIAH", "{:.1f}"),
    ("ruler", "RULER", "{:.1f}"),
    ("ppl_ratio", "ppl / full", "{:.3f}"),
    ("kl", "KL nats", "{:.4f}"),
    ("top1", "top-1 %", "{:.1f}"),
    ("agreement", "agree %", "{:.1f}"),
    ("free_kl", "free-running KL", "{:.4f}"),
    ("ratio", "compression", "{:.2f}x"),
    ("decode_ratio", "decode / full (longest)", "{:.2f}"),
    ("prefill_ratio", "prefill / full (longest)", "{:.2f}"),
    ("peak_delta_mb", "peak MB (longest)", "{:.0f}"),
)


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def summary_markdown(rows: list[dict]) -> str:
    records = summarize(rows)
    header = [title for _, title, _ in SUMMARY_COLUMNS]
    body = [[_fmt(fmt, rec[key]) for key, _, fmt in SUMMARY_COLUMNS] for rec in records]
    parts = ["## Summary", "", markdown_table(header, body), "",
             "NIAH/RULER: mean score 0-100. ppl / full: perplexity ratio to the full cache on the same "
             "text. KL nats: mean KL(full || method) of the next-token distributions over the scored "
             "tokens; top-1 %: share of those steps with the same most likely token (both teacher-forced "
             "on the same text, so one early difference does not decide later steps). agree %: share of "
             "greedy tokens identical to the full cache's. compression: fp16 "
             "bytes / bytes held (mean over NIAH/RULER prompts; a cache kept in the model's dtype holds "
             "fp32 on an fp32 model, so full shows 0.50x). decode, prefill: median over repeats of the "
             "time ratio to full's in the same repeat (each in its own process), at the longest cost "
             "length. peak MB: RSS growth during "
             "prefill+decode at the longest cost length."]
    tables = [niah_table(rows), ruler_length_table(rows), ruler_table(rows), ppl_table(rows), kl_table(rows),
              cost_table(rows)]
    for table in tables:
        if table:  # a task the run did not include has no table
            parts += ["", table]
    return "\n".join(parts) + "\n"


def _by_length(rows: list[dict], task: str, title: str, field: str = "score", fmt: str = "{:.0f}") -> str:
    picked = [r for r in rows if r["task"] == task and r.get(field) is not None]
    if not picked:
        return ""
    lengths = sorted({r["length"] for r in picked})
    body = []
    for spec in spec_order(picked):
        body.append([spec] + [_fmt(fmt, _mean(r[field] for r in picked if r["spec"] == spec and r["length"] == L))
                              for L in lengths])
    return f"## {title}\n\n" + markdown_table(["method spec"] + [str(L) for L in lengths], body)


def niah_table(rows: list[dict]) -> str:
    return _by_length(rows, "niah", "NIAH by length (mean over depths)")


def ruler_length_table(rows: list[dict]) -> str:
    return _by_length(rows, "ruler", "RULER by length (mean over subtasks and samples)")


def ppl_table(rows: list[dict]) -> str:
    return _by_length(rows, "ppl", "Perplexity / full by length (mean over samples)", "ppl_ratio", "{:.3f}")


def kl_table(rows: list[dict]) -> str:
    return _by_length(rows, "ppl", "KL(full || method) nats per scored token, by length", "kl", "{:.4f}")


def ruler_table(rows: list[dict]) -> str:
    ruler = [r for r in rows if r["task"] == "ruler"]
    if not ruler:
        return ""
    subtasks = list(dict.fromkeys(r["subtask"] for r in ruler))
    body = [[spec] + [_fmt("{:.0f}", _mean(r["score"] for r in ruler if r["spec"] == spec and r["subtask"] == st))
                      for st in subtasks] for spec in spec_order(ruler)]
    return "## RULER by subtask (mean over lengths and samples)\n\n" + markdown_table(["method spec"] + subtasks, body)


def cost_table(rows: list[dict]) -> str:
    cost = [r for r in rows if r["task"] == "cost"]
    if not cost:
        return ""
    body = []
    for spec in spec_order(cost):
        for L in sorted({r["length"] for r in cost if r["spec"] == spec}):
            rs = [r for r in cost if r["spec"] == spec and r["length"] == L]
            body.append([spec, str(L), _fmt("{:.2f}", _median(r["nbytes"] / 2**20 for r in rs)),
                         _fmt("{:.2f}x", _median(r["ratio"] for r in rs)),
                         _fmt("{:.2f}", _median(r["prefill_s"] for r in rs)),
                         _fmt("{:.1f}", _median(r["decode_ms_per_token"] for r in rs)),
                         _fmt("{:.2f}", _median(r.get("decode_ratio") for r in rs)),
                         _fmt("{:.0f}", _median(r.get("peak_rss_delta_mb") for r in rs)),
                         str(len(rs))])
    header = ["method spec", "length", "cache MB", "compression", "prefill s", "decode ms/tok",
              "decode / full", "peak MB", "repeats"]
    return "## Cost (medians over repeats)\n\n" + markdown_table(header, body)


# ---------------------------------------------------------------------------------------------
# plots


def _pyplot():
    require("matplotlib", "matplotlib", "eval", "drawing the evaluation's plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def safe_name(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)


def plot_niah(rows: list[dict], out_dir: str) -> list[str]:
    niah = [r for r in rows if r["task"] == "niah"]
    if not niah:
        return []
    plt = _pyplot()
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("niah", ["#F0496E", "#EBB839", "#0CD79F"])
    paths = []
    for spec in spec_order(niah):
        rs = [r for r in niah if r["spec"] == spec]
        lengths = sorted({r["length"] for r in rs})
        depths = sorted({r["depth"] for r in rs})
        grid = [[_mean(r["score"] for r in rs if r["length"] == L and r["depth"] == d) for L in lengths]
                for d in depths]
        fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(lengths), 1.2 + 0.55 * len(depths)))
        values = [[math.nan if v is None else v for v in row] for row in grid]
        im = ax.imshow(values, cmap=cmap, vmin=0, vmax=100, aspect="auto")
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(f"NIAH: {spec}", fontsize=10)
        fig.colorbar(im, ax=ax, label="score")
        fig.tight_layout()
        path = os.path.join(out_dir, f"niah_{safe_name(spec)}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point beats on both compression (higher) and score (higher)."""
    front = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(front)


def plot_pareto(rows: list[dict], out_dir: str) -> str | None:
    points = []
    for rec in summarize(rows):
        scores = [s for s in (rec["niah"], rec["ruler"]) if s is not None]
        if scores and rec["ratio"] is not None:
            points.append((rec["ratio"], sum(scores) / len(scores), rec["spec"]))
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([p[0] for p in points], [p[1] for p in points], zorder=3)
    for x, y, spec in points:
        ax.annotate(spec, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    front = pareto_front([(x, y) for x, y, _ in points])
    ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="grey", zorder=2, label="Pareto front")
    ax.set_xlabel("compression ratio (fp16 bytes / bytes held)")
    ax.set_ylabel("mean score (NIAH and RULER)")
    ax.set_ylim(-5, 105)
    ax.set_xlim(0, 1.35 * max(p[0] for p in points))  # room for the labels right of the points
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("Quality against compression", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, "pareto.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_cost(rows: list[dict], out_dir: str) -> str | None:
    cost = [r for r in rows if r["task"] == "cost"]
    if not cost:
        return None
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for spec in spec_order(cost):
        lengths = sorted({r["length"] for r in cost if r["spec"] == spec})
        rs = lambda L: [r for r in cost if r["spec"] == spec and r["length"] == L]  # noqa: E731
        ax1.plot(lengths, [_median(r["decode_ms_per_token"] for r in rs(L)) for L in lengths], "o-", label=spec)
        ax2.plot(lengths, [_median(r["nbytes"] / 2**20 for r in rs(L)) for L in lengths], "o-", label=spec)
    ax1.set_title("decode time per token (median)", fontsize=10)
    ax1.set_ylabel("ms / token")
    ax2.set_title("cache size after prefill + decode", fontsize=10)
    ax2.set_ylabel("MB")
    for ax in (ax1, ax2):
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "cost_vs_length.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(out_dir: str) -> str:
    """Writes results.csv, summary.md and the plots; returns the summary Markdown."""
    rows = read_rows(out_dir)
    if not rows:
        raise ValueError(f"no result rows in {out_dir!r} (expected {os.path.join(out_dir, 'rows.jsonl')})")
    write_csv(out_dir, rows)
    text = summary_markdown(rows)
    plots = plot_niah(rows, out_dir) + [p for p in (plot_pareto(rows, out_dir), plot_cost(rows, out_dir)) if p]
    if plots:
        text += "\n## Plots\n\n" + "\n".join(f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots) + "\n"
    with open(os.path.join(out_dir, SUMMARY), "w", encoding="utf-8") as fh:
        fh.write(text)
    return text
