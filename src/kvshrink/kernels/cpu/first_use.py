"""The first use of the CPU kernels on a machine: compiled in a background process while the torch path serves.

numba compiles kvshrink's kernels once per machine and loads them from its on-disk cache afterwards (well under
a second). The compilation itself takes from half a minute (Shard) to a few minutes (LRQK) on a small CPU. A
cache that waited for it would keep a new user staring at a silent prompt; instead, the first cache made on a
cold machine starts one background process that compiles the kernels into numba's cache, and decodes with the
torch path (the same answers, slower) for its whole life; torch runs one intra-op thread fewer until the
compile ends, leaving a core to it. A cache made once that process has finished loads the compiled kernels. A marker file beside numba's cache records which warm-ups have completed there, for this
exact copy of kvshrink (any edited source file changes its name).

``KVSHRINK_COMPILE=wait`` (or `wait_for_kernels`) compiles in the calling process instead, as the benchmarks
and the tests do: a timed or tested step must run the kernels, not the torch path.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvshrink.atomic_file import write_atomic
from kvshrink.kernels.compile_notice import compiling
from kvshrink.kernels.cpu import numba_support
from kvshrink.user_cache import cache_home

__all__ = ["prepare", "wait_for_kernels", "compiling_in_background", "finish_background"]

_log = logging.getLogger("kvshrink")
_ready: set[str] = set()                        # warm-ups done in this process (their markers' names)
_children: dict[str, tuple[subprocess.Popen, Path, str]] = {}   # marker name -> (process, its log, what)
_failed: set[str] = set()
_wait_override: bool | None = None
_stamp: str | None = None
_lowered_threads: tuple[int, int] | None = None   # (the torch thread count before a compile, the one set during it)


def wait_for_kernels(wait: bool | None = True) -> None:
    """Compile the kernels in this process on first use (True), in a background process (False), or as
    ``KVSHRINK_COMPILE`` says (None: ``wait`` or ``background``, the default)."""
    global _wait_override
    _wait_override = wait


def _waits() -> bool:
    if _wait_override is not None:
        return _wait_override
    mode = os.environ.get("KVSHRINK_COMPILE", "background")
    if mode not in ("background", "wait"):
        raise ValueError(f"KVSHRINK_COMPILE={mode!r}: expected 'background' or 'wait'")
    return mode == "wait"


def prepare(what: str, target: str, *args: int) -> bool:
    """Make the kernels that ``target(*args)`` warms up (``"module:function"``, int arguments) usable in this
    process. True when they are: loaded from numba's cache, or compiled now when waiting is asked for. False
    while a background process compiles them (started here on the first call): the caller takes its torch path.
    ``what`` names the method in messages."""
    if not numba_support.installed():
        return False
    name = _marker_name(target, args)
    if name in _ready:
        return True
    _kernels_held()                                   # reaps a background compilation that has finished
    marker = _marker_dir() / name
    if name not in _children and (marker.exists() or _waits()):
        with compiling(what):
            _run(target, args)
        if not marker.exists():
            _write_marker(marker, target, args)
        _ready.add(name)
        return True
    if name not in _children and name not in _failed:
        _start(what, target, args, marker)
    return False


def compiling_in_background() -> bool:
    """Whether a background compilation started by this process is still running."""
    _kernels_held()
    return bool(_children)


def _kernels_held() -> bool:
    """Whether this process leaves the numba kernels alone (`numba_support.available` is then False): while a
    background compilation runs, and after one failed. Reaps those that finished, and says once if one failed."""
    for name, (child, log, what) in list(_children.items()):
        code = child.poll()
        if code is None:
            continue
        del _children[name]
        if code != 0:
            _failed.add(name)
            _log.warning("kvshrink: compiling %s's CPU kernels failed (exit status %s; its output: %s); the "
                         "torch path decodes instead (the same answers, slower)", what, code, log)
    if not _children:
        _give_back_threads()
    held = bool(_children or _failed)
    if not held:
        numba_support.hold_kernels(None)
    return held


def finish_background(timeout: float | None = None) -> bool:
    """Wait for this process's background compilations; True when none is left running."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for child, _, _ in list(_children.values()):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            child.wait(left)
        except subprocess.TimeoutExpired:
            break
    return not compiling_in_background()


