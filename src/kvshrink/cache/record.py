"""The stored form of a cache's state: per object, named tensors and JSON metadata, declared by a schema.

A class whose state a cache file holds writes a `Record` (``to_record``) and reads one back into a freshly
made object (``load_record``, through a `RecordReader`). Nothing in a record names a class: the cache's
method, rebuilt from its name and options, decides which class reads which record, and each class says
which tensors and metadata it stores in a `Schema`:

* a `TensorSpec` per tensor: its name, its dims and, where fixed, its dtype. Dims are an int, ``*``
  (any size), an upper-case name bound by the reader's context (``H`` KV heads, ``D`` head size, set by
  the cache), or a lower-case name bound within the record (by a metadata int of that name, else by the
  first tensor that has it: every other use must agree);
* the metadata keys (JSON values) and the parts (nested records, lists of records, or None).

Reading refuses clearly (`RecordError`, naming the tensor's flat name such as
``layers.3.middle.0.v_codes``): a required tensor or metadata key that is missing, a tensor of another
dtype or shape than its schema says, and anything stored that no schema read (an extra tensor, key or
part). Adding a stored field to a class is one line in its schema (plus the attribute itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class RecordError(ValueError):
    """A stored record that does not match the schema of the class reading it."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: str                  # space-separated: int, "*", context name (upper case) or record name (lower case)
    dtype: str | None = None   # e.g. "uint8"; None: any dtype (the reading class checks it where it matters)
    optional: bool = False     # absent from the record when the attribute is None


@dataclass(frozen=True)
class Schema:
    """What one kind of object stores: tensors, metadata keys and parts (nested records, by name)."""

    tensors: tuple[TensorSpec, ...] = ()
    meta: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()

    def write(self, obj: Any, **parts: Any) -> "Record":
        """The record of ``obj``'s declared attributes (tensors and metadata); ``parts`` as given."""
        return Record(meta={key: getattr(obj, key) for key in self.meta},
                      tensors={spec.name: getattr(obj, spec.name) for spec in self.tensors}, parts=parts)

    def read(self, reader: "RecordReader") -> dict[str, Any]:
        """The declared tensors and metadata of ``reader``'s record, checked, by name (parts are read by the
        caller)."""
        return {**reader.tensors(*self.tensors), **{key: reader.meta(key) for key in self.meta}}


