"""What a measurement returns: per rank, per step and phase, bytes by category; plain data and JSON.

Phases, in the order a worker runs them (the names the estimate's `Phase` uses, plus the two
set-up phases that together are its `init`):
- `model`: the model built on the device (parameters and module buffers);
- `engine`: the engine wraps it and creates the optimizer (DDP buckets, shards, ...);
  (recipe hf-trainer adds `trainer`, TrainingArguments and Trainer(...), to these step-0 phases);
- `forward`, `backward`: every micro-batch of a step (with gradient accumulation the phase's
  peak is the highest of its micro-batches, its live bytes those after the last one);
- `optimizer_step`: the optimizer step and dropping the gradients.
Categories: params, grads, optimizer_states and buffers are what the engine names
(`EngineRunner.tensors_by_category`; buffers also take what a collective used and what the
engine allocated while wrapping the model); activations are the other tensors born in forward
(saved for backward, the logits and the loss); temporaries are the other tensors born in
backward (the logits' gradient, gradients in flight, activations recomputed by checkpointing)
and in the optimizer step.

Step 1 is the first step (optimizer states are created in it); steps 2 and later are the
steady state. Bytes are ints: exact tensor bytes from the accounting; on CUDA `device` adds the
allocator's own counters (`torch.cuda.memory_stats()`) and NVML's used memory per phase, and
`device_memory` sums them up per rank (the whole run's max_memory_allocated and _reserved, the
retries, the peak inactive split bytes, the OOMs, the most NVML showed). `allocator_replay` is the
rank's allocation stream replayed through the caching allocator model (measure/allocator_replay.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SETUP_PHASES = ("model", "engine")
STEP_PHASES = ("forward", "backward", "optimizer_step")


@dataclass
class PhaseResult:
    """One phase of one step on one rank (step 0 holds the set-up phases)."""

    step: int
    phase: str
    live_bytes: int  # live at the end of the phase
    peak_bytes: int  # highest live bytes during the phase
    categories: dict[str, int]  # at the peak; sums to peak_bytes
    device: dict[str, int] | None = None  # CUDA allocator counters of the phase, None on CPU
    adapter_params_bytes: int | None = None  # of categories["params"]: PEFT adapters (None: a model without them)

    @property
    def stage(self) -> str:
        """`init`, `first` or `steady`: the estimate's `Step` (init phases belong to the first step)."""
        return "init" if self.step == 0 else "first" if self.step == 1 else "steady"


def adapter_split(phase: PhaseResult) -> dict:
    """{"params_split": {"base": B, "adapter": A}} for a model with PEFT adapters, else {} (the JSON
    of other runs stays as it was)."""
    if phase.adapter_params_bytes is None:
        return {}
    params = phase.categories.get("params", 0)
    return {"params_split": {"base": params - phase.adapter_params_bytes, "adapter": phase.adapter_params_bytes}}


def _phase_dict(phase: PhaseResult) -> dict:
    data = asdict(phase) | {"stage": phase.stage}
    if data["adapter_params_bytes"] is None:
        del data["adapter_params_bytes"]
    return data


