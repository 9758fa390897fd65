"""Live-tensor accounting: the bytes of every live tensor storage, per phase, by category at the peak.

How it counts (the method of torch/distributed/_tools/mem_tracker.py, `MemTracker`):
- a `TorchDispatchMode` sees the outputs of every aten op run while it is active; each storage
  not seen before is recorded with its `nbytes()`, and a weak reference on the storage object
  releases it when the storage is freed (torch keeps one Python object per storage while any
  tensor uses it, so the callback fires when the memory is released);
- `torch.UntypedStorage.resize_` is patched, because it is not an aten op: FSDP2 frees and
  re-allocates its unsharded parameters by resizing their storages to 0 and back
  (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `free_storage` / `alloc_storage`).
Enter it before the model is built and before the engine wraps it, or the engine's buffers
(DDP's buckets, DeepSpeed's reduce bucket) are missed; in a program that built the model already
(measure/live/), `track_existing` counts the tensors that were there before. What it cannot see: memory a kernel
uses internally without returning it as a tensor, tensors created on threads other than the one
that entered the mode (gloo's worker threads allocate none that outlive a collective), and what
a tensor subclass's own dispatch allocates on its local tensors: a mode is switched off while it
handles an op, so the mode sees a DTensor op's output, not the local ops DTensor runs for it.
Where those local ops allocate more than the output (`loss_parallel()`'s handlers: several
logits-sized shards), `counted_inside` wraps the handler so that they are counted too.

Categories at the peak. Only the engine runner knows which live tensors are parameters,
gradients, optimizer states or engine buffers (`EngineRunner.tensors_by_category`), and that
changes within a phase (a gradient appears, an unsharded parameter is freed). Asking it at
every new peak would cost O(live tensors) per allocation. Instead the accounting keeps
- a *base*: the live storages with their bytes and categories, classified by the runner at one
  moment, and
- a *log* of every allocation, free and resize since the base.
The live set at the peak is the base replayed up to the peak's position in the log, so the
total is exact. The base is re-taken (one classification) whenever the peak has grown by
`granularity` (1/256 of the peak, at least 64 KiB) since the last re-take, and when the log gets
long; a re-take for a new peak happens at the first event after it (the next op, resize or the
end of the phase: by then the engine has stored the tensor the peak's op returned, so the
runner can name it) and undoes the events since the peak. The
number of classifications per phase is therefore about 256 x ln(peak / start) at most, whatever
the number of allocations. A storage the runner did not name at the peak takes, in order, its
name at the end of the phase, "buffers" if a collective used it, the category given at its
birth (the worker: "buffers" for what the engine allocates while wrapping the model,
"temporaries" for what backward allocates), else the phase's default (activations in forward
and backward, temporaries otherwise). The categories always sum to the peak; which category a
short-lived storage lands in is as good as those rules.

The allocation stream. Besides the counts, the accounting keeps every storage allocation and free in
program order, as the allocator model's events (zeroplan/estimate/device/events.py): a resize is a
new allocation followed by the free of the old one, as `UntypedStorage.resize_` does it. At most
`event_limit` events are kept (a few MB per 100,000); past that the stream is marked truncated, and
measure/allocator_replay.py does not replay it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from zeroplan.estimate.device.events import Alloc, Free
from zeroplan.measure.collective_scratch import released_at_return, wait_until
from zeroplan.estimate.result import TENSOR_CATEGORIES
from zeroplan.measure.engines.common import ENGINE_CATEGORIES, VISIBLE_KERNELS

Classifier = Callable[[], dict[str, list[torch.Tensor]]]

ADAPTER_KEY = "adapter_params"
"""A classifier's optional key: tensors among its params that are PEFT adapters (the base/adapter split)."""

def storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a tensor: its own, or for a wrapper subclass (DTensor, a
    float8 tensor) those of the tensors it wraps (`__tensor_flatten__`)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor.untyped_storage()]
    inner_names, _ = tensor.__tensor_flatten__()
    found = []
    for name in inner_names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            found.extend(storages_of(inner))
    return found


_ACTIVE: list["TensorAccounting"] = []  # the accountings entered, innermost last


class _Inside(TorchDispatchMode):
    """Pushed inside a subclass's op handler, where the accounting's own mode is off: hands every
    op the handler runs on local tensors to the accounting, which runs it and records its outputs."""

    def __init__(self, accounting: "TensorAccounting"):
        super().__init__()
        self.accounting = accounting

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.accounting.__torch_dispatch__(func, types, args, kwargs)


