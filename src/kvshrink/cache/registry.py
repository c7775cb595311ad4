"""The method registry: names, options, validation, and ``make_cache``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

_BOOL_WORDS = {"true": True, "on": True, "yes": True, "1": True,
               "false": False, "off": False, "no": False, "0": False}


@dataclass(frozen=True)
class Option:
    """One option of a method. ``type`` defaults to the type of ``default``."""

    default: Any
    help: str
    type: type | None = None
    choices: tuple | None = None

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
        if self.choices is not None and out not in self.choices:
            raise ValueError(f"option '{name}' must be one of {list(self.choices)}, got {out!r}")
        return out


@dataclass(frozen=True)
class MethodInfo:
    name: str
    description: str
    options: dict[str, Option]
    build: Callable[..., Any] = field(repr=False)  # build(model, info, **options) -> cache
    undoes_rope: bool = False  # the method re-rotates keys: make_cache refuses RoPE types it cannot undo exactly


_METHODS: dict[str, MethodInfo] = {}

# Options every kvshrink cache accepts (not passed to the layers).
COMMON_OPTIONS = {
    # kept so old callers do not break: a cache now takes any input that begins with the tokens it holds
    # (prefix reuse, a conversation's next turn) and refuses any other, so the flag changes nothing
    "multi_turn": Option(False, "no-op, kept for compatibility: any input that continues the held tokens is taken"),
}


def register_method(name: str, description: str, options: dict[str, Option] | None = None,
                    build: Callable[..., Any] | None = None, undoes_rope: bool = False):
    """Class decorator registering a ``CacheLayer`` subclass as method ``name``.

    The layer class is constructed as ``cls(spec, **options)`` for each decoder layer. A method that
    is not built from kvshrink layers (e.g. a wrapper of another cache) passes ``build`` instead.
    """
    opts = dict(options or {})

    def decorate(cls):
        if name in _METHODS:
            raise ValueError(f"method '{name}' is registered twice")
        builder = build or _layer_builder(name, cls)
        if isinstance(cls, type):
            cls.method_name = name
        _METHODS[name] = MethodInfo(name, description, opts, builder, undoes_rope)
        return cls

    return decorate


def _layer_builder(name: str, cls) -> Callable[..., Any]:
    def build(model: torch.nn.Module, info, multi_turn: bool = False, **options):
        from kvshrink.cache.base import KVShrinkCache
        from kvshrink.cache.integration import install

        cache = KVShrinkCache(name, options, info, lambda spec: cls(spec, **options), multi_turn=multi_turn)
        install(model)
        return cache

    return build


def _load_methods() -> None:
    import kvshrink.methods  # noqa: F401  (registers the built-in methods)


def methods() -> dict[str, MethodInfo]:
    """Registered methods by name."""
    _load_methods()
    return dict(sorted(_METHODS.items()))


def get_method(name: str) -> MethodInfo:
    _load_methods()
    if not isinstance(name, str) or name not in _METHODS:
        raise ValueError(f"unknown kvshrink method {name!r}; available: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def resolve_options(method: MethodInfo, options: dict[str, Any]) -> dict[str, Any]:
    """Defaults filled in, values coerced; unknown names raise ValueError listing the valid ones."""
    valid = {**method.options, **COMMON_OPTIONS}
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listing = ", ".join(f"{k} (default {v.default!r})" for k, v in valid.items())
        raise ValueError(f"unknown option(s) {unknown} for method '{method.name}'; valid options: {listing}")
    return {k: opt.coerce(k, options.get(k, opt.default)) for k, opt in valid.items()}


def parse_method_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"name:key=value,key=value"`` -> ``("name", {"key": "value", ...})`` (values as strings)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty method spec {spec!r}")
    name, _, rest = spec.strip().partition(":")
    options: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad option {item!r} in method spec {spec!r}: expected key=value")
        options[key.strip()] = value.strip()
    get_method(name.strip())
    return name.strip(), options


def make_cache(method: str, model: torch.nn.Module, **options: Any):
    """A cache of method ``method`` for ``model``, to pass to ``model.generate(past_key_values=...)``.

    Raises ValueError for an unknown method or option (listing the valid ones) and
    NotImplementedError for a model kvshrink cannot handle.
    """
    from kvshrink.cache.persist import model_fingerprint
    from kvshrink.models import describe_model, require_exact_rope

    info_m = get_method(method)
    resolved = resolve_options(info_m, options)
    info = describe_model(model)
    if info_m.undoes_rope:
        require_exact_rope(model, info, method)
    cache = info_m.build(model, info, **resolved)
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
