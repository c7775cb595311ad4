"""``kvshrink eval`` and ``kvshrink report``; the main CLI calls ``register(subparsers)``."""
from __future__ import annotations

import argparse
import os
import sys
import time

from kvshrink.cache.registry import split_specs
from kvshrink.cli import add_device_arguments

from .suites import SUITES
from .tasks import TASKS

EPILOG = """\
A method spec is name[:key=value,...], e.g. "shard:stream_bits=4". `full` is always run as the
reference. Rerunning the same command skips the rows already in --out (Ctrl-C keeps finished rows).
examples:
  kvshrink eval --suite quick --methods full,streaming --out results/quick
  kvshrink eval niah --methods full,streaming:window=256 --lengths 1024,4096 --depths 0,50,100 --out results/niah
  kvshrink report results/quick
"""


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def register(subparsers) -> None:
    ev = subparsers.add_parser("eval", help="evaluate cache methods (NIAH, RULER, perplexity, agreement, cost)",
                               description="Evaluate KV cache methods against the full cache.", epilog=EPILOG,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("task", nargs="?", default=None,
                    help=f"run one task (or a comma list) of the suite: {', '.join(TASKS)}; default all")
    ev.add_argument("--suite", default="standard", help=f"one of {', '.join(SUITES)} (default standard)")
    ev.add_argument("--methods", required=True, help='comma-separated method specs, e.g. "full,streaming:window=256"')
    ev.add_argument("--lengths", type=_int_list, help="context lengths in tokens (all tasks but agreement)")
    ev.add_argument("--depths", type=_float_list, help="NIAH needle depths in percent, e.g. 0,25,50,75,100")
    ev.add_argument("--subtasks", help="RULER subtasks / agreement domains to run (comma list; default all)")
    ev.add_argument("--samples", type=int, help="samples per task setting")
    ev.add_argument("--limit", type=int, help="at most this many prompts per task")
    ev.add_argument("--repeats", type=int, help="cost: repeats per method (medians are reported)")
    ev.add_argument("--interleave", action="store_true",
                    help="cost: every method in one process per repeat, decoded one step of each in turn (steady "
                         "ratios on a machine whose speed drifts; no peak memory)")
    ev.add_argument("--agreement-tokens", type=int, help="agreement: greedy tokens decoded")
    ev.add_argument("--max-new-tokens", type=int, help="NIAH/RULER answer budget (default per task)")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--threads", type=int, help="torch CPU threads")
    ev.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: embedded SmolLM2)")
    add_device_arguments(ev)
    ev.add_argument("--out", required=True, help="results folder (created; reruns resume it)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars")
    ev.set_defaults(func=run_eval)

    rep = subparsers.add_parser("report", help="print the summary of a results folder and redraw its plots; "
                                "export it for publishing; redraw the published tables",
                                epilog="examples:\n  kvshrink report results/quick\n"
                                "  kvshrink report results/headline-smollm2 --export benchmarks/headline/smollm2.json\n"
                                "  kvshrink report --docs README.md docs/benchmarks.md   # redraw from benchmarks/\n"
                                "  kvshrink report --docs README.md docs/benchmarks.md --check",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    rep.add_argument("out", nargs="?", help="results folder written by kvshrink eval")
    rep.add_argument("--export", metavar="FILE",
                     help="also write the folder's rows, commands, commit and machine as one JSON file to publish")
    rep.add_argument("--docs", nargs="+", metavar="DOC",
                     help="redraw the tables between `<!-- table:KIND PATH -->` markers in these Markdown files "
                          "from their data files (paths relative to the current folder, the repository root)")
    rep.add_argument("--check", action="store_true", help="with --docs: change nothing, fail if a table is stale")
    rep.set_defaults(func=run_report)


def run_eval(args: argparse.Namespace) -> int:
    # every row must come from the kernels a warm machine runs, not from the torch path that serves while
    # they compile in the background on first use: compile them before the first step (the cost jobs'
    # processes inherit this)
    os.environ["KVSHRINK_COMPILE"] = "wait"
    from .report import write_report
    from .results import write_config
    from .runner import RunOptions, Runner
    from .suites import resolve_suite

    tasks = [t.strip() for t in args.task.split(",")] if args.task else None
    subtasks = [t.strip() for t in args.subtasks.split(",")] if args.subtasks else None
    suite = resolve_suite(args.suite, tasks, args.lengths, args.depths, args.samples,
                          args.agreement_tokens, args.repeats, subtasks)
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    if args.interleave and "cost" not in suite.tasks:
        raise ValueError(f"--interleave applies to the cost task only; this run has {', '.join(suite.tasks)}")
    options = RunOptions(seed=args.seed, max_new_tokens=args.max_new_tokens, limit=args.limit,
                         threads=args.threads, model_ref=args.model, device=args.device, dtype=args.dtype,
                         progress=not args.no_progress, interleave=args.interleave)
    runner = Runner(args.out, split_specs(args.methods), suite, options)
    write_config(args.out, {"argv": ["kvshrink"] + sys.argv[1:], "specs": runner.specs,
                            "suite": _suite_dict(suite), "options": vars(options)})
    t0 = time.perf_counter()
    interrupted = False
    try:
        written = runner.run()
    except KeyboardInterrupt:
        interrupted = True
        written = None
    elapsed = time.perf_counter() - t0
    try:
        print(write_report(args.out))
    except ValueError:
        pass  # interrupted before the first row
    if interrupted:
        print(f"interrupted after {elapsed:.0f} s; finished rows are kept in {args.out}: "
              "rerun the same command to continue", file=sys.stderr)
        return 130
    print(f"{written} new rows in {elapsed:.0f} s; results in {args.out}", file=sys.stderr)
    return 0


def _suite_dict(suite) -> dict:
    from dataclasses import asdict

    return {"name": suite.name, "ppl_tokens": suite.ppl_tokens,
            "tasks": {k: asdict(v) for k, v in suite.tasks.items()}}


def run_report(args: argparse.Namespace) -> int:
    import os

    from .published import export_results, stale_docs
    from .report import write_report

    if args.out is None and not args.docs:
        raise ValueError("give a results folder, or --docs FILE... to redraw the published tables")
    if args.export and args.out is None:
        raise ValueError("--export needs the results folder to export")
    if args.check and not args.docs:
        raise ValueError("--check applies to --docs")
    if args.out is not None:
        print(write_report(args.out))
        if args.export:
            export_results(args.out, args.export)
            print(f"exported to {args.export}", file=sys.stderr)
    if args.docs:
        stale = stale_docs(args.docs, os.getcwd(), write=not args.check)
        verb = "stale" if args.check else "redrawn"
        print(f"{verb}: {', '.join(stale)}" if stale else "every table is up to date", file=sys.stderr)
        if args.check and stale:
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvshrink.eval``: the same subcommands without the main CLI."""
    parser = argparse.ArgumentParser(prog="kvshrink")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        parser.exit(2, f"kvshrink: error: {err}\n")