@dataclass
class Record:
    """One object's stored state: JSON ``meta``, ``tensors`` (None: not stored) and nested ``parts`` (a record,
    a list of records, or None)."""

    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor | None] = field(default_factory=dict)
    parts: dict[str, "Record | list[Record] | None"] = field(default_factory=dict)


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def dtype_of(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise RecordError(f"unknown dtype {name!r}")
    return dtype


# ----------------------------------------------------------------------------------------------- flatten
def flatten(record: Record, path: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The JSON tree of ``record`` (metadata and parts); its tensors go into ``tensors`` under flat names
    ``path.name`` (a part's path is ``path.part``, a list's items ``path.part.i``)."""
    present = []
    for name, tensor in record.tensors.items():
        if tensor is not None:
            _check_name(name)
            tensors[join(path, name)] = tensor
            present.append(name)
    node: dict[str, Any] = {"meta": record.meta, "tensors": sorted(present), "parts": {}}
    for name, part in record.parts.items():
        _check_name(name)
        if isinstance(part, list):
            node["parts"][name] = [flatten(item, join(path, f"{name}.{i}"), tensors) for i, item in enumerate(part)]
        else:
            node["parts"][name] = None if part is None else flatten(part, join(path, name), tensors)
    return node


def join(path: str, name: str) -> str:
    """The flat name of ``name`` within the record at ``path`` (the cache's own record has path "")."""
    return f"{path}.{name}" if path else name


def _check_name(name: str) -> None:
    if not name or "." in name:
        raise ValueError(f"kvshrink: a record's tensor or part name must be a non-empty name without '.', got {name!r}")


# ----------------------------------------------------------------------------------------------- read
class RecordReader:
    """A stored record as its class reads it: checked tensors, metadata and parts, each marked as read."""

    def __init__(self, node: Any, path: str, tensors: dict[str, torch.Tensor], context: dict[str, int],
                 read: set[str]):
        if not (isinstance(node, dict) and isinstance(node.get("meta"), dict) and isinstance(node.get("parts"), dict)
                and isinstance(node.get("tensors"), list)):
            raise RecordError(f"{path or 'the cache'}: not a record (metadata, tensor names and parts expected)")
        self.where = path or "the cache"   # for messages
        self.path, self._node, self._all, self._read = path, node, tensors, read
        self.context = dict(context)
        self._bound: dict[str, int] = {}
        self._meta_read: set[str] = set()
        self._tensors_read: set[str] = set()
        self._parts_read: set[str] = set()
        self._children: list[RecordReader] = []

    # ---- metadata ---------------------------------------------------------------------------------
    def meta(self, key: str) -> Any:
        if key not in self._node["meta"]:
            raise RecordError(f"{self.where}: metadata {key!r} is missing")
        self._meta_read.add(key)
        return self._node["meta"][key]

    def bind(self, **dims: int) -> None:
        """Context dims (upper-case names) this record's tensors and its parts' are checked against."""
        self.context.update(dims)

    # ---- tensors ----------------------------------------------------------------------------------
    def tensors(self, *specs: TensorSpec) -> dict[str, torch.Tensor | None]:
        """The tensors ``specs`` declare, by name (None for an absent optional one), each checked."""
        return {spec.name: self.tensor(spec) for spec in specs}

    def tensor(self, spec: TensorSpec) -> torch.Tensor | None:
        name = join(self.path, spec.name)
        self._tensors_read.add(spec.name)
        if spec.name not in self._node["tensors"] and spec.optional:
            return None      # not stored: the attribute is None
        if name not in self._all:
            raise RecordError(f"tensor {name} is missing")
        self._read.add(name)
        t = self._all[name]
        if spec.dtype is not None and t.dtype != dtype_of(spec.dtype):
            raise RecordError(f"tensor {name} is {dtype_name(t.dtype)}, its schema says {spec.dtype}")
        self._check_dims(name, t, spec.dims)
        return t

    def _check_dims(self, name: str, t: torch.Tensor, dims: str) -> None:
        want = dims.split()
        if t.dim() != len(want):
            raise RecordError(f"tensor {name} has shape {list(t.shape)}, its schema says [{dims}]")
        for size, dim in zip(t.shape, want):
            expected = self._dim(dim, size)
            if expected is not None and size != expected:
                raise RecordError(f"tensor {name} has shape {list(t.shape)}, its schema says [{dims}] with "
                                  f"{dim}={expected}")

    def _dim(self, dim: str, size: int) -> int | None:
        """The size ``dim`` must have (None: any), binding a record name on its first use."""
        if dim == "*":
            return None
        if dim.isdigit():
            return int(dim)
        if dim[0].isupper():
            if dim not in self.context:
                raise ValueError(f"kvshrink: schema dim {dim!r} is not bound by the reader's context")
            return self.context[dim]
        if dim not in self._bound:
            meta = self._node["meta"].get(dim)
            self._bound[dim] = meta if isinstance(meta, int) and not isinstance(meta, bool) else size
        return self._bound[dim]

    def check(self, ok: bool, what: str) -> None:
        """RecordError ``path: what`` unless ``ok`` (a check a schema cannot state: a dtype fixed by options)."""
        if not ok:
            raise RecordError(f"{self.where}: {what}")

    # ---- parts ------------------------------------------------------------------------------------
    def part(self, name: str, optional: bool = False) -> "RecordReader | None":
        node = self._part(name)
        if node is None:
            if optional:
                return None
            raise RecordError(f"{join(self.path, name)} is missing")
        if isinstance(node, list):
            raise RecordError(f"{join(self.path, name)} is a list; its schema says one record")
        return self._child(node, join(self.path, name))

    def parts(self, name: str) -> list["RecordReader"]:
        node = self._part(name)
        if not isinstance(node, list):
            raise RecordError(f"{join(self.path, name)} is {'missing' if node is None else 'one record'}; its "
                              "schema says a list")
        return [self._child(item, join(self.path, f"{name}.{i}")) for i, item in enumerate(node)]

    def list_length(self, name: str) -> int:
        """How many records the list part ``name`` holds (0 when there is none); not marked as read."""
        node = self._node["parts"].get(name)
        return len(node) if isinstance(node, list) else 0

    def _part(self, name: str) -> Any:
        self._parts_read.add(name)
        return self._node["parts"].get(name)

    def _child(self, node: Any, path: str) -> "RecordReader":
        child = RecordReader(node, path, self._all, self.context, self._read)
        self._children.append(child)
        return child

    # ---- nothing left unread ----------------------------------------------------------------------
    def check_all_read(self) -> None:
        """RecordError naming metadata or parts stored here (or in the parts read) that nothing read."""
        extra = sorted(set(self._node["tensors"]) - self._tensors_read)
        if extra:
            raise RecordError(f"{self.where}: tensors {extra} are not part of this kvshrink's schema")
        extra = sorted(set(self._node["meta"]) - self._meta_read)
        if extra:
            raise RecordError(f"{self.where}: metadata {extra} is not part of this kvshrink's schema")
        extra = sorted(k for k, v in self._node["parts"].items() if k not in self._parts_read and v is not None)
        if extra:
            raise RecordError(f"{self.where}: parts {extra} are not part of this kvshrink's schema")
        for child in self._children:
            child.check_all_read()


def unread_tensors(tensors: dict[str, torch.Tensor], read: set[str]) -> list[str]:
    return sorted(set(tensors) - read)
