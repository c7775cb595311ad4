"""The README's tables from `kl_continuation.py`'s JSON lines: one row per spec (the last line of a spec wins).

    python benchmarks/shard-ratio/table.py RESULTS.jsonl [RESULTS.jsonl ...]
"""
import json
import sys

GROUPS = {"key codes": ("middle_k_codes",), "value codes": ("middle_v_codes",), "salient": ("middle_salient",),
          "window + sinks": ("window", "sinks"), "key bases": ("middle_k_bases",)}


def rows(paths: list[str]) -> dict[str, dict]:
    latest = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                latest[record["spec"]] = record
    return latest


def main(argv=None):
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        raise SystemExit(__doc__)
    print("| spec | ratio | KL nats | top-1 | " + " | ".join(GROUPS) + " |")
    print("| --- " * (4 + len(GROUPS)) + "|")
    for spec, r in rows(paths).items():
        shares = [f"{100 * sum(r['share'].get(k, 0) for k in keys):.0f}%" for keys in GROUPS.values()]
        print(f"| `{spec}` | {r['ratio']:.2f}x | {r['kl']:.4f} | {r['top1']:.1f}% | " + " | ".join(shares) + " |")


if __name__ == "__main__":
    main()
