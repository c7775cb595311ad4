"""The stored form (`cache.record`) of the codecs' code objects that methods hold: `GroupCode` (kivi,
Shard's salient tokens), `TurboCode` (turboquant, Shard's stream) and `PCACode` (Shard's keys).

The codecs stay pure tensor code; their schemas live here, shared by the methods that store them. Each
schema takes ``lead``: the dims (`TensorSpec` syntax) of the code's leading axes where it is used.
"""

from __future__ import annotations

from kvshrink.cache.record import Record, RecordReader, Schema, TensorSpec
from kvshrink.codecs.groupwise import GroupCode
from kvshrink.codecs.lloyd_max import TurboCode
from kvshrink.codecs.pca import PCACode


def group_code_schema(lead: str) -> Schema:
    """A `GroupCode` of ``[lead..., groups * group_size]`` values."""
    return Schema(tensors=(TensorSpec("codes", f"{lead} g *", "uint8"), TensorSpec("scale", f"{lead} g", "float16"),
                           TensorSpec("zero", f"{lead} g", "float16")),
                  meta=("bits", "group_size"))


def group_code_record(code: GroupCode, lead: str) -> Record:
    return group_code_schema(lead).write(code)


def read_group_code(reader: RecordReader, lead: str) -> GroupCode:
    return GroupCode(**group_code_schema(lead).read(reader))


def turbo_code_schema(lead: str) -> Schema:
    """A `TurboCode` of vectors ``[lead..., dim]``."""
    return Schema(tensors=(TensorSpec("norm", lead, "float16"), TensorSpec("codes", f"{lead} *", "uint8"),
                           TensorSpec("qjl_signs", f"{lead} *", "uint8", optional=True),
                           TensorSpec("qjl_norm", lead, "float16", optional=True)))


def turbo_code_record(code: TurboCode | None, lead: str) -> Record | None:
    return None if code is None else turbo_code_schema(lead).write(code)


def read_turbo_code(reader: RecordReader | None, lead: str) -> TurboCode | None:
    if reader is None:
        return None
    code = turbo_code_schema(lead).read(reader)
    reader.check((code["qjl_signs"] is None) == (code["qjl_norm"] is None), "QJL signs and norms are stored together")
    return TurboCode(**code)


def pca_code_schema(lead: str) -> Schema:
    """A `PCACode` of rows ``[lead..., n, w]`` (``n`` is its metadata's)."""
    return Schema(tensors=(TensorSpec("mean", "w", "float16"), TensorSpec("basis_q", "w r", "int8"),
                           TensorSpec("basis_scale", "r", "float16"), TensorSpec("coeff_step", "r", "float16"),
                           TensorSpec("codes", f"{lead} n *", "uint8"),
                           TensorSpec("column_scale", "w", "float16", optional=True)),
                  meta=("runs", "levels", "n", "lead_shape"))


def pca_code_record(code: PCACode, lead: str) -> Record:
    record = pca_code_schema(lead).write(code)
    record.meta["runs"] = [list(run) for run in code.runs]
    record.meta["lead_shape"] = list(code.lead_shape)
    return record


def read_pca_code(reader: RecordReader, lead: str) -> PCACode:
    fields = pca_code_schema(lead).read(reader)
    runs = fields["runs"]
    reader.check(isinstance(runs, list) and all(isinstance(r, list) and len(r) == 5 and
                                                all(isinstance(x, int) for x in r) for r in runs),
                 "runs must be lists of 5 ints (bits, first, last, first byte, last byte)")
    fields["runs"] = [tuple(run) for run in runs]
    fields["lead_shape"] = tuple(fields["lead_shape"])
    reader.check(fields["lead_shape"] == tuple(fields["codes"].shape[:-2]), "lead_shape does not match the codes")
    return PCACode(**fields)
