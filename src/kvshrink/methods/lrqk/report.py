"""What LRQK reports about its decode: data-movement counters, per-step logs, the top-k mass recall.

A layer keeps its counters as a plain dict and its per-step log as a list (they are saved and copied
with the cache); the functions here fill and summarise them.
"""

from __future__ import annotations

import torch

from kvshrink.cache.rowwise import one_row_layers


def new_counters() -> dict[str, float]:
    return {"decode_steps": 0, "selected_rows": 0, "missed_rows": 0, "bytes_moved": 0,
            "prefetch_rows": 0, "prefetch_hits": 0, "prefetch_bytes": 0,
            "recall_sum": 0.0, "oracle_sum": 0.0, "recall_count": 0}


def record_fill(counters: dict, step_log: list, report) -> None:
    """Count one decode step's slot fill (``tiers.FillReport``)."""
    c = counters
    c["decode_steps"] += 1
    c["selected_rows"] += report.selected
    c["missed_rows"] += report.missed
    c["bytes_moved"] += report.bytes_moved
    c["prefetch_hits"] += report.prefetch_hits
    step_log.append((report.selected, report.missed, report.bytes_moved))


def record_prefetch(counters: dict, tokens: torch.Tensor, rows: torch.Tensor) -> None:
    counters["prefetch_rows"] += tokens.numel()
    counters["prefetch_bytes"] += rows.numel() * rows.element_size()


def record_mass_recall(counters: dict, query: torch.Tensor, keys: torch.Tensor, scaling: float,
                       pad_len: torch.Tensor | None, selected: torch.Tensor) -> None:
    """Exact attention mass (over the candidates ``keys [B·H_kv, n, d]``) that the selection
    ``[B·H_kv, k]`` covers, per query head, summed into the counters next to the best any per-KV-head
    selection of the same size can do: how well the proxy scores find the true top-k."""
    b, hq, _, d = query.shape
    rows, candidates = keys.shape[0], keys.shape[1]
    hkv = rows // b
    q = query.reshape(rows, hq // hkv, d).float()
    logits = (q @ keys.to(q.device).float().transpose(-1, -2)) * scaling   # [B·H_kv, G, n]
    if pad_len is not None:
        pad = torch.arange(candidates, device=q.device)[None, :] < pad_len.to(q.device)[:, None]
        logits = logits.masked_fill(pad.repeat_interleave(hkv, 0)[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    covered = torch.gather(probs, 2, selected.to(q.device)[:, None, :].expand(-1, hq // hkv, -1)).sum(-1)
    best = torch.topk(probs.sum(1), selected.shape[1], dim=-1).indices
    oracle = torch.gather(probs, 2, best[:, None, :].expand(-1, hq // hkv, -1)).sum(-1)
    counters["recall_sum"] += float(covered.sum())
    counters["oracle_sum"] += float(oracle.sum())
    counters["recall_count"] += covered.numel()


def layer_stats(counters: dict, step_log: list, fast_tier_bytes: int, slow_tier_bytes: int) -> dict[str, float]:
    """One layer's counters and the rates derived from them (``CacheLayer.stats``)."""
    c = counters
    out = {k: float(v) for k, v in c.items()}
    out["miss_rate"] = c["missed_rows"] / c["selected_rows"] if c["selected_rows"] else 0.0
    steps = max(1, c["decode_steps"])
    # Per decode step of this layer; KVShrinkCache.stats() sums layers, giving per-token figures.
    out["rows_moved_per_token"] = c["missed_rows"] / steps
    out["bytes_moved_per_token"] = (c["bytes_moved"] + c["prefetch_bytes"]) / steps
    warm = step_log[1:]
    sel = sum(s for s, _, _ in warm)
    out["warm_miss_rate"] = sum(m for _, m, _ in warm) / sel if sel else 0.0
    if c["recall_count"]:
        out["topk_mass_recall_rate"] = c["recall_sum"] / c["recall_count"]
        out["topk_mass_oracle_rate"] = c["oracle_sum"] / c["recall_count"]
    out["fast_tier_bytes"] = float(fast_tier_bytes)
    out["slow_tier_bytes"] = float(slow_tier_bytes)
    return out


def step_report(cache) -> list[dict[str, float]]:
    """Per decode step, over all layers of an lrqk cache: miss rate, rows and bytes moved."""
    logs = [layer.step_log for layer in one_row_layers(cache.layers)]
    steps = min((len(log) for log in logs), default=0)
    out = []
    for i in range(steps):
        sel = sum(log[i][0] for log in logs)
        miss = sum(log[i][1] for log in logs)
        out.append({"step": i, "miss_rate": miss / sel if sel else 0.0, "rows_moved": miss,
                    "bytes_moved": sum(log[i][2] for log in logs)})
    return out
