"""A cold start says what it is doing: one log line while kernels compile, nothing for a cached load."""

from __future__ import annotations

import logging
import time

from kvshrink.kernels import compile_notice


def test_a_slow_compile_is_announced_once_and_a_quick_one_not(caplog, monkeypatch):
    monkeypatch.setattr(compile_notice, "_announced", set())
    with caplog.at_level(logging.WARNING, logger="kvshrink"):
        with compile_notice.compiling("quick", after=0.5):
            pass
        for _ in range(2):
            with compile_notice.compiling("slow", after=0.05):
                time.sleep(0.3)
        time.sleep(0.6)                       # past the quick one's delay: its timer was cancelled
    lines = [r.getMessage() for r in caplog.records if r.name == "kvshrink"]
    assert len(lines) == 1 and "compiling slow's CPU kernels" in lines[0], lines
