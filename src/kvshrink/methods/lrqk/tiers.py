"""The two memory tiers of LRQK: a slow tier with every token's full K/V, a fast tier of slots.

Slow tier (``SlowTier``): rows laid out ``[token, B*H_kv, 2 (K,V), d]`` so appending a token is a
contiguous write and fetching a set of (head, token) rows is one ``index_select`` on a flat view.
It lives in host memory (pinned when CUDA is present, so copies to the GPU can be asynchronous) or
in a memory-mapped file under a folder (``DiskSlowTier``), which is deleted on ``close()``, when
the tier is garbage collected, and at interpreter exit.

Fast tier (``SlotTier``): ``S`` slots per KV head holding full K/V rows of selected tokens. Each
decode step hands it the selected tokens per head; tokens already resident are hits, the others are
misses and only those rows are copied from the slow tier, into the slots chosen by the policy:

- ``set`` (the paper): ``S = top_k``; a missing token takes the slot of a token that left the set.
- ``lru``: ``S = top_k + extra``; the victims are the least recently selected resident tokens.
- ``attention``: ``S = top_k + extra``; the victims have the smallest accumulated (estimated)
  attention mass since they were loaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from kvshrink.cache.record import Record, RecordReader, Schema, TensorSpec
from kvshrink.cache.store import check_fp16_peak, held_bytes, to_storage
from kvshrink.kernels.deferred import FP16_MAX
from kvshrink.kernels.backend import triton_available
from kvshrink.kernels.cpu import numba_support

POLICIES = ("set", "lru", "attention")
SLOW_TIERS = ("cpu", "disk")

# numpy has no bfloat16: its 2-byte words are mapped as int16 and viewed as bfloat16 by torch
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
                 torch.bfloat16: np.int16}


class SlowTierChanged(RuntimeError):
    """The file behind a disk slow tier was replaced, resized or overwritten by someone else."""


def state_tensors():
    """Context for allocating buffers the cache keeps updating in place: they are made as normal
    tensors even under ``torch.inference_mode``, so a prompt run in inference mode can be continued
    outside it (inference tensors refuse in-place updates there)."""
    return torch.inference_mode(False)


def _grow(capacity: int, needed: int) -> int:
    """Next capacity: at least ``needed``, growing by a quarter (bounded over-allocation)."""
    return max(needed, capacity + max(256, capacity // 4))


class SlowTier:
    """Every token's full K and V in host memory, ``[token, rows, 2, d]`` (rows = B*H_kv)."""

    kind = "cpu"

    def __init__(self, rows: int, head_dim: int, dtype: torch.dtype):
        self.rows = rows
        self.head_dim = head_dim
        self.dtype = dtype
        self.length = 0
        self._data: torch.Tensor | None = None
        # Prefetch gathers on a background thread while the model appends: growth must not interleave.
        self._lock = threading.Lock()
        self._inflight = None    # CUDA event after an asynchronous append (GPU path), until the stream syncs
        self._staging: torch.Tensor | None = None   # pinned rows for the GPU path's fills (gather_to)
        self._views = numba_support.NumpyViews()    # copy_rows_to's numpy words of the data

    # ---- storage ---------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> torch.Tensor:
        pin = torch.cuda.is_available()
        return torch.empty((capacity, self.rows, 2, self.head_dim), dtype=self.dtype, pin_memory=pin)

    def _settle(self) -> None:
        """Wait for asynchronous appends still being copied (none once the stream has synchronised)."""
        if self._inflight is not None:
            self._inflight.synchronize()
            self._inflight = None

    def stream_synced(self) -> None:
        """The caller synchronised the device's stream: every asynchronous append has landed."""
        self._inflight = None

    def _reserve(self, needed: int) -> None:
        capacity = 0 if self._data is None else self._data.shape[0]
        if needed <= capacity:
            return
        self._settle()
        with state_tensors():
            data = self._allocate(_grow(capacity, needed))
            if self.length:
                data[: self.length].copy_(self._data[: self.length])
        self._data = data

    @property
    def data(self) -> torch.Tensor:
        return self._data

    # ---- API -------------------------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor, non_blocking: bool = False) -> None:
        """Store tokens ``key/value [B, H_kv, q, d]`` after the ones already held.

        ``non_blocking`` (the GPU path): a CUDA tensor is copied into the pinned rows asynchronously (no
        host synchronisation); reads wait for it (``_settle``), which costs nothing once the stream has
        synchronised, as each GPU decode step's miss transfer does."""
        b, h, q, d = key.shape
        self.append_rows(torch.stack([key, value], dim=2).reshape(b * h, 2, q, d).permute(2, 0, 1, 3), non_blocking)

    def append_rows(self, rows: torch.Tensor, non_blocking: bool = False) -> None:
        """``append`` of tokens already laid out as held, ``rows [q, B*H_kv, 2, d]`` (the GPU path's commit kernel
        writes its token so: one copy to the host, no stack)."""
        q = rows.shape[0]
        with self._lock:
            self._reserve(self.length + q)
            target = self.data[self.length: self.length + q]
            if non_blocking and rows.is_cuda and self.kind == "cpu" and target.is_pinned():
                target.copy_(rows.to(self.dtype), non_blocking=True)
                self._inflight = torch.cuda.Event()
                self._inflight.record()
            else:
                target.copy_(rows.to(self.dtype))
            self._after_write(self.length, self.length + q)
            self.length += q

    def read_range(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens ``start..stop-1`` as ``[rows, n, d]`` host tensors."""
        with self._lock:
            self._settle()
            self._check(start, stop)
            block = self.data[start:stop].permute(1, 2, 0, 3)          # [rows, 2, n, d]
        return block[:, 0], block[:, 1]

    def gather(self, row: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Rows ``(row[i], token[i])`` as ``[n, 2, d]`` (K and V), a fresh host tensor."""
        with self._lock:
            self._settle()
            flat = self.data.view(-1, 2, self.head_dim)
            picked = flat.index_select(0, (token.long() * self.rows + row.long()).cpu())
            self._check_rows(row, token, picked)
        return picked

    def _data_words(self) -> np.ndarray:
        """The held rows as numpy unsigned words (no copy), kept while ``data`` is the same tensor (three calls
        per layer and step less)."""
        return self._views.get("data", self._data, lambda t: _uint_view(t, _SAME_SIZE_UINT[t.element_size()]))

    def copy_rows_to(self, row: torch.Tensor, token: torch.Tensor, flat: torch.Tensor, keys: np.ndarray,
                     values: np.ndarray, slot_dtype: torch.dtype) -> bool:
        """``keys[flat[i]]`` and ``values[flat[i]]`` (``[n, d]`` numpy unsigned words of the slots, of ``slot_dtype``) take the K and V of rows
        ``(row[i], token[i])`` in one compiled pass, converted to their dtype: the same rows and values as
        ``gather`` then ``to_storage`` and an ``index_copy_``, including its float16 overflow error. Runs
        where it can (numba, host rows of 2- or 4-byte words, the destination of the same dtype or float16
        from float32, no per-row checks of a subclass); returns False, having copied nothing, elsewhere."""
        narrow = self.dtype == torch.float32 and slot_dtype == torch.float16
        if not (numba_support.available() and (narrow or slot_dtype == self.dtype) and self.data.device.type == "cpu"
                and self.data.element_size() in _SAME_SIZE_UINT and type(self)._check_rows is SlowTier._check_rows):
            return False
        with self._lock:
            self._settle()
            largest, _ = _copy_rows(self._data_words(), row.numpy(), token.numpy(), flat.numpy(), keys, values,
                                    narrow)
        if narrow:
            check_narrowed(largest)
        return True

    def held_words(self, room: int = 0) -> np.ndarray | None:
        """The held rows and ``room`` more, ``[length + room, rows, 2, d]``, as numpy unsigned words (no copy) for a
        compiled reader (and writer of the extra rows, which ``rows_written`` then counts) on the calling thread;
        None where it cannot take them (rows on a device, a subclass that checks the rows it hands out or writes,
        such as the disk tier)."""
        if not (self.length and self.data.device.type == "cpu" and self.data.element_size() in _SAME_SIZE_UINT
                and type(self)._check_rows is SlowTier._check_rows and type(self)._after_write is SlowTier._after_write):
            return None
        with self._lock:
            self._settle()
            self._reserve(self.length + room)
            return self._data_words()[: self.length + room]

    def rows_written(self, n: int) -> None:
        """A compiled writer filled the ``n`` rows after the held ones (``held_words``' room): they are held now."""
        self.length += n

    def gather_to(self, flat: torch.Tensor, device: torch.device,
                  given: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Rows at flat positions ``flat`` (``token * rows + row``, a host tensor) as ``[n, 2, d]`` on
        ``device``: picked into a pinned staging buffer, then copied asynchronously (the GPU path).
        ``given``: ``(positions, rows)`` already at hand (prefetched): placed there, not read.

        The buffer is reused by the next call: on the GPU path that call comes after the next step's
        miss transfer, which synchronises the stream, so this copy has landed by then."""
        n = flat.numel()
        with self._lock:
            self._settle()
            if self._staging is None or self._staging.shape[0] < n:
                with state_tensors():
                    self._staging = torch.empty((max(n, 64), 2, self.head_dim), dtype=self.dtype,
                                                pin_memory=torch.cuda.is_available())
            out = self._staging[:n]
            if given is None:
                torch.index_select(self.data.view(-1, 2, self.head_dim), 0, flat, out=out)
                if type(self)._check_rows is not SlowTier._check_rows:
                    self._check_rows(flat % self.rows, flat // self.rows, out)
            else:
                keep = torch.ones(n, dtype=torch.bool)
                keep[given[0]] = False
                read = torch.from_numpy(np.flatnonzero(keep.numpy()))
                out.index_copy_(0, given[0], given[1].to(self.dtype))
                if read.numel():
                    picked = self.data.view(-1, 2, self.head_dim).index_select(0, flat[read])
                    if type(self)._check_rows is not SlowTier._check_rows:
                        self._check_rows(flat[read] % self.rows, flat[read] // self.rows, picked)
                    out.index_copy_(0, read, picked)
        return out.to(device, non_blocking=True)

    def nbytes(self) -> int:
        return held_bytes([self._data])

    def close(self) -> None:
        self._data = None
        self.length = 0

    # ---- copy / save (copy.deepcopy, cache/persist.py) ---------------------------------------------------
    def __getstate__(self) -> dict:
        """The tokens held (``[length, rows, 2, d]``, a copy), without the lock or unused capacity."""
        with self._lock:
            if self._data is not None:
                self._check(0, self.length)
            self._settle()
            state = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_inflight", "_staging", "_views")}
            state["_data"] = None if self._data is None else self._data[: self.length].clone()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._inflight = None
        self._staging = None
        self._views = numba_support.NumpyViews()

    # ---- save / load (cache/record.py): the tokens held, [length, rows, 2, d] -------------------------------
    def to_record(self) -> Record:
        with self._lock:
            self._settle()
            if self._data is not None:
                self._check(0, self.length)
            data = None if self._data is None else self._data[: self.length]
        return Record(meta={"rows": self.rows, "length": self.length}, tensors={"data": data})

    def load_record(self, reader: RecordReader) -> None:
        """Restore the stored tokens into this empty tier."""
        reader.check(reader.meta("rows") == self.rows, f"holds {reader.meta('rows')} rows, this tier {self.rows}")
        length = reader.meta("length")
        data = reader.tensor(TensorSpec("data", f"{length} {self.rows} 2 {self.head_dim}", optional=length == 0))
        reader.check(data is None or data.dtype == self.dtype, f"its tokens must be {self.dtype}")
        if length:
            self._reserve(length)
            self.data[:length].copy_(data)
            self._after_write(0, length)
            self.length = length

    # ---- hooks for the disk tier -----------------------------------------------------------------
    def _after_write(self, start: int, stop: int) -> None:
        pass

    def _check(self, start: int, stop: int) -> None:
        pass

    def _check_rows(self, row: torch.Tensor, token: torch.Tensor, picked: torch.Tensor) -> None:
        pass


def _remove_folder(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class DiskSlowTier(SlowTier):
    """The slow tier in a memory-mapped file under ``folder``.

    A private temporary folder is created under ``folder`` and removed on ``close()``, on garbage
    collection and at exit. Changes made by anyone else are detected: the file's inode and size are
    checked on every read, and each row's checksum (its float64 sum, kept in host memory) is
    compared on every gather and block read.
    """

    kind = "disk"

    def __init__(self, rows: int, head_dim: int, dtype: torch.dtype, folder: str | os.PathLike):
        super().__init__(rows, head_dim, dtype)
        if dtype not in _NUMPY_DTYPES:
            raise ValueError(f"LRQK disk tier cannot store {dtype}; allowed: {sorted(map(str, _NUMPY_DTYPES))}")
        folder = os.fspath(folder)
        try:
            os.makedirs(folder, exist_ok=True)
            self.folder = tempfile.mkdtemp(prefix="kvshrink-lrqk-", dir=folder)
        except OSError as err:
            raise ValueError(f"LRQK slow_tier='disk': cannot create a folder under {folder!r}: {err}") from err
        self.path = os.path.join(self.folder, "kv.bin")
        self._finalizer = weakref.finalize(self, _remove_folder, self.folder)
        self._memmap: np.memmap | None = None
        self._identity: tuple[int, int] | None = None
        self._checksums = torch.zeros(0, rows, dtype=torch.float64)

    def _allocate(self, capacity: int) -> torch.Tensor:
        row_bytes = self.rows * 2 * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()
        if self._memmap is not None:
            self._memmap.flush()
        with open(self.path, "ab") as fh:
            fh.truncate(capacity * row_bytes)
        self._memmap = np.memmap(self.path, dtype=_NUMPY_DTYPES[self.dtype], mode="r+",
                                 shape=(capacity, self.rows, 2, self.head_dim))
        st = os.stat(self.path)
        self._identity = (st.st_ino, st.st_size)
        checks = torch.zeros(capacity, self.rows, dtype=torch.float64)
        checks[: self.length] = self._checksums[: self.length]
        self._checksums = checks
        return torch.from_numpy(self._memmap).view(self.dtype)

    def _reserve(self, needed: int) -> None:
        capacity = 0 if self._data is None else self._data.shape[0]
        if needed <= capacity:
            return
        if self._data is not None:
            self._check(0, 0)
        # The file grows in place (truncate keeps the bytes), then it is mapped again.
        self._data = None
        with state_tensors():
            self._data = self._allocate(_grow(capacity, needed))

    def _after_write(self, start: int, stop: int) -> None:
        self._checksums[start:stop] = self.data[start:stop].double().sum((-1, -2))

    def _check(self, start: int, stop: int) -> None:
        try:
            st = os.stat(self.path)
        except OSError as err:
            raise SlowTierChanged(f"LRQK disk tier file {self.path} disappeared: {err}") from err
        if (st.st_ino, st.st_size) != self._identity:
            raise SlowTierChanged(f"LRQK disk tier file {self.path} was replaced or resized under the cache")
        if stop > start:
            sums = self.data[start:stop].double().sum((-1, -2))
            if not torch.equal(sums, self._checksums[start:stop]):
                raise SlowTierChanged(f"LRQK disk tier file {self.path} was modified under the cache")

    def _check_rows(self, row: torch.Tensor, token: torch.Tensor, picked: torch.Tensor) -> None:
        self._check(0, 0)
        expected = self._checksums[token.long().cpu(), row.long().cpu()]
        if not torch.equal(picked.double().sum((-1, -2)), expected):
            raise SlowTierChanged(f"LRQK disk tier file {self.path} was modified under the cache")

    def nbytes(self) -> int:
        """Bytes on disk plus the host-side checksums."""
        disk = 0 if self._data is None else self._data.numel() * self._data.element_size()
        return disk + held_bytes([self._checksums])

    def close(self) -> None:
        self._data = None
        self._memmap = None
        self.length = 0
        self._finalizer()

    def __getstate__(self) -> dict:
        """The tokens (checked against the file's checksums) and where to make a new file: a copy never
        shares, and so never changes, this tier's file."""
        state = super().__getstate__()
        state = {k: state[k] for k in ("rows", "head_dim", "dtype", "length", "_data")}
        state["parent_folder"] = os.path.dirname(self.folder)
        return state

    def __setstate__(self, state: dict) -> None:
        DiskSlowTier.__init__(self, state["rows"], state["head_dim"], state["dtype"], state["parent_folder"])
        data = state["_data"]
        if data is not None and state["length"]:
            self._reserve(state["length"])
            self.data[: state["length"]].copy_(data)
            self._after_write(0, state["length"])
            self.length = state["length"]


def make_slow_tier(kind: str, rows: int, head_dim: int, dtype: torch.dtype,
                   folder: str | os.PathLike | None) -> SlowTier:
    if kind == "cpu":
        return SlowTier(rows, head_dim, dtype)
    if kind == "disk":
        if folder is None:
            raise ValueError("LRQK slow_tier='disk' needs a folder: pass disk_folder=<path>")
        return DiskSlowTier(rows, head_dim, dtype, folder)
    raise ValueError(f"LRQK slow_tier must be one of {SLOW_TIERS}, got {kind!r}")


@dataclass
class FillReport:
    """What one ``SlotTier.select`` did: per-row counts (rows = B*H_kv)."""

    selected: int   # selected tokens over all rows
    missed: int     # of those, not resident before: slots replaced
    bytes_moved: int  # bytes copied from the slow tier on the critical path
    prefetch_hits: int = 0  # missed tokens found in the background-prefetched rows


class SlotTier:
    """``capacity`` slots per row (row = one KV head of one batch row) of full K/V in fast memory."""

    plan_kernel = True   # `select_device` plans in Triton where it can (off: its tensor ops, the tests' oracle)

    def __init__(self, rows: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, policy: str):
        if policy not in POLICIES:
            raise ValueError(f"LRQK policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.rows = rows
        self.capacity = capacity
        with state_tensors():
            self.keys = torch.zeros(rows, capacity, head_dim, dtype=dtype, device=device)
            self.values = torch.zeros_like(self.keys)
            self.token = torch.full((rows, capacity), -1, dtype=torch.long, device=device)
            # Policy state: step of last selection (lru) or accumulated estimated mass (attention).
            self.score = torch.zeros(rows, capacity, dtype=torch.float32, device=device)
        # Slots holding the latest selection (what attention reads this step).
        self.chosen = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        self.step = 0

    def select(self, selected: torch.Tensor, slow: SlowTier, mass: torch.Tensor | None = None,
               prefetched: tuple[torch.Tensor, torch.Tensor] | None = None, fast: bool = False) -> FillReport:
        """Make the tokens ``selected [rows, k]`` resident, copying only the missing rows.

        ``mass`` ``[rows, k]``: estimated attention mass of the selected tokens (``attention`` policy).
        ``prefetched``: ``(tokens [rows, e], kv [rows*e, 2, d])`` loaded in the background last step;
        a missing token found there is installed from it instead of a blocking slow-tier read.
        ``fast``: plan the fill in one numba call where it can run (CPU, no prefetch); the same slots.
        """
        self.step += 1
        rows, k = selected.shape
        if k > self.capacity:
            raise ValueError(f"LRQK: {k} selected tokens do not fit {self.capacity} slots")
        selected = selected.to(self.token.device)
        if fast and prefetched is None and numba_support.available() and self.token.device.type == "cpu":
            return self._select_planned(selected, slow, mass)
        # Membership through dense per-row maps over the token ids (every id < slow.length): a
        # scatter and a gather instead of sorting, which dominated this step's cost.
        span = slow.length
        column = _map_index(self.token, span)
        in_selection = _dense_mask(selected, span)
        missing = ~_dense_mask(self.token, span).gather(1, selected)   # [rows, k] selected, not resident
        stays = in_selection.gather(1, column)                          # [rows, S] resident and selected
        # Eviction order: empty slots first, then by policy value; selected residents never move.
        priority = self.score.masked_fill(column == span, float("-inf")).masked_fill(stays, float("inf"))
        slot_order = torch.argsort(priority, dim=1, stable=True)
        # The one host synchronisation: which (row, token) pairs miss, row-major. The i-th missing token
        # of a row takes that row's i-th slot in eviction order.
        where = missing.reshape(-1).nonzero().squeeze(1)
        row_idx = where // k
        tokens = selected.reshape(-1)[where]
        rank = missing.cumsum(1).reshape(-1)[where] - 1
        flat = row_idx * self.capacity + slot_order.reshape(-1)[row_idx * self.capacity + rank]
        moved = 0
        prefetch_hits = 0
        if tokens.numel():
            if prefetched is None:
                fill = slow.gather(row_idx, tokens)
                moved = fill.numel() * fill.element_size()
            else:
                fill, moved, prefetch_hits = self._fill_with_prefetch(selected, missing, row_idx, tokens, slow,
                                                                      prefetched, span)
            fill = to_storage(fill.to(self.keys.device, non_blocking=True), self.keys.dtype)
            self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, flat, fill[:, 0])
            self.values.view(-1, self.values.shape[-1]).index_copy_(0, flat, fill[:, 1])
            self.token.view(-1).index_copy_(0, flat, tokens)
            self.score.view(-1).index_fill_(0, flat, 0.0)
        self.chosen = in_selection.gather(1, _map_index(self.token, span))
        self._update_policy_state(selected, mass, span)
        return FillReport(selected=rows * k, missed=int(tokens.numel()), bytes_moved=moved,
                          prefetch_hits=prefetch_hits)

    def _select_planned(self, selected: torch.Tensor, slow: SlowTier, mass: torch.Tensor | None) -> FillReport:
        """``select`` with its bookkeeping (membership, eviction order, slot assignment, the new
        ``token``/``score``/``chosen``) in one compiled call; only the rows' copies stay in torch."""
        selected = selected.long().contiguous()
        rows, k = selected.shape
        chosen = torch.empty_like(self.chosen)
        row_idx, tokens, flat = (torch.from_numpy(a) for a in _plan_fill(
            self.token.numpy(), self.score.numpy(), selected.numpy(), chosen.numpy(), slow.length))
        self.chosen = chosen
        moved = 0
        if tokens.numel():
            moved = 2 * tokens.numel() * slow.head_dim * slow.data.element_size()
            if not self._copy_rows_in_place(slow, row_idx, tokens, flat):
                self._write_rows(flat, to_storage(slow.gather(row_idx, tokens), self.keys.dtype))
        self._update_policy_state(selected, mass, slow.length)
        return FillReport(selected=rows * k, missed=int(tokens.numel()), bytes_moved=moved)

    def _copy_rows_in_place(self, slow: SlowTier, row_idx: torch.Tensor, tokens: torch.Tensor,
                            flat: torch.Tensor) -> bool:
        """Slot ``flat[i]`` takes the K and V of token ``tokens[i]``, row ``row_idx[i]``, read from the slow tier
        and written in the slots' dtype in one compiled pass (no gathered copy, no separate conversion and
        scatter), where it can run: host rows of the slots' dtype, or float32 rows into float16 slots (the
        overflow check made on the words copied). Returns False (nothing copied) elsewhere."""
        if not (self.keys.is_contiguous() and self.values.is_contiguous() and self.keys.device.type == "cpu"
                and self.keys.element_size() in _SAME_SIZE_UINT):
            return False
        return slow.copy_rows_to(row_idx, tokens, flat, *self._slot_words(), self.keys.dtype)

    def _slot_words(self) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values ``[rows·capacity, d]`` as numpy unsigned words (no copy), kept while they are the same
        tensors (not saved: a copy or a loaded cache makes its own)."""
        views = self.__dict__.setdefault("_views", numba_support.NumpyViews())
        return tuple(views.get(name, t, _slot_rows_words) for name, t in (("keys", self.keys), ("values", self.values)))

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_views"}

    # ---- save / load (cache/record.py) ---------------------------------------------------------------------
    RECORD = Schema(tensors=(TensorSpec("keys", "r c D"), TensorSpec("values", "r c D"), TensorSpec("token", "r c", "int64"),
                             TensorSpec("score", "r c", "float32"), TensorSpec("chosen", "r c", "bool")),
                    meta=("step",))

    def to_record(self) -> Record:
        return self.RECORD.write(self)

    def load_record(self, reader: RecordReader) -> None:
        """Restore stored slots into these (made with the same rows, capacity and dtype)."""
        reader.bind(R=self.rows, C=self.capacity)
        fields = self.RECORD.read(reader)
        for name in ("keys", "values", "token", "score", "chosen"):
            held, stored = getattr(self, name), fields[name]
            reader.check(stored.shape == held.shape and stored.dtype == held.dtype,
                         f"{name} is {list(stored.shape)} {stored.dtype}; these slots hold {list(held.shape)} {held.dtype}")
            held.copy_(stored)
        self.step = fields["step"]

    def _write_rows(self, flat: torch.Tensor, fill: torch.Tensor) -> None:
        """Slot ``flat[i]`` (``row * capacity + slot``) takes K ``fill[i, 0]`` and V ``fill[i, 1]`` (the
        slots' dtype): one compiled copy of the raw bits instead of two ``index_copy_`` (the planned fill,
        CPU slots)."""
        d = self.keys.shape[-1]
        bits = _SAME_SIZE_INT.get(fill.element_size())
        if bits is None or not (self.keys.is_contiguous() and self.values.is_contiguous()):
            self.keys.view(-1, d).index_copy_(0, flat, fill[:, 0])
            self.values.view(-1, d).index_copy_(0, flat, fill[:, 1])
            return
        _scatter_rows(self.keys.view(bits).view(-1, d).numpy(), self.values.view(bits).view(-1, d).numpy(),
                      flat.numpy(), fill.contiguous().view(bits).numpy())

    def select_device(self, selected: torch.Tensor, slow: SlowTier, mass: torch.Tensor | None = None,
                      overflow: torch.Tensor | None = None,
                      prefetched: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ahead: torch.Tensor | None = None):
        """``select`` for the GPU path: the bookkeeping on the slots' device, in one Triton launch
        (`kernels.lrqk_slots.slot_plan`; without Triton, or with ``plan_kernel`` off, in tensor ops: its oracle),
        and one host synchronisation, the miss transfer.

        The same slots as ``select``: membership through dense per-row maps (token -> slot), the eviction
        order by a stable argsort of the policy values, and the i-th missing token of a row (in
        ``selected`` order) takes that row's i-th slot in that order (a cumsum gives i). The missing rows'
        slow-tier positions are packed to the front of one int64 tensor (cumsum + scatter), with their
        count and the ``overflow`` flag (a 0-dim bool tensor of deferred range checks) after them; that
        tensor is the one copy to the host. The rows come from the slow tier through a pinned buffer
        (non-blocking). Returns the report, the slot of each selected token ``[rows, k]`` (what the
        gathered attention reads), the overflow flag as it reached the host (None without one), ``ahead`` on
        the host (None without it) and the missing rows still to store (`lrqk_proxy.SlotFill`, for the gathered
        attention to store as it reads them; None where they were stored here: no misses, or the tensor ops).

        ``prefetched``: ``(tokens [rows, e]`` on the device, ``rows [rows*e, 2, d]`` on the host), last
        step's background load: a missing token found there is installed from it (its position rides in
        the plan as a negative code). ``ahead`` ``[rows, e]``: tokens to load in the background for the
        next step, brought to the host in the same transfer."""
        self.step += 1
        rows, k = selected.shape
        cap = self.capacity
        if k > cap:
            raise ValueError(f"LRQK: {k} selected tokens do not fit {cap} slots")
        device = self.token.device
        selected = selected.to(device).long()
        n = rows * k
        kernel = self._plan_kernel_runs()
        if kernel:
            from kvshrink.kernels.lrqk_slots import slot_plan

            slot, plan, dest, rank, offset = slot_plan(
                selected, self.token, self.score, self.chosen, self.policy, self.step, slow.rows,
                mass.to(device) if mass is not None else None, overflow,
                prefetched[0].to(device) if prefetched is not None else None,
                ahead.to(device) if ahead is not None else None)
        else:
            slot, plan, dest = self._plan_torch(selected, slow, mass, overflow, prefetched, ahead)
        # the one host synchronisation
        host = _miss_plan_to_host(plan).numpy()
        slow.stream_synced()
        m = int(host[n])
        moved = hits = 0
        pending = None
        if m:
            codes = host[:m]
            from_pf = np.flatnonzero(codes < 0)
            hits = int(from_pf.size)
            extra = None
            if hits:
                extra = (torch.from_numpy(from_pf), prefetched[1].index_select(0, torch.from_numpy(-1 - codes[from_pf])))
            fill = slow.gather_to(torch.from_numpy(codes), device, extra)
            moved = (m - hits) * 2 * slow.head_dim * fill.element_size()
            if kernel and overflow is not None and self.keys.is_contiguous() and self.values.is_contiguous():
                from kvshrink.kernels.lrqk_proxy import SlotFill

                pending = SlotFill(fill, rank, offset, overflow)   # stored by the attention that reads them
            else:
                fill = deferred_to_storage(fill, self.keys.dtype, overflow)
                into = dest[:m]
                self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, into, fill[:, 0])
                self.values.view(-1, self.values.shape[-1]).index_copy_(0, into, fill[:, 1])
        flag = bool(host[n + 1] > 0) if overflow is not None else None
        ahead_host = torch.from_numpy(host[n + 2:]).reshape(ahead.shape) if ahead is not None and ahead.numel() else None
        report = FillReport(selected=n, missed=m, bytes_moved=moved, prefetch_hits=hits)
        return report, slot, flag, ahead_host, pending

    def _plan_kernel_runs(self) -> bool:
        """Whether `select_device` plans with the Triton kernels (`kernels.lrqk_slots`): Triton importable, the
        slot state contiguous, and ``plan_kernel`` on (the tests switch it off for the tensor ops, the oracle)."""
        return (self.plan_kernel and triton_available() and self.token.is_contiguous()
                and self.score.is_contiguous() and self.chosen.is_contiguous())

    def _plan_torch(self, selected: torch.Tensor, slow: SlowTier, mass: torch.Tensor | None,
                    overflow: torch.Tensor | None, prefetched: tuple[torch.Tensor, torch.Tensor] | None,
                    ahead: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`kernels.lrqk_slots.slot_plan` in tensor ops (its oracle): ``(slot, plan, dest)``, the slots' state
        updated."""
        rows, k = selected.shape
        cap = self.capacity
        device = self.token.device
        span = slow.length
        column = _map_index(self.token, span)                                    # [rows, S]
        slot_of = torch.full((rows, span + 1), -1, dtype=torch.long, device=device)
        slot_of.scatter_(1, column, torch.arange(cap, device=device).expand(rows, cap))
        slot_of[:, span] = -1
        current = slot_of.gather(1, selected)                                    # [rows, k]: slot or -1
        missing = current < 0
        stays = _dense_mask(selected, span).gather(1, column)                    # resident and selected
        priority = self.score.masked_fill(column == span, float("-inf")).masked_fill(stays, float("inf"))
        slot_order = torch.argsort(priority, dim=1, stable=True)
        rank = (missing.cumsum(1) - 1).clamp_min(0)
        slot = torch.where(missing, slot_order.gather(1, rank), current)         # [rows, k]
        # the missing rows packed to the front (row-major), their count and the overflow flag after them
        n = rows * k
        flat_missing = missing.reshape(-1)
        target = torch.where(flat_missing, flat_missing.cumsum(0) - 1, n)
        row_id = torch.arange(rows, device=device)[:, None].expand(rows, k).reshape(-1)
        n_ahead = ahead.numel() if ahead is not None else 0
        plan = torch.full((n + 2 + n_ahead,), -1, dtype=torch.long, device=device)
        source = selected.reshape(-1) * slow.rows + row_id                        # a slow-tier row
        if prefetched is not None:                                                # or -1 - a prefetched row
            pf_tokens = prefetched[0].to(device)
            found, pos = _position(selected, pf_tokens, span)
            pf_code = -1 - (row_id * pf_tokens.shape[1] + pos.reshape(-1))
            source = torch.where(found.reshape(-1), pf_code, source)
        plan.scatter_(0, target, source)
        plan[n] = flat_missing.sum()
        if n_ahead:
            plan[n + 2:] = ahead.reshape(-1).to(device)
        if overflow is not None:
            plan[n + 1] = overflow.long()
        dest = torch.zeros(n + 1, dtype=torch.long, device=device)
        dest.scatter_(0, target, row_id * cap + slot.reshape(-1))
        # the bookkeeping, on the device
        self.token.scatter_(1, slot, selected)
        self.score.scatter_(1, slot, torch.where(missing, 0.0, self.score.gather(1, slot)))
        self.chosen = torch.zeros_like(self.chosen).scatter_(1, slot, True)
        if self.policy == "lru":
            self.score.masked_fill_(self.chosen, float(self.step))
        elif self.policy == "attention" and mass is not None:
            self.score.scatter_add_(1, slot, mass.float().to(device))
        return slot, plan, dest

    @staticmethod
    def _fill_with_prefetch(selected, missing, row_idx, tokens, slow, prefetched, span):
        """The missing rows ``[m, 2, d]``, from last step's background load where it holds them, else
        from the slow tier; and the bytes read from the slow tier, and the prefetch hits."""
        fill = torch.empty(tokens.numel(), 2, slow.head_dim, dtype=slow.dtype)
        pf_tokens, pf_rows = prefetched
        pf_tokens = pf_tokens.to(selected.device)
        found, pos = _position(selected, pf_tokens, span)
        found, pos = found[missing], pos[missing]
        from_slow = ~found
        hits = int(found.sum())
        if hits:
            src = row_idx[found] * pf_tokens.shape[1] + pos[found]
            fill[found.cpu()] = pf_rows.index_select(0, src.cpu())
        moved = 0
        if hits < tokens.numel():
            loaded = slow.gather(row_idx[from_slow], tokens[from_slow])
            fill[from_slow.cpu()] = loaded
            moved = loaded.numel() * loaded.element_size()
        return fill, moved, hits

    def _update_policy_state(self, selected: torch.Tensor, mass: torch.Tensor | None, span: int) -> None:
        chosen = self.chosen
        if self.policy == "lru":
            self.score[chosen] = float(self.step)
        elif self.policy == "attention" and mass is not None:
            # Each slot's token looks its mass up in a dense per-row map of the selection's masses.
            token_mass = torch.zeros(selected.shape[0], span + 1, dtype=torch.float32, device=selected.device)
            token_mass.scatter_(1, selected, mass.float().to(selected.device))
            self.score += torch.where(chosen, token_mass.gather(1, _map_index(self.token, span)), 0.0)

    def selected_index(self, never: int) -> torch.Tensor:
        """Token index per slot for attention masking: the token if in the latest selection, else
        ``never``."""
        return torch.where(self.chosen, self.token, torch.full_like(self.token, never))

    def nbytes(self) -> int:
        return held_bytes([self.keys, self.values, self.token, self.score, self.chosen])


if numba_support.installed():
    from numba import njit

    from kvshrink.kernels.cpu.half_words import largest_word
    from kvshrink.kernels.cpu.half_words import narrow_row as _narrow_row

    @njit(cache=True)
    def _eviction_order(priority):  # pragma: no cover - compiled
        """``np.argsort(priority, kind="mergesort")`` (stable); in one pass when every finite priority is the
        same (the ``set`` policy: empty slots, then the others, then the selected ones, each in slot order)."""
        n = priority.shape[0]
        level = np.nan
        for s in range(n):
            p = priority[s]
            if np.isnan(p):
                return np.argsort(priority, kind="mergesort")
            if np.isfinite(p):
                if np.isnan(level):
                    level = p
                elif p != level:
                    return np.argsort(priority, kind="mergesort")
        order = np.empty(n, np.int64)
        m = 0
        for rank in range(3):   # -inf, finite, +inf
            for s in range(n):
                p = priority[s]
                kind = 0 if p == -np.inf else (2 if p == np.inf else 1)
                if kind == rank:
                    order[m] = s
                    m += 1
        return order

    @njit(inline="always")
    def plan_fill_row(r, token, score, selected, chosen, slot_of, in_selection, priority, missed):  # pragma: no cover
        """``_plan_fill`` for row ``r`` (``selected [k]``: its selection; ``slot_of``/``in_selection``: per-row maps
        over the token ids, all -1/False on entry and on return; ``priority [capacity]``: scratch). Writes the slot
        each missing token takes into ``missed`` (in ``selected`` order) and returns how many there are."""
        capacity = token.shape[1]
        k = selected.shape[0]
        for j in range(k):
            in_selection[selected[j]] = True
        for s in range(capacity):
            t = token[r, s]
            if t < 0:
                priority[s] = -np.inf
            else:
                slot_of[t] = s
                priority[s] = np.inf if in_selection[t] else score[r, s]
        order = _eviction_order(priority)
        used = 0
        for j in range(k):
            t = selected[j]
            if slot_of[t] < 0:
                s = order[used]
                if token[r, s] >= 0:     # evicted: it is not in the selection
                    slot_of[token[r, s]] = -1
                token[r, s] = t
                score[r, s] = 0.0
                missed[used] = s
                used += 1
        for s in range(capacity):
            t = token[r, s]
            chosen[r, s] = t >= 0 and in_selection[t]
        for s in range(capacity):   # reset the per-row maps for the next row
            t = token[r, s]
            if t >= 0:
                slot_of[t] = -1
        for j in range(k):
            in_selection[selected[j]] = False
        return used

    @njit(cache=True)
    def _plan_fill(token, score, selected, chosen, span):  # pragma: no cover - compiled
        """``SlotTier.select``'s bookkeeping for every row: the missing tokens take the first slots in
        eviction order (empty slots, then by policy value, stable; selected residents never move).
        Updates ``token`` and ``score`` (0 for a new token) in place, writes ``chosen``; returns the
        missing ``(row, token, flat slot)`` triples, row-major."""
        rows, capacity = token.shape
        k = selected.shape[1]
        slot_of = np.full(span + 1, -1, np.int64)
        in_selection = np.zeros(span + 1, np.bool_)
        row_idx = np.empty(rows * k, np.int64)
        tokens = np.empty(rows * k, np.int64)
        flat = np.empty(rows * k, np.int64)
        priority = np.empty(capacity, np.float64)
        missed = np.empty(k, np.int64)
        m = 0
        for r in range(rows):
            for i in range(plan_fill_row(r, token, score, selected[r], chosen, slot_of, in_selection, priority,
                                         missed)):
                s = missed[i]
                row_idx[m], tokens[m], flat[m] = r, token[r, s], r * capacity + s
                m += 1
        return row_idx[:m].copy(), tokens[:m].copy(), flat[:m].copy()

    @njit(cache=True)
    def _shift_in_narrowed(key, value, win_k, win_v, factors, a_words, column):  # pragma: no cover - compiled
        """A decode token into float16 storage, or nothing when a value is beyond float16's range: each row of
        the windows ``win_k/win_v [R, W, d]`` (float16 words) moves one token down and takes ``key/value [R, d]``
        (float32) last; ``a_words[:, column] [F, r]`` (float16 words) takes ``factors [F, r]`` (rounded to float32
        first). Returns the largest float32 word without its sign (from ``_F32_FP16_OVERFLOW_BITS`` to
        ``_F32_INF_BITS``: overflow, nothing written; a NaN's passes, as ``store.to_storage`` lets it)."""
        words = (key.view(np.uint32), value.view(np.uint32), factors.astype(np.float32).view(np.uint32))
        largest = max(largest_word(words[0]), largest_word(words[1]), largest_word(words[2]))
        if _F32_FP16_OVERFLOW_BITS <= largest <= _F32_INF_BITS:
            return largest
        last = win_k.shape[1] - 1
        for r in range(win_k.shape[0]):
            for w in range(last):
                win_k[r, w] = win_k[r, w + 1]
                win_v[r, w] = win_v[r, w + 1]
            _narrow_row(words[0][r], win_k[r, last])
            _narrow_row(words[1][r], win_v[r, last])
        for f in range(a_words.shape[0]):
            _narrow_row(words[2][f], a_words[f, column])
        return largest

    @njit(cache=True)
    def _touch_rows(bits, row_idx, tokens, flat, keys, values):  # pragma: no cover - compiled
        """Read one word of every cache line ``_copy_rows`` will read or write, first: rows scattered over the slow
        tier are far apart in memory, and loads with no work between them are in flight together (the copy's
        own loop waits for each row in turn). Returns a sum so the loads are kept."""
        total = 0
        k_step, b_step = 64 // keys.itemsize, 64 // bits.itemsize
        for i in range(tokens.shape[0]):
            src = bits[tokens[i], row_idx[i]]
            for t in range(0, src.shape[1], b_step):
                total += src[0, t] + src[1, t]
            for t in range(0, keys.shape[1], k_step):
                total += keys[flat[i], t] + values[flat[i], t]
        return total

    @njit(cache=True)
    def _copy_rows(bits, row_idx, tokens, flat, keys, values, narrow):  # pragma: no cover - compiled
        """``keys[flat[i]]`` and ``values[flat[i]]`` take the K and V of ``bits[tokens[i], row_idx[i]]``
        (``bits [T, rows, 2, d]``: the slow tier's words as unsigned integers), converted from float32 to
        float16 when ``narrow``, else copied as they are. Returns the largest float32 word copied without
        its sign when ``narrow`` (the largest magnitude's bits; above ``_F32_INF_BITS`` for a NaN), else 0, and
        ``_touch_rows``'s sum (returned so that its loads are not optimised away)."""
        largest = 0
        touched = _touch_rows(bits, row_idx, tokens, flat, keys, values)
        for i in range(tokens.shape[0]):
            src = bits[tokens[i], row_idx[i]]
            if narrow:
                largest = max(largest, _narrow_row(src[0], keys[flat[i]]), _narrow_row(src[1], values[flat[i]]))
            else:
                keys[flat[i]] = src[0]
                values[flat[i]] = src[1]
        return largest, touched

    @njit(cache=True)
    def _scatter_rows(keys, values, flat, fill):  # pragma: no cover - compiled
        """``keys[flat[i]] = fill[i, 0]``, ``values[flat[i]] = fill[i, 1]`` (rows as raw integer bits)."""
        for i in range(flat.shape[0]):
            keys[flat[i]] = fill[i, 0]
            values[flat[i]] = fill[i, 1]


# Integer dtype of each element size: slot rows are copied as raw bits by _scatter_rows.
_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
# numpy's unsigned words of each element size (_copy_rows reads and writes rows as raw bits)
_SAME_SIZE_UINT = {2: np.uint16, 4: np.uint32}

# float32 +inf's bit pattern: a larger pattern without the sign is a NaN.
_F32_INF_BITS = 0x7F800000
# the smallest float32 pattern beyond float16's largest value (65504)
_F32_FP16_OVERFLOW_BITS = int(np.array(FP16_MAX, dtype=np.float32).view(np.uint32)) + 1


def _uint_view(t: torch.Tensor, unsigned) -> np.ndarray:
    """``t``'s memory as numpy unsigned words of its element size (no copy)."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy().view(unsigned)


def half_words(t: torch.Tensor) -> np.ndarray:
    """A contiguous float16 CPU tensor ``[..., m, d]`` as numpy words ``[rows, m, d]`` (no copy): what
    ``shift_in_narrowed`` writes."""
    return _uint_view(t.view(-1, t.shape[-2], t.shape[-1]), np.uint16)


def _slot_rows_words(t: torch.Tensor) -> np.ndarray:
    return _uint_view(t.view(-1, t.shape[-1]), _SAME_SIZE_UINT[t.element_size()])


def shift_in_narrowed(key: np.ndarray, value: np.ndarray, factors: np.ndarray, words: tuple, column: int) -> None:
    """A decode token's float32 ``key/value [R, d]`` shifted into the float16 windows (``words``: the `half_words` of
    ``win_k``, ``win_v`` and the key factors ``a_k``; in place, the oldest token out) and its key factors ``factors
    [F, r]`` (float64) written into column ``column`` of the factors, in one compiled pass; ValueError, with nothing
    written, when a value is beyond float16's range (as ``store.to_storage``)."""
    check_narrowed(_shift_in_narrowed(key, value, words[0], words[1], factors, words[2], column))


def check_narrowed(largest: int) -> None:
    """ValueError (``store.check_fp16_peak``'s) when ``largest``, the largest float32 word a compiled pass narrowed
    to float16 (without its sign), is beyond float16's range; a NaN's word passes, as ``store.to_storage`` lets it."""
    if _F32_FP16_OVERFLOW_BITS <= largest <= _F32_INF_BITS:
        check_fp16_peak(float(np.array(largest, dtype=np.uint32).view(np.float32)))


def warm_up_fill_planner() -> None:
    """Compile (or load from numba's cache) the fill planner now, on a tiny input."""
    if numba_support.available():
        _plan_fill(np.full((1, 2), -1, np.int64), np.zeros((1, 2), np.float32), np.zeros((1, 1), np.int64),
                   np.zeros((1, 2), np.bool_), 1)
        for words, slot_words, narrow in ((np.uint32, np.uint16, True), (np.uint32, np.uint32, False),
                                          (np.uint16, np.uint16, False)):
            _copy_rows(np.zeros((1, 1, 2, 1), words), np.zeros(1, np.int64), np.zeros(1, np.int64),
                       np.zeros(1, np.int64), np.zeros((1, 1), slot_words), np.zeros((1, 1), slot_words), narrow)
        half = torch.zeros(1, 1, 1, 1, dtype=torch.float16)
        shift_in_narrowed(np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32), np.zeros((1, 1)),
                          (half_words(half), half_words(half.clone()), half_words(half.clone())), 0)
        for bits in (np.int16, np.int32):    # float16/bfloat16 and float32 slots
            _scatter_rows(np.zeros((1, 1), bits), np.zeros((1, 1), bits), np.zeros(1, np.int64),
                          np.zeros((1, 2, 1), bits))


