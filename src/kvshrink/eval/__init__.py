"""Evaluation harness: ``kvshrink eval`` and ``kvshrink report``.

Tasks (all generated locally from a seed, see ``tasks.py``): ``niah`` (length x depth grid),
``ruler`` (eight RULER-style synthetic tasks), ``ppl`` (perplexity of an essay continuation through
the cache), ``agreement`` (greedy decode against the full cache in five domains) and ``cost`` (bytes,
prefill and decode time as ratios to full, peak memory; one subprocess per method and repeat).

A run writes ``rows.jsonl`` (one line per method spec x sample, appended as each finishes, so an
interrupted run resumes), ``config.json``, ``results.csv``, ``summary.md`` and PNG plots.
"""
