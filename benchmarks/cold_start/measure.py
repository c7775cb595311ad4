"""Cold-start time of a method: import kvshrink, load the embedded model, make a cache, generate 8 new tokens.

Run it in a fresh process with an empty numba cache, so every kernel compiles:
    NUMBA_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python benchmarks/cold_start/measure.py lrqk --out results.jsonl

It prints one JSON line (and appends it to --out): the method, the commit, whether the numba cache was empty,
the compile mode (KVSHRINK_COMPILE: on a cold machine the default compiles the kernels in a background process
while the torch path serves), which path decoded (``kernels``: numba or torch), the seconds of each phase, the
seconds from the cache's making until the background compilation had finished (``compiled_after_s``, waited for
after the tokens; 0 when none ran), the machine's load average at start and end (the machines are shared) and
the time. results.jsonl holds the runs; their ``wall_s`` is the process's time from launch to exit, measured
around it, and ``machine`` says what else ran.
"""
import time

START = time.perf_counter()  # before torch and kvshrink are imported: importing them is part of a cold start

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
NEW_TOKENS = 8


def commit() -> str | None:
    """The checkout's short commit, or None outside a git checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
    except OSError:
        return None
    return done.stdout.strip() or None


def numba_cache_state() -> str:
    """"empty" when NUMBA_CACHE_DIR names an empty or missing folder (every kernel compiles), else "as found"."""
    folder = os.environ.get("NUMBA_CACHE_DIR")
    if folder and (not os.path.isdir(folder) or not os.listdir(folder)):
        return "empty"
    return "as found"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method", help="a method spec, e.g. shard or lrqk:rank=16")
    parser.add_argument("--out", help="a JSONL file the record is appended to")
    args = parser.parse_args(argv)
    numba_cache, load_start = numba_cache_state(), [round(x, 2) for x in os.getloadavg()]

    import torch
    import kvshrink
    from kvshrink.cache import parse_method_spec
    from kvshrink.kernels.cpu import first_use, numba_support

    model, tok = kvshrink.load_model()
    loaded = time.perf_counter()
    method, options = parse_method_spec(args.method)
    cache = kvshrink.make_cache(method, model, **options)
    made = time.perf_counter()
    # a cache made while its kernels compile in the background decodes with the torch path for its whole life
    kernels = "numba" if numba_support.available() and not first_use.compiling_in_background() else "torch"
    ids = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        model.generate(**ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False)
    done = time.perf_counter()
    first_use.finish_background()
    record = dict(method=args.method, code=commit(), numba_cache=numba_cache,
                  compile_mode=os.environ.get("KVSHRINK_COMPILE", "background"), kernels=kernels,
                  import_load_s=round(loaded - START, 1), make_cache_s=round(made - loaded, 1),
                  generate8_s=round(done - made, 1), total_s=round(done - START, 1),
                  compiled_after_s=round(time.perf_counter() - made, 1) if kernels == "torch" else 0.0,
                  load_start=load_start,
                  load_end=[round(x, 2) for x in os.getloadavg()],
                  utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"))
    print(json.dumps(record), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
