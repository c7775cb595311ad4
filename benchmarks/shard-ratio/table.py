"""The README's tables from `kl_continuation.py`'s JSON lines: one row per spec (the last line of a spec wins).
Records of calibrated runs (``KL_BUDGET``) make a table of their own layout: one row per model and length, with
the rung the calibration chose and the KL it measured on each rung it tried.

    python benchmarks/shard-ratio/table.py RESULTS.jsonl [RESULTS.jsonl ...]
"""
import json
import os
import sys

GROUPS = {"key codes": ("middle_k_codes",), "value codes": ("middle_v_codes",), "salient": ("middle_salient",),
          "window + sinks": ("window", "sinks"), "key bases": ("middle_k_bases",)}


def rows(paths: list[str]) -> dict[tuple, dict]:
    latest = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                latest[(record["model"], record["length"], record["spec"])] = record
    return latest


def chosen_rung(record: dict) -> str:
    """The options the calibration added to the spec's own."""
    return record["calibrated"][len(record["spec"]) + 1:]


def main(argv=None):
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        raise SystemExit(__doc__)
    records = rows(paths)
    calibrated = any("calibrated" in r for r in records.values())
    lead = ["model", "length", "chosen rung", "calibration KL"] if calibrated else ["spec"]
    print("| " + " | ".join(lead + ["ratio", "KL nats", "top-1", *GROUPS]) + " |")
    print("| --- " * (len(lead) + 3 + len(GROUPS)) + "|")
    for r in records.values():
        shares = [f"{100 * sum(r['share'].get(k, 0) for k in keys):.0f}%" for keys in GROUPS.values()]
        if calibrated:
            cells = [os.path.basename(r["model"]), str(r["length"]), f"`{chosen_rung(r)}`",
                     ", ".join(f"{kl:.4f}" for kl in r["calibration_kl"])]
        else:
            cells = [f"`{r['spec']}`"]
        print("| " + " | ".join(cells + [f"{r['ratio']:.2f}x", f"{r['kl']:.4f}", f"{r['top1']:.1f}%", *shares]) + " |")


if __name__ == "__main__":
    main()
