"""Options are declared once (dataclass fields) and everything else is derived from that declaration."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import kvshrink
from kvshrink.cache.registry import declared_options, option, parse_method_spec, resolve_options, get_method
from kvshrink.eval.backend import KVShrinkBackend


@dataclass
class _Opts:
    bits: float = option(2.5, "bits", low=0, high=8, low_open=True)
    mode: str = option("a", "mode", choices=("a", "b"))
    rank: int | None = option(None, "rank", low=1)


def test_declared_options_take_type_default_help_and_range_from_the_field():
    opts = declared_options(_Opts)
    assert list(opts) == ["bits", "mode", "rank"]
    assert opts["bits"].kind is float and opts["bits"].default == 2.5 and opts["bits"].range_text() == "in (0, 8]"
    assert opts["rank"].kind is int and opts["rank"].coerce("rank", "3") == 3
    assert opts["rank"].coerce("rank", None) is None  # None is a value where the default is None
    with pytest.raises(ValueError, match=r"option 'bits' must be in \(0, 8\], got 0.0"):
        opts["bits"].coerce("bits", "0")
    with pytest.raises(ValueError, match=r"option 'mode' must be one of \['a', 'b'\]"):
        opts["mode"].coerce("mode", "c")
    with pytest.raises(ValueError, match="option 'bits' needs a value"):
        opts["bits"].coerce("bits", None)


def _documented_options() -> dict[str, dict[str, str]]:
    """Each method's options and defaults as the committed docs/options.md lists them."""
    import re
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "options.md").read_text()
    out: dict[str, dict[str, str]] = {}
    for section in text.split("\n## ")[1:]:
        name = section.split("`")[1]
        out[name] = dict(re.findall(r"^\| `(\w+)` \| `(.*?)` \|", section, flags=re.M))
    return out


def _bad_value(spec):
    """A value the declaration of ``spec`` refuses, or None when it allows every value of its type."""
    if spec.choices is not None:
        return "not-a-choice"
    if spec.low is not None:
        return spec.low - 1
    if spec.high is not None:
        return spec.high + 1
    return None


BUILTIN = [name for name in kvshrink.methods() if name != "hf-quantized"]  # (needs its backend installed)


@pytest.mark.parametrize("method", BUILTIN)
def test_a_cache_takes_exactly_the_documented_options_defaults_and_ranges(method):
    """What `make_cache` does with options, checked against the page users read: a cache made without
    options holds every documented option at its documented default (and nothing else); each option whose
    declaration has a range or choices refuses a value outside it, naming the option; an undocumented one
    (such as a removed option) is refused."""
    from conftest import tiny_model

    model = tiny_model(hidden_size=256)  # head size 64: every default group divides it
    documented = _documented_options()[method]
    cache = kvshrink.make_cache(method, model)
    spent = {"kl_budget": "0.0"} if method == "shard" else {}  # shard records its calibration's choice, budget spent
    assert {name: repr(value) for name, value in cache.options.items()} == \
        {name: default for name, default in documented.items()} | spent
    for name, spec in kvshrink.methods()[method].options.items():
        bad = _bad_value(spec)
        if bad is not None:
            with pytest.raises(ValueError, match=f"option '{name}'"):
                kvshrink.make_cache(method, model, **{name: bad})
    with pytest.raises(ValueError, match="unknown option.*'multi_turn'"):
        kvshrink.make_cache(method, model, multi_turn=True)


def test_one_parser_for_specs_and_cli_options():
    from kvshrink.cli import _parse_options

    assert parse_method_spec("streaming: window=8 ,sinks=2") == ("streaming", {"window": "8", "sinks": "2"})
    assert _parse_options(["window=8,sinks=2", "observe=3"]) == {"window": "8", "sinks": "2", "observe": "3"}
    with pytest.raises(ValueError, match="option 'window' given twice in method spec .* \\('8' and '16'\\)"):
        parse_method_spec("streaming:window=8,sinks=2,window=16")
    with pytest.raises(ValueError, match="option 'sinks' given twice in --option"):
        _parse_options(["window=8,sinks=2", "sinks=3"])
    with pytest.raises(ValueError, match="option 'sinks' given twice"):
        KVShrinkBackend().make_cache("streaming:sinks=2,sinks=3", None)   # the eval's specs: before the model
    for bad in ("streaming:window", "streaming:=3"):
        with pytest.raises(ValueError, match="expected key=value"):
            parse_method_spec(bad)
    with pytest.raises(ValueError, match="in --option: expected key=value"):
        _parse_options(["window"])
    assert resolve_options(get_method("streaming"), {"window": "8"})["window"] == 8