@dataclass
class RankResult:
    """Everything one rank measured."""

    rank: int
    phases: list[PhaseResult]
    step_times_s: list[float] = field(default_factory=list)  # wall time per step, accounting on (slower than a plain run)
    fits: bool = True  # False: the device ran out of memory (the phases say how far it got)
    oom_message: str | None = None
    classifications: int = 0  # how often the accounting asked the engine for its tensors
    allocator_replay: dict | None = None  # the allocation stream through the allocator model

    def device_memory(self) -> dict | None:
        """The CUDA counters over the whole run (None on CPU): peaks are the highest of the phases'
        (the probe resets them per phase), counters the last phase's (they accumulate)."""
        phases = [p.device for p in self.phases if p.device]
        if not phases:
            return None
        summary = {
            "max_memory_allocated": max(d.get("allocated_peak_bytes", 0) for d in phases),
            "max_memory_reserved": max(d.get("reserved_peak_bytes", 0) for d in phases),
            "inactive_split_peak_bytes": max(d.get("inactive_split_peak_bytes", 0) for d in phases),
            "num_alloc_retries": phases[-1].get("num_alloc_retries", 0),
            "num_ooms": phases[-1].get("num_ooms", 0),
        }
        for key in ("device_used_bytes", "process_used_bytes"):
            seen = [d[key] for d in phases if key in d]
            if seen:
                summary[key] = max(seen)
        return summary

    @property
    def peak(self) -> PhaseResult:
        """The phase with the highest peak; the first one wins a tie."""
        return max(self.phases, key=lambda p: p.peak_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak.peak_bytes

    def peak_of(self, stage: str, phase: str) -> PhaseResult | None:
        """The highest (stage, phase): stage `init`, `first` or `steady` (max over steps >= 2)."""
        matching = [p for p in self.phases if p.stage == stage and p.phase == phase]
        return max(matching, key=lambda p: p.peak_bytes) if matching else None

    def summary(self) -> list[dict]:
        """The phases as the estimate has them (`zeroplan.estimate.result.PhaseBytes`): step
        "first" or "steady", phase "init" (model and engine set-up, first step only),
        "forward", "backward" or "optimizer_step"; the steady state is the highest of steps >= 2."""
        rows = []
        for step in ("first", "steady"):
            for phase in ("init",) + STEP_PHASES:
                if phase == "init":
                    found = [p for p in self.phases if p.step == 0] if step == "first" else []
                else:
                    found = [p for p in self.phases if p.stage == step and p.phase == phase]
                if found:
                    best = max(found, key=lambda p: p.peak_bytes)
                    rows.append({"step": step, "phase": phase, "peak_bytes": best.peak_bytes, "categories": dict(best.categories)}
                                | adapter_split(best))
        return rows

    def to_json_dict(self) -> dict:
        peak = self.peak
        return {
            "rank": self.rank,
            "fits": self.fits,
            "oom_message": self.oom_message,
            "peak": peak.peak_bytes,
            "peak_phase": peak.phase,
            "peak_step": peak.step,
            "peak_stage": peak.stage,
            "categories": dict(peak.categories),
            **adapter_split(peak),
            "phases": [_phase_dict(p) for p in self.phases],
            "summary": self.summary(),
            "step_times_s": list(self.step_times_s),
            "classifications": self.classifications,
        } | ({"device_memory": device} if (device := self.device_memory()) else {}) \
          | ({"allocator_replay": dict(self.allocator_replay)} if self.allocator_replay is not None else {})

    @classmethod
    def from_json_dict(cls, data: dict) -> "RankResult":
        phases = [
            PhaseResult(p["step"], p["phase"], p["live_bytes"], p["peak_bytes"], dict(p["categories"]), p.get("device"),
                        p.get("adapter_params_bytes"))
            for p in data["phases"]
        ]
        return cls(
            rank=data["rank"],
            phases=phases,
            step_times_s=list(data.get("step_times_s", [])),
            fits=data.get("fits", True),
            oom_message=data.get("oom_message"),
            classifications=data.get("classifications", 0),
            allocator_replay=data.get("allocator_replay"),
        )


@dataclass
class MeasureResult:
    """A measurement of one configuration on `world_size` ranks."""

    backend: str  # gloo, nccl or fake
    engine: str
    zero_stage: int
    world_size: int
    implementation: str  # which model code ran, e.g. hf-transformers-5.23.0:LlamaForCausalLM/sdpa
    model: str
    ranks: list[RankResult]  # one per rank that reported (fake: rank 0 stands for every rank)
    steps: int
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    @property
    def peak_bytes(self) -> int:
        """The highest peak of any rank."""
        return max(r.peak_bytes for r in self.ranks)

    def to_json_dict(self) -> dict:
        return {
            "backend": self.backend,
            "engine": self.engine,
            "zero_stage": self.zero_stage,
            "world_size": self.world_size,
            "implementation": self.implementation,
            "model": self.model,
            "device": self.device,
            "steps": self.steps,
            "fits": self.fits,
            "peak": self.peak_bytes,
            "ranks": [r.to_json_dict() for r in self.ranks],
            "notes": list(self.notes),
        }
