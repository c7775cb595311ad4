"""The results folder: rows.jsonl (one JSON line per method spec x sample), config.json, CSV."""
from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import sys
from typing import Any, Iterable

ROWS = "rows.jsonl"
CONFIG = "config.json"
CSV = "results.csv"

# The CSV column order; dict-valued fields are written as JSON text.
CSV_FIELDS = (
    "spec", "method", "options", "task", "subtask", "length", "actual_tokens", "depth", "sample",
    "score", "ppl", "ppl_ratio", "kl", "top1", "agreement", "first_divergence", "answer", "expected",
    "nbytes", "fp16_nbytes", "ratio", "breakdown", "stats", "prefill_s", "prefill_shared", "decode_ms_per_token",
    "prefill_ratio", "decode_ratio", "peak_rss_mb", "peak_rss_delta_mb", "peak_device_mb",
    "device", "dtype", "started", "finished",
)


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def prompt_digest(input_ids: list[int], target_ids: list[int] = ()) -> str:
    h = hashlib.sha1(json.dumps([list(input_ids), list(target_ids)]).encode())
    return h.hexdigest()[:16]


def row_key(row: dict) -> tuple:
    return (row["spec"], row["task"], row["subtask"], row["length"], row["depth"], row["sample"],
            row.get("prompt_sha"))


def read_rows(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, ROWS)
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                # A line cut by Ctrl-C or a crash: its sample simply runs again.
                continue
    return rows


class RowWriter:
    """Appends rows and flushes each one, so an interrupted run keeps every finished row."""

    def __init__(self, out_dir: str):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, ROWS)

    def write(self, row: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, sort_keys=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def library_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "kvshrink", "numpy", "matplotlib"):
        try:
            module = __import__(name)
            versions[name] = str(getattr(module, "__version__", "unknown"))
        except Exception:  # a missing optional library is reported, not fatal
            versions[name] = "not installed"
    return versions


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:
        pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    return info


def code_commit() -> str | None:
    """The short commit of the kvshrink checkout that runs, ``+changes`` when its sources differ from it; None
    outside a git checkout."""
    cwd = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "src"], cwd=cwd,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out + ("+changes" if dirty else "")


def write_config(out_dir: str, config: dict) -> None:
    """config.json keeps the first run's description and appends each resumed run's argv and commit."""
    path = os.path.join(out_dir, CONFIG)
    runs = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            runs = json.load(fh).get("runs", [])
    runs.append({"argv": config.get("argv"), "started": now(), "commit": code_commit()})
    config = {**config, "runs": runs, "versions": library_versions(), "machine": machine()}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, default=str)


def write_csv(out_dir: str, rows: Iterable[dict]) -> str:
    path = os.path.join(out_dir, CSV)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in row.items()})
    return path
