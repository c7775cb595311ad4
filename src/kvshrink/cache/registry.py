"""The method registry: names, options, validation, and ``make_cache``.

A method declares its options once, as the fields of a dataclass made with :func:`option` (default,
help, choices, range); validation, ``kvshrink methods``, the CLI and docs/options.md all read them::

    @dataclass
    class StreamingOptions:
        sinks: int = option(4, "tokens kept at the start of each row", low=0)
        window: int = option(1024, "most recent tokens kept", low=1)

    @register_method("streaming", "StreamingLLM: ...", options=StreamingOptions)
    class StreamingLayer(CacheLayer):
        def __init__(self, spec: LayerSpec, options: StreamingOptions): ...
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvshrink.cache.option_text import parse_options

_BOOL_WORDS = {"true": True, "on": True, "yes": True, "1": True,
               "false": False, "off": False, "no": False, "0": False}


@dataclass(frozen=True)
class Option:
    """One option of a method. ``type`` defaults to the type of ``default``; ``low``/``high`` bound a
    number (inclusive unless ``low_open``/``high_open``); ``None`` is accepted where the default is None."""

    default: Any
    help: str
    type: type | None = None
    choices: tuple | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def range_text(self) -> str | None:
        """The allowed range, e.g. ``in (0, 8]`` or ``>= 1``; None when unbounded."""
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high}"
        return None

    def in_range(self, value: Any) -> bool:
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return True
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or not (value >= self.high if self.high_open else value > self.high)

    @property
    def kind(self) -> type:
        if self.type is not None:
            return self.type
        return type(self.default) if self.default is not None else str

    def coerce(self, name: str, value: Any) -> Any:
        """Convert ``value`` (possibly a CLI string) to the option's type, or raise ValueError."""
        kind = self.kind
        try:
            if value is None:
                out = None
            elif kind is bool:
                out = _BOOL_WORDS[value.lower()] if isinstance(value, str) else value
                if not isinstance(out, bool):
                    raise ValueError
            elif kind is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError
                out = int(value)
            elif kind is float:
                out = float(value)
            else:
                out = kind(value)
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"option '{name}' expects {kind.__name__}, got {value!r}") from None
        if out is None and self.default is not None:
            raise ValueError(f"option '{name}' needs a value ({kind.__name__})")
        if self.choices is not None and out not in self.choices:
            raise ValueError(f"option '{name}' must be one of {list(self.choices)}, got {out!r}")
        if not self.in_range(out):
            raise ValueError(f"option '{name}' must be {self.range_text()}, got {out!r}")
        return out


_OPTION = "kvshrink_option"


def option(default: Any, help: str, *, choices: tuple | None = None, low: float | None = None,
           high: float | None = None, low_open: bool = False, high_open: bool = False) -> Any:
    """A dataclass field declaring one method option (its type comes from the field's annotation)."""
    spec = Option(default, help, None, tuple(choices) if choices is not None else None, low, high,
                  low_open, high_open)
    return field(default=default, metadata={_OPTION: spec})


def declared_options(config: type) -> dict[str, Option]:
    """The options a dataclass declares with :func:`option`, typed by its annotations."""
    hints = typing.get_type_hints(config)
    out = {}
    for f in dataclasses.fields(config):
        spec = f.metadata.get(_OPTION)
        if spec is not None:
            out[f.name] = dataclasses.replace(spec, type=_plain_type(hints[f.name]))
    return out


