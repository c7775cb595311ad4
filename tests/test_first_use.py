"""The CPU kernels' first use on a machine (kernels/cpu/first_use.py): compiled in a background process into an
empty numba cache while the torch path serves, loaded once that process has finished; compiled in the calling
process when waiting is asked for; a failed compilation leaves the torch path, said once."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import tiny_model

import kvshrink
from kvshrink.kernels.cpu import first_use, numba_support

pytestmark = pytest.mark.skipif(not numba_support.installed(), reason="needs numba")

TINY = "kvshrink.kernels.cpu.numba_support:threading_layer_usable"   # one small kernel: seconds to compile


@pytest.fixture
def cold_machine(tmp_path, monkeypatch):
    """An empty numba cache (this process's marker folder and the background process's NUMBA_CACHE_DIR), nothing
    prepared yet, and no background process left running afterwards."""
    monkeypatch.setattr(numba_support.numba.config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    for name, empty in (("_ready", set()), ("_children", {}), ("_failed", set()), ("_wait_override", False),
                        ("_lowered_threads", None)):
        monkeypatch.setattr(first_use, name, empty)
    threads = torch.get_num_threads()
    yield tmp_path
    for child, _, _ in first_use._children.values():
        child.kill()
        child.wait()
    first_use.compiling_in_background()            # reaps them: torch's threads given back
    numba_support.hold_kernels(None)
    assert torch.get_num_threads() == threads


def test_a_cold_machine_compiles_in_the_background_then_loads(cold_machine):
    threads = torch.get_num_threads()
    assert first_use.prepare("tiny", TINY) is False           # started, not waited for
    assert first_use.compiling_in_background() and not numba_support.available()
    assert torch.get_num_threads() == max(1, threads - 1)     # a core left to the compiler
    assert first_use.prepare("tiny", TINY) is False           # one background process, not a second
    assert len(first_use._children) == 1
    assert first_use.finish_background(timeout=300)
    assert numba_support.available() and torch.get_num_threads() == threads
    [marker] = cold_machine.glob("kvshrink-kernels-*.done")
    assert first_use.prepare("tiny", TINY) is True            # loaded from numba's cache now


def test_waiting_compiles_in_this_process(cold_machine):
    first_use.wait_for_kernels(True)
    assert first_use.prepare("tiny", TINY) is True
    assert not first_use._children and list(cold_machine.glob("kvshrink-kernels-*.done"))


def test_a_failed_compilation_leaves_the_torch_path_and_says_so(cold_machine, caplog):
    with caplog.at_level(logging.WARNING, logger="kvshrink"):
        assert first_use.prepare("broken", "kvshrink.kernels.cpu.numba_support:no_such_warm_up") is False
        assert first_use.finish_background(timeout=300)
        assert not numba_support.available()                    # still left alone: the torch path serves
        assert not numba_support.available()
    failures = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1 and "kvshrink-compile-" in failures[0]
    assert not list(cold_machine.glob("kvshrink-kernels-*.done"))


def test_the_mode_is_checked(monkeypatch, cold_machine):
    monkeypatch.setattr(first_use, "_wait_override", None)
    monkeypatch.setenv("KVSHRINK_COMPILE", "later")
    with pytest.raises(ValueError, match="KVSHRINK_COMPILE='later'"):
        first_use.prepare("tiny", TINY)


def test_a_shard_cache_made_while_compiling_decodes_with_the_torch_path(cold_machine):
    """The first cache on a cold machine: the torch path for its whole life, the reference kernel's answers."""
    model = tiny_model()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    options = dict(sinks=4, window=8, min_block=8)
    first = kvshrink.make_cache("shard", model, **options)
    assert not first.layers[0].shared.fast and first_use.compiling_in_background()
    reference = kvshrink.make_cache("shard", model, kernel="reference", **options)
    with torch.no_grad():
        got = model.generate(ids, past_key_values=first, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        want = model.generate(ids, past_key_values=reference, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert torch.equal(got, want)
