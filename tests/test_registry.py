"""Options are declared once (dataclass fields) and everything else is derived from that declaration."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import kvshrink
from kvshrink.cache.registry import declared_options, option, parse_method_spec, resolve_options, get_method


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


def test_every_builtin_method_declares_its_options_in_one_dataclass():
    for name, info in kvshrink.methods().items():
        if info.options:
            assert info.config is not None, f"{name} declares options outside a dataclass"
            assert info.options == declared_options(info.config)
            defaults = info.config()  # the dataclass's defaults are the documented ones
            for opt, spec in info.options.items():
                assert getattr(defaults, opt) == spec.default, (name, opt)


def test_one_parser_for_specs_and_cli_options():
    from kvshrink.cli import _parse_options

    assert parse_method_spec("streaming: window=8 ,sinks=2") == ("streaming", {"window": "8", "sinks": "2"})
    assert _parse_options(["window=8,sinks=2", "sinks=3"]) == {"window": "8", "sinks": "3"}
    for bad in ("streaming:window", "streaming:=3"):
        with pytest.raises(ValueError, match="expected key=value"):
            parse_method_spec(bad)
    with pytest.raises(ValueError, match="in --option: expected key=value"):
        _parse_options(["window"])
    assert resolve_options(get_method("streaming"), {"window": "8"})["window"] == 8
