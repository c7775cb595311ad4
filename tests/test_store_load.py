"""Load test: N worker processes answer M questions about K documents through one real redis-server
(scripts/store_bench.py, bounded: short documents, few new tokens). Every answer equals the
single-process answer and each document is prefilled once across all workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from redis_server import redis_server  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
# Two workers (each process loads the model: 15-40 s on 2 cores) and three documents: question j goes to
# worker j % 2 and is about document j % 3, so both workers ask about every document and race for its prefill.
WORKERS, QUESTIONS, DOCS = 2, 9, 3


@pytest.mark.model
@pytest.mark.redis
def test_many_workers_one_prefill_per_document_same_answers(redis_server, tmp_path):
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(ROOT / "scripts/store_bench.py"), "--store", redis_server.url,
           "--workers", str(WORKERS), "--questions", str(QUESTIONS), "--docs", str(DOCS),
           "--doc-chars", "600", "--method", "kivi", "--max-new-tokens", "3", "--timeout", "400", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["answered"] == QUESTIONS
    assert summary["computed_per_doc"] == {str(d): 1 for d in range(DOCS)}  # nothing recomputed
    assert summary["hits"] + summary["waited"] == QUESTIONS - DOCS
    assert summary["answers_equal_single_process"] is True
    assert all(s["stored_bytes"] and s["stored_bytes"] > s["file_bytes"] for s in summary["bytes_per_doc"])
    print(json.dumps({k: summary[k] for k in ("hits", "waited", "computed", "ttft_p50_s", "ttft_p95_s")}))
