"""An estimate's three device figures (figures.py): each rank kind's ledger read as the allocations and
frees of its program, replayed through the caching allocator, with the memory outside it.

The ledger holds the terms live at each phase's largest moment, in program order (estimate/ledger.py).
Between two moments a term that grows allocates the difference, one that shrinks frees its most recent
pieces (backward frees what forward saved last), one that disappears frees all of it: `ledger_events`.
A term that the engine allocates on a side stream is allocated there (`TERM_STREAMS`): each stream has its own
free blocks, so what it frees stays cached for it. The process groups are the mesh's: one NCCL communicator per
dimension of more than one rank (`process_groups`), the world's on plain data parallelism.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping
from itertools import accumulate
from dataclasses import replace
from typing import NamedTuple

from zeroplan.estimate.device.alloc_conf import DEFAULT_SETTINGS, AllocatorSettings
from zeroplan.estimate.device.events import DEFAULT_STREAM, Alloc, Event, Free
from zeroplan.estimate.device.figures import DeviceFigures, GpuFacts, gpu_figures, rank_outside_terms
from zeroplan.estimate.device.outside import OutsideTerm, ProcessGroup
from zeroplan.estimate.ledger import Moment
from zeroplan.estimate.result import MeshEstimate, PieceSizes
from zeroplan.estimate.terms import named, pieces_of, register, source_of

UNKNOWN_GPU_BYTES = 1 << 50  # no GPU named: nothing runs out of memory (the figures are the program's own)

# FSDP2's side streams (torch 2.13 torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): `foreach_all_gather`
# allocates the all-gather output under all_gather_copy_in_stream (_fsdp_param_group.py `get_all_gather_streams`:
# forward and pre-backward, implicit prefetching), `foreach_reduce` the reduce-scatter output under
# reduce_scatter_stream, and the sharded gradients are views of it (`torch.as_strided(reduce_output, ...)`, cast
# there to the parameters' dtype when they differ), kept until the optimizer's zero_grad.
FSDP2_ALL_GATHER_STREAM = 1
FSDP2_REDUCE_SCATTER_STREAM = 2
TERM_STREAMS = {"all-gather output": FSDP2_ALL_GATHER_STREAM, "sharded gradients": FSDP2_REDUCE_SCATTER_STREAM}


class UnnamedGpu(NamedTuple):
    """A GPU known by its memory alone (`--gpu-memory 80GiB`), or not at all: the terms outside the allocator
    take their stated defaults (outside.py says so in each term's source)."""

    memory_bytes: int = UNKNOWN_GPU_BYTES
    name: str = "unnamed GPU"
    architecture: str = "unknown"
    compute_capability_pair: tuple[int, int] | None = None
    interconnect: str = "nvswitch"


def _pieces(size: int, name: str, sizes: PieceSizes | None, held: int = 0) -> list[int]:
    """`size` bytes of term `name`, which holds `held` already, as the tensors the program allocates them in: a
    term known tensor by tensor (a block's saved tensors) in those, a parameter-sized term in the proportions of
    the rank's parameter tensors, another in tensors of its kind's size."""
    kind = pieces_of(name)
    if sizes is not None and sizes.term_tensors:
        period = dict(sizes.term_tensors).get(name)
        if period:
            return _periodic(held, size, period)
    if kind == "tensors" and sizes is not None and sizes.param_numels:
        return _proportional(size, sizes.param_numels)
    if kind == "states":  # a flat partition's states grow one partition at a time, `states` tensors of its size
        return _proportional(size, (1,) * (sizes.states if sizes is not None else 1))
    if kind == "step":  # a flat partition's step temporaries: the kernel's tensors of its size (engines/common.py)
        return _proportional(size, (1,) * (sizes.step_tensors if sizes is not None else 1))
    piece = 0 if sizes is None or kind == "whole" else getattr(sizes, kind)
    if piece <= 0 or size <= piece:
        return [size]
    whole, rest = divmod(size, piece)
    return [piece] * whole + ([rest] if rest else [])


def _periodic(start: int, size: int, period: tuple[int, ...]) -> list[int]:
    """Bytes `start` to `start + size` of a term made of `period`'s tensors over and over (one block's, then the
    next block's), cut where a tensor ends: a term that grows in steps continues where it stopped."""
    ends = list(accumulate(period))
    pieces, at, stop = [], start, start + size
    while at < stop:
        blocks, within = divmod(at, ends[-1])
        end = blocks * ends[-1] + ends[bisect_right(ends, within)]
        pieces.append(min(end, stop) - at)
        at = min(end, stop)
    return pieces


def _proportional(size: int, numels: tuple[int, ...]) -> list[int]:
    """`size` bytes cut in the proportions of `numels` (each piece at least one byte; they add up to `size`)."""
    total, pieces, done, running = sum(numels), [], 0, 0
    for numel in numels:
        running += numel
        upto = size * running // total
        if upto > done:
            pieces.append(upto - done)
            done = upto
    return pieces


def ledger_events(ledger: Iterable[Moment], sizes: PieceSizes | None = None,
                  moments: list[int] | None = None) -> list[Event]:
    """The ledger as allocations and frees in program order (module docstring): a term grows by tensors of its
    kind's size (`sizes`; None: by one block each time), each one block the allocator hands out on the term's
    stream (`TERM_STREAMS`), keyed by (term, category, piece). `moments`, if given, receives the index of each
    moment's first event."""
    pieces: dict[tuple[str, str], list[tuple[int, int]]] = {}  # (name, category) -> [(piece number, bytes)], oldest first
    counter = 0
    events: list[Event] = []
    for moment in ledger:
        if moments is not None:
            moments.append(len(events))
        for terms in (moment.terms, *moment.passing):  # its peak, then the moments after it (ledger.py Moment)
            now: dict[tuple[str, str], int] = {}
            for term in terms:
                if term.category != "overhead":  # not a tensor: outside the allocator (figures.py adds it)
                    now[term.name, term.category] = now.get((term.name, term.category), 0) + term.bytes
            for key, held in list(pieces.items()):  # frees first: what a phase no longer holds is gone before it allocates
                excess = sum(size for _, size in held) - now.get(key, 0)
                while excess > 0 and held:
                    number, size = held.pop()
                    events.append(Free((*key, number)))
                    if size > excess:  # the rest of the piece stays: it is a smaller block now
                        counter += 1
                        held.append((counter, size - excess))
                        events.append(Alloc((*key, counter), size - excess, TERM_STREAMS.get(key[0], DEFAULT_STREAM)))
                    excess -= size
            for key, wanted in now.items():
                held = pieces.setdefault(key, [])
                missing = wanted - sum(size for _, size in held)
                if missing > 0:
                    stream = TERM_STREAMS.get(key[0], DEFAULT_STREAM)
                    for size in _pieces(missing, key[0], sizes, wanted - missing):
                        counter += 1
                        held.append((counter, size))
                        events.append(Alloc((*key, counter), size, stream))
    return events


def process_groups(mesh: object, gpus: int, node_gpus: int) -> tuple[ProcessGroup, ...]:
    """One communicator per mesh dimension of more than one rank (torchtitan's device mesh: tp innermost, then cp,
    dp_shard, dp_replicate, pp outermost; a dimension of `size` ranks `stride` apart spans ceil(size x stride /
    node_gpus) nodes); the world's on plain data parallelism. The pipeline's talks point to point."""
    dims = [("tp", mesh.tp), ("cp", mesh.cp), ("dp_shard", mesh.dp_shard(gpus)), ("dp_replicate", mesh.dp_replicate),
            ("pp", mesh.pp)]
    groups, stride = [], 1
    for name, size in dims:
        if size > 1:
            nodes = max(1, min(size, -(-size * stride // node_gpus)))
            groups.append(ProcessGroup(name, size, nodes, 2 if name == "pp" else 0))
        stride *= size
    if not groups and gpus > 1:
        groups.append(ProcessGroup("world", gpus, max(1, -(-gpus // node_gpus))))
    return tuple(groups)


_GROUPS = ("world", "tp", "cp", "dp_shard", "dp_replicate", "pp")
_OUTSIDE = "estimate/device/outside.py (docs/engines/allocator.md, Memory outside the allocator)"
_DEVICE_TERMS = register({"cuda_context": f"{_OUTSIDE}: the CUDA context, by compute capability",
                          **{f"nccl_{kind}:{group}": f"{_OUTSIDE}: NCCL's {kind} buffers of the {group} communicator"
                             for kind in ("ring", "nvls", "p2p") for group in _GROUPS}})


def program_outside_terms(ledger: Iterable[Moment]) -> tuple[OutsideTerm, ...]:
    """What a rank's program keeps outside the allocator besides the CUDA context and NCCL's buffers (outside.py
    sizes those from the GPU): the overhead category's other named terms (async TP's symmetric-memory workspace),
    each at its largest."""
    largest: dict[str, int] = {}
    for moment in ledger:
        for term in moment.terms:
            if term.category == "overhead" and term.name not in _DEVICE_TERMS:
                largest[term.name] = max(largest.get(term.name, 0), term.bytes)
    return tuple(OutsideTerm(name, size, source_of(name)) for name, size in largest.items() if size > 0)


def outside_memory(training) -> int:
    """The memory outside the caching allocator on a rank of `training`, as named terms (the CUDA context,
    each communicator's NCCL buffers: outside.py, on `training.gpu` or a GPU known by nothing); none on a CPU run."""
    if training.device.value != "cuda":
        return 0
    groups = process_groups(training.mesh, training.gpus, training.node_gpus)
    return sum(named(term.name, term.size_bytes) for term in rank_outside_terms(training.gpu or UnnamedGpu(), groups))


def device_figures(result: MeshEstimate, training, gpu: GpuFacts | None = None, *,
                   settings: AllocatorSettings = DEFAULT_SETTINGS,
                   environ: Mapping[str, str] | None = None, record_history: bool = False) -> dict[str, DeviceFigures]:
    """Allocated, reserved and device bytes of each rank kind of `result` (by its label), on `gpu` (None: a GPU
    known by nothing, `UnnamedGpu`); `settings` are PYTORCH_CUDA_ALLOC_CONF's (with the recipe's default), `environ`
    the NCCL_* and CUBLAS_WORKSPACE_CONFIG values the run sets; `record_history` keeps each replay's trace."""
    events = {rank.kind.label: ledger_events(rank.estimate.ledger, rank.estimate.piece_sizes) for rank in result.ranks}
    program = {rank.kind.label: program_outside_terms(rank.estimate.ledger) for rank in result.ranks}
    groups = process_groups(training.mesh, training.gpus, training.node_gpus)
    gpu = gpu or UnnamedGpu()
    figures = gpu_figures(events, gpu, process_groups=groups, settings=settings, environ=environ,
                          program_outside=program, record_history=record_history)
    short = {kind: events[kind] for kind, found in figures.items() if not found.fits}
    if short:  # what those ranks would need: the same replay on the same GPU without its limit
        unlimited = _Unlimited(gpu)
        needs = gpu_figures(short, unlimited, process_groups=groups, settings=settings, environ=environ,
                            program_outside=program, record_history=record_history)
        figures |= {kind: replace(found, ran_out=True, capacity_bytes=figures[kind].capacity_bytes,
                                  device_at_oom_bytes=figures[kind].reserved_at_oom_bytes + figures[kind].outside_bytes)
                    for kind, found in needs.items()}
    return figures


class _Unlimited(NamedTuple):
    """`gpu` with memory enough for anything (the architecture's terms stay)."""

    gpu: GpuFacts

    @property
    def memory_bytes(self) -> int:
        return UNKNOWN_GPU_BYTES

    def __getattr__(self, name: str):
        return getattr(self.gpu, name)