def _leave_a_core() -> None:
    """torch's intra-op threads, one fewer while a compiler runs beside them: an OpenMP pool that shares a core
    with a busy process slows down tens of times (LRQK's first 8 tokens on 2 cores: 39 s on 2 threads beside the
    compiler, 4.5 s on 1, 2.7 s on 1 alone; measured), even when that process runs at SCHED_IDLE."""
    global _lowered_threads
    threads = torch.get_num_threads()
    if _lowered_threads is None and threads > 1:
        torch.set_num_threads(threads - 1)
        _lowered_threads = (threads, threads - 1)


def _give_back_threads() -> None:
    """The thread count as it was, unless someone has set another since; from the main thread only (OpenMP's
    count is the calling thread's: a helper thread's poll leaves it to the next poll from the main thread)."""
    global _lowered_threads
    if _lowered_threads is not None and threading.current_thread() is threading.main_thread():
        before, during = _lowered_threads
        if torch.get_num_threads() == during:
            torch.set_num_threads(before)
        _lowered_threads = None


def _start(what: str, target: str, args: tuple[int, ...], marker: Path) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.gettempdir()) / f"kvshrink-compile-{marker.stem}.log"
    package_root = str(Path(__file__).resolve().parents[3])        # where `kvshrink` imports from
    paths = [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    threads = _lowered_threads[0] if _lowered_threads else torch.get_num_threads()   # the count after the compile
    with open(log, "w") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(marker), str(threads), target, *map(str, args)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)   # it finishes (and caches) even when this process is interrupted
    _children[marker.name] = (child, log, what)
    _leave_a_core()
    numba_support.hold_kernels(_kernels_held)
    _log.warning("kvshrink: compiling %s's CPU kernels in the background (first use on this machine: a minute or "
                 "more on a small CPU, cached afterwards); until then caches decode with the torch path (the same "
                 "answers, slower; torch runs one thread fewer meanwhile). KVSHRINK_COMPILE=wait compiles them before the first "
                 "step instead.", what)


def _run(target: str, args: tuple[int, ...]) -> None:
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(*args)


def _marker_name(target: str, args: tuple[int, ...]) -> str:
    key = json.dumps([_package_stamp(), target, list(args)])
    return "kvshrink-kernels-" + hashlib.sha256(key.encode()).hexdigest()[:20] + ".done"


def _package_stamp() -> str:
    """The numba, Python and CPU the kernels compile for, and every source file's size and modification time:
    numba's cache is invalid after an edit or an upgrade, and so is the marker."""
    global _stamp
    if _stamp is None:
        root = Path(__file__).resolve().parents[2]
        files = sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*.py"))
        numba = numba_support.numba
        _stamp = json.dumps([numba.__version__, sys.version, numba.config.CPU_NAME, files])
    return _stamp


def _marker_dir() -> Path:
    """Where numba caches the kernels: NUMBA_CACHE_DIR when set, else beside the sources when that is writable,
    else the user's cache folder (a marker then survives a deleted numba cache: that costs one compilation in
    the calling process, never a wrong answer)."""
    configured = numba_support.numba.config.CACHE_DIR
    if configured:
        return Path(configured)
    beside = Path(__file__).resolve().parent / "__pycache__"
    if os.access(beside if beside.exists() else beside.parent, os.W_OK):
        return beside
    return cache_home()


def _write_marker(marker: Path, target: str, args: tuple[int, ...]) -> None:
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        made = {"target": target, "args": list(args), "numba": numba_support.numba.__version__}
        write_atomic(marker, json.dumps(made).encode())
    except OSError:   # a read-only place: the next process loads numba's cache in the foreground, as fast
        pass


def _compile_here(marker: Path, threads: int, target: str, args: tuple[int, ...]) -> None:
    """The background process: one at a time per marker (a second waits, then finds the marker)."""
    torch.set_num_threads(threads)   # the kernel variants (serial or parallel) that thread count runs
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(marker.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists():
            started = time.perf_counter()
            _run(target, args)
            _write_marker(marker, target, args)
            print(f"compiled {target}{args} in {time.perf_counter() - started:.1f} s", flush=True)


# The background process runs only on CPU time the user's process leaves idle (Linux's SCHED_IDLE, for every thread
# it starts, set before it imports anything; elsewhere the lowest priority): a niced compiler, importing torch at
# full priority, slowed the torch path's first tokens on a 2-core machine tens of times.
_CHILD = ("import os, sys\n"
          "if hasattr(os, 'SCHED_IDLE'): os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
          "else: os.nice(19)\n"
          "from pathlib import Path\n"
          "from kvshrink.kernels.cpu.first_use import _compile_here\n"
          "_compile_here(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], tuple(int(a) for a in sys.argv[4:]))\n")
