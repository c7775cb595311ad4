"""How far a model's answers move under Shard's coding, measured once per model: `calibrate_shard` picks the
cheapest setting of a short ladder whose KL(full || shard) on a calibration text stays within a budget.

Models read their contexts alike (the same share of attention lands on the tokens Shard codes cheaply), but
they differ several-fold in how far their next-token distributions move for the same coding error. A fixed
setting is then either too careful for the tolerant model or too lossy for the sensitive one; the budget is
the one number both share. The calibration text is Python standard library source (present wherever Python
is, nothing to download; the tokenizer makes it the model's own tokens): a prefix is prefilled keeping every
token, a continuation teacher-forced, and its next-token distributions compared with the model's uncached
ones.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import logging
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from kvshrink.cache.option_text import format_options
from kvshrink.cache.registry import get_method, make_cache, resolve_options
from kvshrink.identity import model_fingerprint
from kvshrink.methods.shard.config import DEFAULT_KL_BUDGET
from kvshrink.models import TOKENIZER_ATTRIBUTE, model_tokenizer
from kvshrink.user_cache import cache_home, read_entry, write_entry

_log = logging.getLogger("kvshrink")

# Settings of the compressed middle, the cheapest first: fewer 8-bit salient rows, more attention coded
# cold at fewer bits, a shorter exact window. The last one is the fallback when none is within the budget.
# The cheap rung's cold block is judged by the prompt's last 256 queries as well as by its last 64: judged by
# the 64 alone (the question), it takes tokens that a copy written later needs; by the 256 alone, tokens the
# continuation reads next.
LADDER: tuple[dict[str, float | int], ...] = (
    dict(window=16, salient=0.01, cold=0.15, cold_key_bits=0.75, observe=256, observe_tail=64),
    dict(window=32, salient=0.05, cold=0.05, cold_key_bits=1.0, observe=64, observe_tail=0),
)
LADDER_OPTIONS = frozenset(name for rung in LADDER for name in rung)
# Options the rungs are measured without (every token kept): they do not change the choice.
UNMEASURED_OPTIONS = frozenset({"evict", "ratio", "keep_tokens", "kl_budget"})
CALIBRATION_MODULES = ("textwrap", "argparse", "json.decoder", "pathlib", "dataclasses", "functools")
PREFIX_TOKENS = 2048
CONTINUATION_TOKENS = 256


@dataclass
class ShardCalibration:
    """What `calibrate_shard` measured: the options chosen, and the KL of each rung tried (cheapest first)."""

    options: dict
    kl_budget: float
    tried: list[tuple[dict, float]]

    @property
    def spec(self) -> str:
        """The chosen options as a method spec (``shard:key=value,...``), for the CLI and the evaluation."""
        return "shard:" + format_options(self.options)


def refuse_ladder_options(named, who: str) -> None:
    """ValueError when ``named`` (option names a caller passed) include one the ladder chooses."""
    chosen_by_ladder = sorted(LADDER_OPTIONS & set(named))
    if chosen_by_ladder:
        raise ValueError(f"{who} chooses {sorted(LADDER_OPTIONS)}; do not pass {', '.join(chosen_by_ladder)}")


def settle_named_options(options: dict, named: frozenset[str]) -> dict:
    """Shard's rule for the options a caller named: ``kl_budget`` chooses the ladder's options, so a caller who
    names one of them chooses them instead (``kl_budget`` is then 0, the other ladder options at their
    defaults, the careful rung), and one who names both is refused rather than overridden."""
    if "kl_budget" in named:
        if options["kl_budget"] > 0:
            refuse_ladder_options(named, "shard: kl_budget")
        return options
    if LADDER_OPTIONS & named:
        return {**options, "kl_budget": 0.0}
    return options


def calibration_text() -> str:
    """The calibration text: the source of a few standard library modules, joined by blank lines."""
    return "\n\n".join(inspect.getsource(importlib.import_module(name)) for name in CALIBRATION_MODULES)


def continuation_logprobs(model: torch.nn.Module, prefix: torch.Tensor, continuation: torch.Tensor,
                          cache) -> torch.Tensor:
    """``[n, vocab]`` float32 log-probabilities of the ``n`` tokens after ``prefix``: ``prefix`` prefilled into
    ``cache`` in one call, then ``continuation[:, :-1]`` teacher-forced in one more (the prefix's last
    distribution and the continuation's own, ``n = continuation`` length)."""
    with torch.no_grad():
        first = model(prefix, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:]
        rest = model(continuation[:, :-1], past_key_values=cache, use_cache=True).logits
    return torch.cat([first, rest], 1).float().log_softmax(-1)[0]


def kl_per_token(reference: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Mean KL(reference || logprobs) in nats per token, both ``[n, vocab]`` log-probabilities."""
    return float((reference.exp() * (reference - logprobs)).sum(-1).mean())


def check_calibration(kl_budget: float, options: dict) -> None:
    """ValueError naming what is wrong with a calibration's budget or options (before any model runs)."""
    if not kl_budget > 0:
        raise ValueError(f"calibrate_shard: kl_budget must be a KL above 0 nats per token, got {kl_budget!r}")
    if "kl_budget" in options:
        raise ValueError("calibrate_shard: the budget is its own argument (kl_budget, or --kl-budget), not an option")
    refuse_ladder_options(options, "calibrate_shard")
    resolve_options(get_method("shard"), options)  # an unknown or malformed option


def calibrate_shard(model: torch.nn.Module, tokenizer, kl_budget: float = DEFAULT_KL_BUDGET,
                    **options) -> ShardCalibration:
    """Shard's options for ``model``: ``options`` with the cheapest `LADDER` rung whose KL(full || shard) on the
    calibration text is at most ``kl_budget`` nats per token, or the last rung when none is.

    ``options`` are any other Shard options (strings as in a method spec, or values); they may not name the
    rungs' own options (`LADDER_OPTIONS`), which this chooses. The rungs are
    measured keeping every token (``evict=0``); the returned options keep ``evict`` as given. Costs one uncached
    forward over ``PREFIX_TOKENS + CONTINUATION_TOKENS`` tokens and one cached forward per rung tried.
    """
    check_calibration(kl_budget, options)
    return _calibrate(model, _calibration_ids(tokenizer, model), kl_budget, options)


def _calibrate(model: torch.nn.Module, ids: tuple[torch.Tensor, torch.Tensor], kl_budget: float,
               options: dict) -> ShardCalibration:
    from transformers import DynamicCache

    prefix, continuation = ids
    reference = continuation_logprobs(model, prefix, continuation, DynamicCache())
    tried = []
    for rung in LADDER:
        cache = make_cache("shard", model, **{**options, **rung, "evict": 0})
        kl = kl_per_token(reference, continuation_logprobs(model, prefix, continuation, cache))
        tried.append((dict(rung), kl))
        if kl <= kl_budget:
            break
    chosen = {**options, **tried[-1][0]}
    return ShardCalibration(options=chosen, kl_budget=kl_budget, tried=tried)


# model -> {(kl_budget, the other options): the rung chosen}: a model is measured once per budget and options
_CHOSEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def calibrated_options(model: torch.nn.Module, options: dict) -> dict:
    """Shard's resolved ``options`` as given when ``kl_budget`` is 0; else with the ladder's options chosen for
    ``model`` and ``kl_budget`` set to 0: measured by `calibrate_shard` on the first call for a model, budget and
    options, remembered for the calls after (a cache per prompt calibrates once) and stored for later processes
    (`calibration_entry`). Without a tokenizer for the calibration text, the last (careful) rung, with a
    warning. `settle_named_options` has refused a ladder option named beside the budget."""
    if options["kl_budget"] <= 0:
        return options
    measured = {k: v for k, v in options.items() if k not in LADDER_OPTIONS | UNMEASURED_OPTIONS}
    key = (options["kl_budget"], tuple(sorted(measured.items())))
    chosen = _CHOSEN.setdefault(model, {})
    if key not in chosen:
        chosen[key] = _stored_or_measured_rung(model, options["kl_budget"], measured)
    return {**options, **chosen[key], "kl_budget": 0.0}


def _stored_or_measured_rung(model: torch.nn.Module, kl_budget: float, measured: dict) -> dict:
    tokenizer = model_tokenizer(model)
    if tokenizer is None:
        warnings.warn(f"kvshrink: shard's kl_budget measures the model on a calibration text, and this model has no "
                      f"tokenizer (none attached as model.{TOKENIZER_ATTRIBUTE}, none saved beside it): using the "
                      f"careful setting {format_options(LADDER[-1])}. Load the model with kvshrink.load_model, or "
                      f"set model.{TOKENIZER_ATTRIBUTE} = tokenizer, to let it choose", stacklevel=5)
        return dict(LADDER[-1])
    ids = _calibration_ids(tokenizer, model)
    entry = calibration_entry(model, ids, kl_budget, measured)
    rung = read_entry(entry)
    if rung not in LADDER:   # none stored, or one another ladder chose
        _log.warning("kvshrink: measuring shard's coding on this model for kl_budget=%g (once per model and "
                     "options; stored in %s)...", kl_budget, entry.parent)
        rung = _calibrate(model, ids, kl_budget, measured).tried[-1][0]
        write_entry(entry, rung)
    return rung


def calibration_entry(model: torch.nn.Module, ids: tuple[torch.Tensor, torch.Tensor], kl_budget: float,
                      others: dict) -> Path:
    """Where the rung chosen for this model, budget and options is stored between processes: named by a SHA-256
    of everything the choice depends on (the model's fingerprint, dtype and device, the calibration tokens
    ``ids``, the ladder, the budget and options, and kvshrink's source), so a change in any of them measures
    again."""
    prefix, continuation = ids
    key = hashlib.sha256()
    for part in (model_fingerprint(model), next(model.parameters()).device.type,
                 json.dumps([LADDER, kl_budget, sorted(others.items())], default=str), _source_digest()):
        key.update(part.encode())
    key.update(torch.cat([prefix, continuation], 1).cpu().numpy().tobytes())
    return cache_home() / "calibrations" / f"shard-{key.hexdigest()[:40]}.json"


@functools.cache
def _source_digest() -> str:
    """SHA-256 of kvshrink's Python source: a calibration measured with other code is measured again."""
    package = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()


def _calibration_ids(tokenizer, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids = tokenizer(calibration_text(), add_special_tokens=False, return_tensors="pt")["input_ids"]
    need = PREFIX_TOKENS + CONTINUATION_TOKENS
    if ids.shape[1] < need:
        raise ValueError(f"calibrate_shard: the calibration text is {ids.shape[1]} tokens with this tokenizer; "
                         f"{need} are needed")
    ids = ids[:, :need].to(next(model.parameters()).device)
    return ids[:, :PREFIX_TOKENS], ids[:, PREFIX_TOKENS:]