def deferred_to_storage(x: torch.Tensor, dtype: torch.dtype, overflow: torch.Tensor | None) -> torch.Tensor:
    """``store.to_storage`` without its host synchronisation: narrowing to float16, whether a value is
    beyond float16's range is or-ed into ``overflow`` (a 0-dim bool tensor on ``x``'s device) instead of
    being read on the spot; the caller reads it with the next miss transfer and raises then. Without a
    flag, ``to_storage`` itself."""
    if overflow is None:
        return to_storage(x, dtype)
    if dtype == torch.float16 and x.dtype != dtype and x.numel():
        overflow.logical_or_(x.detach().abs().amax().float() > FP16_MAX)
    return x.to(dtype)


def _miss_plan_to_host(plan: torch.Tensor) -> torch.Tensor:
    """The GPU path's one host synchronisation per decode step and layer: the packed miss plan to the host
    (a blocking copy from a CUDA device; its own tensor on CPU). Tests count the calls."""
    return plan.to("cpu")


def _map_index(ids: torch.Tensor, span: int) -> torch.Tensor:
    """Column of each id in a dense per-row map of ``span + 1`` columns: empty (negative) ids go to
    the last column, which no real id uses, so they never collide with token 0."""
    return torch.where(ids >= 0, ids, span)


def _dense_mask(ids: torch.Tensor, span: int) -> torch.Tensor:
    """``[rows, span + 1]`` bool: ``out[i, t]`` is whether token ``t`` is among ``ids[i]`` (ids < span)."""
    mask = torch.zeros(ids.shape[0], span + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, _map_index(ids, span), True)
    mask[:, span] = False
    return mask


def _position(x: torch.Tensor, pool: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise ``(found, index)``: whether ``x[i, j]`` is in ``pool[i]`` and at which column
    (ids in ``[0, span)``; a dense per-row map from id to column)."""
    column = torch.full((pool.shape[0], span + 1), -1, dtype=torch.long, device=pool.device)
    column.scatter_(1, _map_index(pool, span), torch.arange(pool.shape[1], device=pool.device).expand_as(pool))
    column[:, span] = -1
    pos = column.gather(1, _map_index(x, span))
    return pos >= 0, pos.clamp_min(0)