def counted_inside(handler: Callable) -> Callable:
    """A DTensor custom op handler (op, args, kwargs) -> output, run so that the active accounting
    counts what it allocates on the local shards, not only the output DTensor it returns (see the
    module docstring). Without an active accounting it is the handler itself."""

    def counted(op_call, args, kwargs):
        if not _ACTIVE:
            return handler(op_call, args, kwargs)
        with _Inside(_ACTIVE[-1]):
            return handler(op_call, args, kwargs)

    return counted


def active_accounting() -> "TensorAccounting | None":
    """The innermost accounting entered (its dispatch mode), or None outside any."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def births_as(category: str):
    """For engine runners: storages born inside this block count as `category` in the active
    accounting unless the runner names them. Does nothing when no accounting is active."""
    if not _ACTIVE:
        yield
        return
    with _ACTIVE[-1].births_as(category):
        yield


@contextlib.contextmanager
def uncounted():
    """Ops run inside this block make storages the active accounting never counts (host copies a
    GPU machine keeps off the device: measure/activation_offload.py). Does nothing when none is active."""
    if not _ACTIVE:
        yield
        return
    bookkeeping = _ACTIVE[-1]._bookkeeping
    previous = getattr(bookkeeping, "on", False)
    bookkeeping.on = True
    try:
        yield
    finally:
        bookkeeping.on = previous


@dataclass
class PhaseMemory:
    """Bytes of one phase: live at its end, its peak, and the categories at that peak."""

    name: str
    live_bytes: int
    peak_bytes: int
    peak_categories: dict[str, int]
    start_bytes: int = 0
    adapter_params_bytes: int | None = None  # of peak_categories["params"]: adapter storages (None: none named)


@dataclass
class _Storage:
    serial: int
    key: int  # id() of the storage object
    nbytes: int
    ref: weakref.ref


@dataclass
class _Base:
    """The live storages at one moment: serial -> bytes, and serial -> category (classified ones)."""

    nbytes: dict[int, int]
    category: dict[int, str]


@dataclass
class _Phase:
    name: str
    default_category: str
    born_as: str | None  # category of storages born in this phase that the runner never names
    start_bytes: int
    peak_bytes: int
    base: _Base
    log: list[tuple[int, int, int]] = field(default_factory=list)  # (serial, bytes before, bytes after)
    peak_log_len: int | None = 0  # the peak is base + log[:peak_log_len]; None: peak_storages holds it
    peak_storages: dict[int, tuple[int, str | None]] | None = None
    peak_at_retake_bytes: int = 0
    retake_due: bool = False  # the peak grew enough: classify at the next event (see _settle)


class TensorAccounting(TorchDispatchMode):
    """Counts live tensor storage bytes while active; phases give peaks and categories at peaks.

    Usage:
        with TensorAccounting() as acc:
            acc.begin_phase("model", default_category="temporaries")
            model = build()
            phase = acc.end_phase()
            acc.set_classifier(runner.tensors_by_category)
    """

    def __init__(self, *, granularity_fraction: float = 1 / 256, min_granularity_bytes: int = 64 * 1024,
                 event_limit: int = 500_000, device_type: str | None = None):
        super().__init__()
        self.event_limit = event_limit
        self.events: list = []  # Alloc/Free in program order (see the module docstring)
        self.events_truncated = False
        self._generation: dict[int, int] = {}  # serial -> how many allocations it has had (the event key's second part)
        # None: count every device's storages (a worker, whose own tensors are all on its device);
        # "cuda": only those on a GPU, for a tracker in a user's program whose host holds data too
        self.device_type = device_type
        self.granularity_fraction = granularity_fraction
        self.min_granularity_bytes = min_granularity_bytes
        self.current_bytes = 0
        self._live: dict[int, _Storage] = {}  # id(storage object) -> record
        self._by_serial: dict[int, _Storage] = {}
        self._born_as: dict[int, str] = {}  # serial -> category given at birth (see begin_phase)
        self._communicated: set[int] = set()  # serials of storages a collective (c10d op) used
        self._adapter: set[int] = set()  # serials of storages the runner named "adapter_params" (PEFT adapters)
        self._next_serial = 0
        self._classifier: Classifier | None = None
        self._phase: _Phase | None = None
        self._lock = threading.Lock()  # not reentrant: a free seen while we hold it is queued
        self._pending_frees: deque[int] = deque()
        self._bookkeeping = threading.local()
        self._birth_category: str | None = None
        self._orig_resize = None
        self._active = False
        self.classifications = 0  # how many times the runner was asked (the cost of the method)

    # -- entering and leaving ---------------------------------------------------------------
    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        orig_resize, accounting = self._orig_resize, self

        def resize_(storage, size):  # not an aten op, so the mode does not see it
            accounting._before_resize()
            result = orig_resize(storage, size)
            accounting._on_resize(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._active = True
        _ACTIVE.append(self)
        # a synchronous collective's own copies die where it returns (measure/collective_scratch.py)
        self._collectives = released_at_return(self._await_scratch, lambda: self._next_serial)
        self._collectives.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._active = False
        _ACTIVE.remove(self)
        torch.UntypedStorage.resize_ = self._orig_resize
        self._collectives.__exit__(None, None, None)
        return super().__exit__(*exc)

    def _await_scratch(self, first_serial: int, args: tuple, kwargs: dict) -> None:
        """Wait for the storages a collective created from `first_serial` on and did not take as arguments to be
        freed (by gloo's worker thread, if it holds the Work last): measure/collective_scratch.py."""
        with self._lock:
            self._drain()
            given = {id(storage) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                     and self._counts(t.device) for storage in storages_of(t)}
            scratch = [serial for serial, record in self._by_serial.items()
                       if serial >= first_serial and record.nbytes and record.key not in given]
        if scratch:
            wait_until(lambda: not any(serial in self._by_serial for serial in scratch) or not self._pending_or_live(scratch))
            with self._lock:
                self._drain()

    def _pending_or_live(self, serials: list[int]) -> bool:
        """Whether any of `serials` is still counted (its free not yet seen, or seen but not yet drained)."""
        pending = set(self._pending_frees)
        return any(serial in self._by_serial and serial not in pending for serial in serials)

    # -- the dispatch hook ------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(self._bookkeeping, "on", False):  # an op run by the runner while we classify
            return func(*args, **(kwargs or {}))
        kernel = VISIBLE_KERNELS.get(f"{func.namespace}::{func.__name__.partition('.')[0]}") if VISIBLE_KERNELS else None
        if kernel is not None:
            with self:  # its own ops come back through this mode (engines/common.py VISIBLE_KERNELS)
                return kernel(*args, **(kwargs or {}))
        if self._phase is not None and self._phase.retake_due:
            with self._lock:
                self._drain()
                self._settle()
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        if func.namespace == "c10d":  # a collective: its inputs are communication buffers too
            flat += tree_flatten((args, kwargs))[0]
        # meta tensors hold no memory (a fake tensor reports the device it stands for)
        tensors = [t for t in flat if isinstance(t, torch.Tensor) and self._counts(t.device)]
        if tensors:
            with self._lock:
                self._drain()
                for t in tensors:
                    for storage in storages_of(t):
                        serial = self._track(storage)
                        if func.namespace == "c10d":
                            self._communicated.add(serial)
                self._drain()
        return out

    def _counts(self, device: torch.device) -> bool:
        return device.type != "meta" and self.device_type in (None, device.type)

    def track_existing(self, tensors) -> None:
        """Count the storages of `tensors`, made before this accounting was entered, as live from now
        (a tracker entered in a user's program finds the model built: its parameters, buffers, any
        gradients and optimizer states). Storages already counted are left as they are."""
        with self._lock:
            self._drain()
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor) and self._counts(tensor.device):
                    for storage in storages_of(tensor):
                        self._track(storage)
            self._drain()

    def _track(self, storage: torch.UntypedStorage) -> int:
        """Record `storage` if it is new, or its new size; return its serial number."""
        record = self._live.get(id(storage))
        if record is not None and record.ref() is storage:
            if record.nbytes != storage.nbytes():  # an in-place resize through an aten op
                self._set_bytes(record, storage.nbytes())
            return record.serial
        serial = self._next_serial
        self._next_serial += 1
        key = id(storage)
        ref = weakref.ref(storage, lambda _ref, serial=serial: self._on_free(serial))
        record = _Storage(serial, key, 0, ref)
        self._live[key] = record
        born_as = self._birth_category or (self._phase.born_as if self._phase is not None else None)
        if born_as is not None:
            self._born_as[serial] = born_as
        self._by_serial[serial] = record
        self._set_bytes(record, storage.nbytes())
        return serial

    def _before_resize(self) -> None:
        if getattr(self._bookkeeping, "on", False):
            return
        if self._active and self._phase is not None and self._phase.retake_due:
            with self._lock:
                self._drain()
                self._settle()

    def _on_resize(self, storage: torch.UntypedStorage) -> None:
        if getattr(self._bookkeeping, "on", False):  # a resize by the runner while we classify
            return
        with self._lock:
            self._drain()
            record = self._live.get(id(storage))
            if record is not None and record.ref() is storage:
                self._set_bytes(record, storage.nbytes())
            elif self._active and self.device_type in (None, storage.device.type):  # a fake storage is on meta
                self._track(storage)
            self._drain()

    def _on_free(self, serial: int) -> None:
        # Called by the garbage collector, possibly on another thread (gloo drops the last
        # reference to a collective's tensor on its own thread) or while we hold the lock.
        self._pending_frees.append(serial)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        while self._pending_frees:
            serial = self._pending_frees.popleft()
            record = self._by_serial.pop(serial, None)
            if record is None:
                continue
            self._set_bytes(record, 0)
            # The id() of a dead storage can be reused: drop it only if it still maps to this one.
            if self._live.get(record.key) is record:
                del self._live[record.key]

    def _set_bytes(self, record: _Storage, nbytes: int) -> None:
        delta = nbytes - record.nbytes
        if delta == 0:
            return
        self._log_event(record.serial, record.nbytes, nbytes)
        record.nbytes = nbytes
        self.current_bytes += delta
        phase = self._phase
        if phase is None:
            return
        phase.log.append((record.serial, nbytes - delta, nbytes))
        if self.current_bytes > phase.peak_bytes:
            phase.peak_bytes = self.current_bytes
            phase.peak_log_len = len(phase.log)
            phase.peak_storages = None
            granularity = max(self.min_granularity_bytes, int(phase.peak_at_retake_bytes * self.granularity_fraction))
            phase.retake_due = self.current_bytes >= phase.peak_at_retake_bytes + granularity
        elif len(phase.log) > 4 * len(self._live) + 4096:
            self._retake(phase)

    def _log_event(self, serial: int, before: int, after: int) -> None:
        """Append the allocator events of a storage going from `before` to `after` bytes."""
        if len(self.events) + 2 > self.event_limit:
            self.events_truncated = True
            return
        old = self._generation.get(serial, -1)
        if after:
            self._generation[serial] = old + 1
            self.events.append(Alloc((serial, old + 1), after))
        if before:
            self.events.append(Free((serial, old)))

    # -- classification ---------------------------------------------------------------------
    def set_classifier(self, classifier: Classifier | None) -> None:
        """Where the categories come from: usually `runner.tensors_by_category`."""
        self._classifier = classifier

    def _classify(self) -> dict[int, str]:
        """serial -> category of every live storage the runner names (first category wins)."""
        if self._classifier is None:
            return {}
        self.classifications += 1
        categories: dict[int, str] = {}
        self._bookkeeping.on = True  # we hold the lock: the runner's own ops must not take it
        try:
            by_category = self._classifier()
        finally:
            self._bookkeeping.on = False
        for name in ENGINE_CATEGORIES:
            for tensor in by_category.get(name, ()):
                if tensor is None:
                    continue
                for storage in storages_of(tensor):
                    record = self._live.get(id(storage))
                    if record is not None and record.ref() is storage:
                        categories.setdefault(record.serial, name)
        for tensor in by_category.get(ADAPTER_KEY, ()):  # a subset of params: which are adapters
            for storage in storages_of(tensor):
                record = self._live.get(id(storage))
                if record is not None and record.ref() is storage:
                    self._adapter.add(record.serial)
        return categories

    def _snapshot(self) -> _Base:
        return _Base({r.serial: r.nbytes for r in self._by_serial.values() if r.nbytes}, self._classify())

    @staticmethod
    def _replay(base: _Base, log: list[tuple[int, int]], later: dict[int, str]) -> dict[int, tuple[int, str | None]]:
        """serial -> (bytes, category the runner gave) of the storages live at base + log: a base
        storage keeps the base's category, one born in the log takes `later`'s (None: unnamed)."""
        nbytes = dict(base.nbytes)
        for serial, _, size in log:
            nbytes[serial] = size
        return {
            serial: (size, base.category.get(serial) if serial in base.nbytes else later.get(serial))
            for serial, size in nbytes.items()
            if size
        }

    def _totals(self, storages: dict[int, tuple[int, str | None]], at_end: dict[int, str], default: str) -> dict[str, int]:
        """Bytes by category. A storage takes, in order: the runner's category at the peak; the
        runner's category at the end of the phase (a gradient in the making at the peak is a
        gradient by the end; optimizer states are named once step() returns); "buffers" if a
        collective used it (an all-gather output or reduce-scatter input the engine no longer
        references, but the process group still holds); the category given at its birth
        (`born_as`, `births_as`); the phase's default."""
        totals = dict.fromkeys(TENSOR_CATEGORIES, 0)
        for serial, (size, category) in storages.items():
            totals[self._category(serial, category, at_end, default)] += size
        return totals

    def _category(self, serial: int, category: str | None, at_end: dict[int, str], default: str) -> str:
        """The category a storage counts under (see `_totals`)."""
        category = category or at_end.get(serial)
        if category is None and serial in self._communicated:
            category = "buffers"
        return category or self._born_as.get(serial) or default

    def _adapter_bytes(self, storages: dict[int, tuple[int, str | None]], at_end: dict[int, str], default: str) -> int | None:
        """Bytes of the params at the peak that are adapter storages; None when the runner names none."""
        if not self._adapter:
            return None
        return sum(size for serial, (size, category) in storages.items()
                   if serial in self._adapter and self._category(serial, category, at_end, default) == "params")

    def _retake(self, phase: _Phase) -> None:
        """New base now; materialise the peak first if it lives in the log that goes away."""
        base = self._snapshot()
        if phase.peak_log_len is not None:
            phase.peak_storages = self._replay(phase.base, phase.log[: phase.peak_log_len], base.category)
            phase.peak_log_len = None
        phase.base, phase.log = base, []

    def _settle(self) -> None:
        """Classify a peak that grew by `granularity`, at the first event after it.

        Not at the allocation that made the peak: the runner cannot name a tensor before the
        op that made it has returned and the engine has stored it (DeepSpeed's reduce bucket,
        an all-gather output). At the next op, or the end of the phase, it can; the storages
        live at the peak are those live now with the events since the peak undone."""
        phase = self._phase
        if phase is None or not phase.retake_due:
            return
        phase.retake_due = False
        base = self._snapshot()
        nbytes = dict(base.nbytes)
        for serial, before, _ in reversed(phase.log[phase.peak_log_len :]):
            nbytes[serial] = before
        phase.peak_storages = {
            serial: (size, base.category.get(serial) or phase.base.category.get(serial))
            for serial, size in nbytes.items()
            if size
        }
        phase.peak_log_len = None
        phase.peak_at_retake_bytes = phase.peak_bytes
        phase.base, phase.log = base, []

    # -- phases -----------------------------------------------------------------------------
    def begin_phase(self, name: str, *, default_category: str, born_as: str | None = None) -> None:
        """Start a phase: its peak starts at the bytes live now. Live storages the runner does not
        name count as `default_category`; those born in this phase count as `born_as` (if given)
        in this phase and every later one: the worker gives "buffers" while the engine wraps the
        model, since what an engine allocates then and keeps is its own (DDP's reducer buckets,
        which Python cannot reach)."""
        for category in (default_category, born_as):
            if category is not None and category not in TENSOR_CATEGORIES:
                raise ValueError(f"category {category!r} is not one of {TENSOR_CATEGORIES}")
        with self._lock:
            self._drain()
            phase = _Phase(name, default_category, born_as, self.current_bytes, self.current_bytes, _Base({}, {}))
            phase.base = self._snapshot()
            phase.peak_log_len = 0
            phase.peak_at_retake_bytes = self.current_bytes
            self._phase = phase

    def end_phase(self) -> PhaseMemory:
        """End the current phase; return its live bytes, peak and the categories at the peak."""
        with self._lock:
            self._drain()
            phase = self._phase
            if phase is None:
                raise RuntimeError("end_phase() without begin_phase()")
            self._settle()
            at_end = self._classify()
            if phase.peak_log_len is not None:
                phase.peak_storages = self._replay(phase.base, phase.log[: phase.peak_log_len], at_end)
            categories = self._totals(phase.peak_storages, at_end, phase.default_category)
            adapter_bytes = self._adapter_bytes(phase.peak_storages, at_end, phase.default_category)
            self._phase = None
            return PhaseMemory(phase.name, self.current_bytes, phase.peak_bytes, categories, phase.start_bytes, adapter_bytes)

    @contextlib.contextmanager
    def births_as(self, category: str):
        """Storages born inside this block count as `category` unless the runner names them
        (for engine buffers Python cannot reach, e.g. DDP's rebuilt reducer buckets)."""
        if category not in TENSOR_CATEGORIES:
            raise ValueError(f"category {category!r} is not one of {TENSOR_CATEGORIES}")
        previous, self._birth_category = self._birth_category, category
        try:
            yield
        finally:
            self._birth_category = previous

    def live_categories(self) -> dict[str, int]:
        """Categories of everything live now (the runner's view; the rest as temporaries)."""
        with self._lock:
            self._drain()
            return self._totals(self._replay(self._snapshot(), [], {}), {}, "temporaries")