def _plain_type(hint: Any) -> type:
    """``int | None`` -> ``int``; a plain class is returned as is."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


@dataclass(frozen=True)
class MethodInfo:
    name: str
    description: str
    options: dict[str, Option]
    build: Callable[..., Any] = field(repr=False)  # build(model, info, **options) -> cache
    config: type | None = field(default=None, repr=False)  # the options dataclass, if the method has one
    module: str = ""  # where the method is defined (kvshrink's own methods: kvshrink.methods.*)
    undoes_rope: bool = False  # the method re-rotates keys: make_cache refuses RoPE types it cannot undo exactly
    # settle_named(options, named) -> options: the method's last word on the resolved options given the names
    # the caller passed (a default passed explicitly is still a choice): it refuses options that exclude each
    # other, or lets a named option turn off a default that would otherwise choose it
    settle_named: Callable[[dict[str, Any], frozenset[str]], dict[str, Any]] | None = field(default=None, repr=False)
    # choose(model, options) -> options: what the method decides per model before a cache is built (a
    # calibration); the cache records the result, so a store scopes and a saved file reloads by it
    choose: Callable[[torch.nn.Module, dict[str, Any]], dict[str, Any]] | None = field(default=None, repr=False)


_METHODS: dict[str, MethodInfo] = {}


def register_method(name: str, description: str, options: type | dict[str, Option] | None = None,
                    build: Callable[..., Any] | None = None, undoes_rope: bool = False,
                    settle_named: Callable[[dict[str, Any], frozenset[str]], dict[str, Any]] | None = None,
                    choose: Callable[[torch.nn.Module, dict[str, Any]], dict[str, Any]] | None = None):
    """Class decorator registering a ``CacheLayer`` subclass as method ``name``.

    ``options`` is the method's options dataclass (fields made with :func:`option`); each decoder
    layer is then constructed as ``cls(spec, config)`` with one instance of it, whose
    ``__post_init__`` may check what involves several options. A method without options passes
    nothing (``cls(spec)``); a plain ``{name: Option}`` dict gives ``cls(spec, **options)``. A method
    that is not built from kvshrink layers (e.g. a wrapper of another cache) passes ``build`` instead,
    called as ``build(model, info, **options)``. ``settle_named(options, named)`` returns the options to
    build with, knowing which ones the caller named (the builder sees resolved options only): it refuses
    options that exclude each other, or turns off a default that a named option overrides.
    ``choose(model, options)`` returns the options for ``model`` (e.g. measured by a calibration).
    """
    config = options if isinstance(options, type) else None
    opts = declared_options(config) if config is not None else dict(options or {})

    def decorate(cls):
        if name in _METHODS:
            raise ValueError(f"method '{name}' is registered twice")
        builder = build or _layer_builder(name, cls, config)
        if isinstance(cls, type):
            cls.method_name = name
        _METHODS[name] = MethodInfo(name, description, opts, builder, config, getattr(cls, "__module__", ""),
                                    undoes_rope, settle_named, choose)
        return cls

    return decorate


def _layer_builder(name: str, cls, config: type | None) -> Callable[..., Any]:
    def build(model: torch.nn.Module, info, **options):
        from kvshrink.cache.base import KVShrinkCache
        from kvshrink.cache.integration import install

        if config is not None:
            cfg = config(**options)
            factory = lambda spec: cls(spec, cfg)  # noqa: E731
        else:
            factory = lambda spec: cls(spec, **options)  # noqa: E731
        cache = KVShrinkCache(name, options, info, factory)
        install(model)
        return cache

    return build


def methods() -> dict[str, MethodInfo]:
    """Registered methods by name (``import kvshrink`` registers the built-in ones)."""
    return dict(sorted(_METHODS.items()))


def options_markdown() -> str:
    """Every built-in method's options as Markdown tables (docs/options.md is this text; a test keeps it
    so). Methods registered from outside kvshrink are left out."""
    lines = ["# Options of every method", "",
             "Generated by `kvshrink methods --markdown` from the options the methods declare; pass them as",
             "keywords to `make_cache`, or as `name:option=value,...` on the command line.", ""]
    builtin = {name: info for name, info in methods().items() if info.module.startswith("kvshrink.")}
    for name, info in builtin.items():
        lines += [f"## `{name}`", "", info.description, ""]
        if not info.options:
            lines += ["No options.", ""]
            continue
        lines += ["| option | default | meaning |", "| --- | --- | --- |"]
        for opt, spec in info.options.items():
            meaning = spec.help.replace("|", "\\|")
            if spec.choices is not None:
                meaning += " (one of " + ", ".join(f"`{c}`" for c in spec.choices) + ")"
            elif spec.range_text() is not None:
                meaning += f" ({spec.range_text()})"
            lines.append(f"| `{opt}` | `{spec.default!r}` | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def get_method(name: str) -> MethodInfo:
    if not isinstance(name, str) or name not in _METHODS:
        raise ValueError(f"unknown kvshrink method {name!r}; available: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def resolve_options(method: MethodInfo, options: dict[str, Any]) -> dict[str, Any]:
    """Defaults filled in, values coerced; unknown names raise ValueError listing the valid ones."""
    valid = method.options
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listing = ", ".join(f"{k} (default {v.default!r})" for k, v in valid.items())
        raise ValueError(f"unknown option(s) {unknown} for method '{method.name}'; valid options: {listing}")
    return {k: opt.coerce(k, options.get(k, opt.default)) for k, opt in valid.items()}


def settled_options(method: MethodInfo, options: dict[str, Any]) -> dict[str, Any]:
    """The options a cache is built with: `resolve_options`, then the method's `settle_named` rule."""
    resolved = resolve_options(method, options)
    if method.settle_named is not None:
        resolved = method.settle_named(resolved, frozenset(options))
    return resolved


def parse_method_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"name:key=value,key=value"`` -> ``("name", {"key": "value", ...})`` (values as strings)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty method spec {spec!r}")
    name, _, rest = spec.strip().partition(":")
    options = parse_options(rest, f" in method spec {spec!r}")
    get_method(name.strip())
    return name.strip(), options


def cache_options(method: str, model: torch.nn.Module, **options: Any) -> dict[str, Any]:
    """The options a cache of ``method`` made for ``model`` with ``options`` holds (``cache.options``): settled,
    then chosen for the model where the method chooses (Shard's ``kl_budget``)."""
    info_m = get_method(method)
    return _chosen(info_m, model, settled_options(info_m, options))


def _chosen(method: MethodInfo, model: torch.nn.Module, settled: dict[str, Any]) -> dict[str, Any]:
    return method.choose(model, settled) if method.choose is not None else settled


def make_cache(method: str, model: torch.nn.Module, **options: Any):
    """A cache of method ``method`` for ``model``, to pass to ``model.generate(past_key_values=...)``.

    Raises ValueError for an unknown method or option (listing the valid ones) and
    NotImplementedError for a model kvshrink cannot handle.
    """
    from kvshrink.identity import model_fingerprint
    from kvshrink.models import describe_model, require_exact_rope

    info_m = get_method(method)
    settled = settled_options(info_m, options)  # a bad option fails before the model is looked at
    info = describe_model(model)
    if info_m.undoes_rope:
        require_exact_rope(model, info, method)
    cache = info_m.build(model, info, **_chosen(info_m, model, settled))
    cache.model_fingerprint = model_fingerprint(model)  # cache.save() records which model made it
    return cache


def split_specs(text: str) -> list[str]:
    """Split "full,shard:a=1,b=2,streaming" into specs: a part with '=' but no ':' is an option of
    the spec before it."""
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part.split("=", 1)[0]:
            if not specs:
                raise ValueError(f"option {part!r} comes before any method in {text!r}")
            specs[-1] += ("," if ":" in specs[-1] else ":") + part
        else:
            specs.append(part)
    if not specs:
        raise ValueError("no method given; use e.g. --methods full,streaming")
    return specs
