"""An `Estimate` as plain JSON-ready data: the contract scripts rely on (`zeroplan estimate
--format json`), and the one source every other output format is rendered from.

All sizes are ints in bytes. Keys:
- `model`: name, params, trainable_params, implementation;
- `engine`;
- `per_gpu`: the categories live at the peak (params, grads, optimizer_states, activations,
  buffers, temporaries, overhead; they sum to `peak`), `peak`, `peak_step` (first/steady),
  `peak_phase` (init/forward/backward/optimizer_step);
- `phases`: one entry per (step, phase) with the same categories and their `total`;
- `per_node`: cpu (pinned included), pinned, nvme, unified (bitsandbytes' paged optimizer states of the
  node's GPUs: CUDA unified memory outside the per-GPU peak, on the GPUs while they have room);
- `config`: the TrainingSpec (gpus_per_node resolved), which reads back with
  `TrainingSpec.model_validate`;
- `param_parts` (with LoRA only): the peak's params as `base` and `adapter` bytes;
- on a CUDA run, `per_gpu` also holds `allocated` (predicted `torch.cuda.max_memory_allocated()`: the tensors
  rounded as the caching allocator hands them out, and cuBLAS's workspaces), `reserved` (predicted
  `max_memory_reserved()`: the allocator's segments, replaying the ledger's allocations and frees) and
  `device` (what nvidia-smi shows: reserved plus the memory outside the allocator); `device_memory` says
  what those are made of (estimate/device/, docs/engines/allocator.md). `peak` is the tensor peak plus the
  memory outside the allocator (the `overhead` category);
- `gpu_memory` and `fits` only when a GPU memory size was given: every rank's `device` (or `peak` where no
  device figure is estimated) within `gpu_memory`;
- `notes`;
- `terms`: the named allocations live at the peak (estimate/ledger.py): name, category, bytes,
  source, largest first; they add up to each category of `per_gpu` and to its `peak`;
- `mesh`: the degrees (all 1 on plain data parallelism) and the data-parallel sharding they leave;
- `ranks`: one entry per distinct rank kind (one without pipelining), each with its GPU count,
  what it holds, its own `per_gpu`, `phases` and `terms`; `worst_rank` indexes the one whose
  peak is highest, which the top-level figures describe.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from zeroplan.estimate.result import Estimate, MeshEstimate, NodeBytes, PhaseBytes, RankEstimate, RankKind
from zeroplan.spec.optimizer_step import training_optimizer_step

if TYPE_CHECKING:
    from zeroplan.estimate.device.figures import DeviceFigures
    from zeroplan.spec.optimizer_step import OptimizerStep
    from zeroplan.spec.program import FSDP2Wrapping, Program
    from zeroplan.spec.training import TrainingSpec


def phase_to_dict(phase: PhaseBytes) -> dict[str, Any]:
    return {"step": phase.step.value, "phase": phase.phase.value, **phase.categories.as_dict(), "total": phase.total_bytes}


def per_gpu_to_dict(estimate: Estimate) -> dict[str, Any]:
    """`per_gpu`: the categories at the peak, `peak`, `peak_step`, `peak_phase` (also the shape of
    each row's `per_gpu` in `zeroplan compare` and `zeroplan plan` JSON)."""
    peak = estimate.peak
    return {**peak.categories.as_dict(), "peak": peak.total_bytes, "peak_step": peak.step.value, "peak_phase": peak.phase.value}


def per_node_to_dict(node: NodeBytes) -> dict[str, int]:
    """`per_node`: cpu (pinned included), pinned, nvme, unified."""
    return {"cpu": node.cpu_bytes, "pinned": node.pinned_bytes, "nvme": node.nvme_bytes, "unified": node.unified_bytes}


def terms_to_list(estimate: Estimate) -> list[dict[str, Any]]:
    """The terms live at the estimate's peak, largest first (empty without a ledger: the planner's fast fit)."""
    if estimate.ledger is None:
        return []
    moment = estimate.ledger[estimate.phases.index(estimate.peak)]
    ordered = sorted(moment.terms, key=lambda term: -term.bytes)
    return [{"name": term.name, "category": term.category, "bytes": term.bytes, "source": term.source} for term in ordered]


def mesh_to_dict(training: TrainingSpec) -> dict[str, Any]:
    """The degrees, the schedule, and what data parallelism is left: dp_shard, and the FSDP/ZeRO sharding degrees."""
    mesh, gpus = training.mesh, training.gpus
    dumped = mesh.model_dump(mode="json")  # every knob, moe_imbalance's assumed 1.0 (balanced routing) included
    return {**dumped, "dp_shard": mesh.dp_shard(gpus), "fsdp_degree": mesh.fsdp_degree(gpus),
            "expert_fsdp_degree": mesh.expert_fsdp_degree(gpus)}


def device_to_dict(figures: DeviceFigures) -> dict[str, Any]:
    """A rank's figures on the GPU (estimate/device/figures.py): allocated, reserved and device bytes and what
    lives outside the allocator, and the allocator's own counts."""
    replay = figures.replay
    return {"allocated": figures.allocated_bytes, "reserved": figures.reserved_bytes, "device": figures.device_bytes,
            "capacity": figures.capacity_bytes,
            "outside": [{"name": t.name, "bytes": t.size_bytes, "source": t.source} for t in figures.outside],
            "cublas_workspaces": sum(t.size_bytes for t in figures.allocator_terms),
            "segments": replay.segments, "num_alloc_retries": replay.num_alloc_retries, "num_ooms": replay.num_ooms,
            "inactive_split_peak": replay.peak_inactive_split_bytes,
            "ran_out_of_memory": figures.ran_out,  # the figures are then what it would need
            "device_at_oom": figures.device_at_oom_bytes}  # what the device held when it ran out


def rank_to_dict(rank: RankEstimate, gpu_memory_bytes: int | None, figures: DeviceFigures | None = None) -> dict[str, Any]:
    """One rank kind: what it holds and its own per-GPU peak, phases and terms (and its figures on the GPU)."""
    data = {
        "kind": rank.kind.label,
        "pp_rank": rank.kind.pp_rank,
        "stages": list(rank.kind.stages),
        "layers": rank.kind.layers,
        "embedding": rank.kind.embedding,
        "head": rank.kind.head,
        "micro_batches_in_flight": rank.kind.in_flight,
        "ranks": rank.ranks,
        "params": rank.params,
        "per_gpu": per_gpu_to_dict(rank.estimate),
        "phases": [phase_to_dict(phase) for phase in rank.estimate.phases],
        "terms": terms_to_list(rank.estimate),
    }
    if figures is not None:
        data["per_gpu"] |= {name: figures_value for name, figures_value in zip(
            ("allocated", "reserved", "device"), (figures.allocated_bytes, figures.reserved_bytes, figures.device_bytes))}
        data["device_memory"] = device_to_dict(figures)
    if gpu_memory_bytes is not None:
        # on the GPU: its allocator ran out of memory or not, on its capacity; else the peak against the memory
        data["fits"] = (figures.fits and figures.device_bytes <= gpu_memory_bytes if figures is not None
                        else data["per_gpu"]["peak"] <= gpu_memory_bytes)
    return data


def single_rank(estimate: Estimate, training: TrainingSpec, layers: int) -> MeshEstimate:
    """An estimate of plain data parallelism as the one rank kind of a mesh of ones."""
    return MeshEstimate(training.mesh, (RankEstimate(RankKind(0, (0,), layers, True, True, 1), training.gpus,
                                                     estimate.model.params, estimate),))


def estimate_to_dict(result: MeshEstimate, training: TrainingSpec, gpu_memory_bytes: int | None = None,
                     notes: Iterable[str] = (), figures: Mapping[str, DeviceFigures] | None = None) -> dict[str, Any]:
    """The JSON contract for one estimate of `training` (see the module docstring): the worst rank kind's
    figures at the top level, every rank kind under `ranks`; `notes` are added to the estimate's own
    (those of the --config file: what the run does that is not modelled); `figures`, each rank kind's on the
    GPU by its label (estimate/device/estimate.py `device_figures`), add allocated, reserved and device bytes,
    and a rank then fits by its device bytes."""
    worst = result.worst
    data = _rank_estimate_to_dict(worst.estimate, training, gpu_memory_bytes, notes)
    data["terms"] = terms_to_list(worst.estimate)
    data["mesh"] = mesh_to_dict(training)
    data["ranks"] = [rank_to_dict(rank, gpu_memory_bytes, (figures or {}).get(rank.kind.label)) for rank in result.ranks]
    data["worst_rank"] = result.ranks.index(worst)
    if figures:
        top = data["ranks"][data["worst_rank"]]
        data["per_gpu"] = dict(top["per_gpu"])
        data["device_memory"] = top["device_memory"]
        if gpu_memory_bytes is not None:  # every rank must fit, not only the one whose tensors peak highest
            data["fits"] = all(rank["fits"] for rank in data["ranks"])
    return data


def _rank_estimate_to_dict(estimate: Estimate, training: TrainingSpec, gpu_memory_bytes: int | None,
                           notes: Iterable[str]) -> dict[str, Any]:
    peak = estimate.peak
    excluded = {name for name in ("lora", "quant") if getattr(training, name) is None}
    if training.engine.value != "fsdp1":
        excluded.add("fsdp1")  # FSDP1's knobs say nothing of another engine's run
    config = training.model_dump(mode="json", exclude=excluded | ({"mesh"} if training.mesh.is_trivial else set()))
    config["gpus_per_node"] = training.node_gpus
    data: dict[str, Any] = {
        "model": {
            "name": estimate.model.name,
            "params": estimate.model.params,
            "trainable_params": estimate.model.trainable_params,
            "implementation": estimate.model.implementation,
        },
        "engine": estimate.engine,
        "per_gpu": per_gpu_to_dict(estimate),
        "phases": [phase_to_dict(phase) for phase in estimate.phases],
        "per_node": per_node_to_dict(estimate.per_node),
        "config": config,
        "program": program_to_dict(training.program) | {"fsdp2": program_to_dict(training.fsdp2_wrapping),
                                                         "optimizer_step": program_to_dict(training_optimizer_step(training)),
                                                         "compile": list(training.compile),
                                                         "float8": training.float8.model_dump() if training.float8 else None}
        | _fsdp1_program(training),
        "notes": [*estimate.notes, *notes],
    }
    if estimate.param_parts is not None:
        data["param_parts"] = {"base": estimate.param_parts.base_bytes, "adapter": estimate.param_parts.adapter_bytes}
    if gpu_memory_bytes is not None:
        data["gpu_memory"] = gpu_memory_bytes
        data["fits"] = peak.total_bytes <= gpu_memory_bytes
    return data


def _fsdp1_program(training: TrainingSpec) -> dict[str, Any]:
    """Engine fsdp1: its settings resolved and torch's name of its sharding strategy (spec/fsdp1.py)."""
    if training.engine.value != "fsdp1":
        return {}
    from zeroplan.spec.fsdp1 import sharding_strategy

    wrapping = training.fsdp1_wrapping
    return {"fsdp1": program_to_dict(wrapping) | {"sharding_strategy": sharding_strategy(training.zero_stage, wrapping.hybrid)}}


def program_to_dict(program: Program | FSDP2Wrapping | OptimizerStep) -> dict[str, Any]:
    """The resolved training program (or FSDP2 wrapping): every knob's value, the recipe's default where none was given."""
    return {name: value.value if hasattr(value, "value") else value for name, value in program._asdict().items()}


def gpu_memory_left_bytes(data: dict[str, Any]) -> int:
    """What an estimate's GPU memory (`data` from `estimate_to_dict` with a GPU memory size) holds beyond its
    device bytes (its peak where it has none); negative when it does not fit, by that much."""
    return data["gpu_memory"] - max(rank["per_gpu"].get("device", rank["per_gpu"]["peak"]) for rank in data["ranks"])


def node_count(config: dict[str, Any]) -> int:
    """The nodes of `config` (the `config` of `estimate_to_dict`: gpus_per_node resolved)."""
    return config["gpus"] // config["gpus_per_node"]


MODEL_COLUMNS = ("name", "params", "family", "layers", "hidden", "heads", "kv_heads", "experts", "vocab", "source")


def model_rows(specs: Iterable[Any]) -> list[dict[str, Any]]:
    """One row per catalogue model: its exact parameter count and shape (None where a model is
    known only by its count), by family, then by size."""
    from zeroplan.estimate.model.layout import param_layout

    rows = []
    for spec in specs:
        if spec.kind == "params":
            rows.append({column: None for column in MODEL_COLUMNS} | {"name": spec.name, "params": spec.params, "source": spec.source})
            continue
        rows.append(
            {
                "name": spec.name,
                "params": param_layout(spec).total_params,
                "family": spec.hf_model_type,
                "layers": spec.num_layers,
                "hidden": spec.hidden_size,
                "heads": spec.num_heads,
                "kv_heads": spec.kv_heads,
                "experts": spec.moe.num_experts if spec.moe else spec.num_experts,
                "vocab": spec.vocab_size,
                "source": spec.source,
            }
        )
    return sorted(rows, key=lambda row: (row["family"] or "", row["params"]))
