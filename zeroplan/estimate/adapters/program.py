"""The adapters in a rank's profile (issue 12): the frozen base as bitsandbytes stores it in place of the
engine's count of it, the Trainer's fp32 adapters under ZeRO-3, and the peak's params split into base and
adapter bytes (modules_to_save copies in the base's dtype are the layout's: ParamTensor.element, which the
torch engine counts). The engine profile counts every
parameter in its own dtype; these terms say what the adapted program holds instead (estimate/adapters/lora.py,
docs/engines/lora.md). `setup` is the rank's: its `gpus` are the ranks that shard (HSDP shards over
dp_shard only)."""

from __future__ import annotations

import zeroplan.estimate.adapters.lora as lora
from zeroplan.estimate.engines.common import EngineEstimate, Setup
from zeroplan.estimate.dtypes import state_bytes
from zeroplan.estimate.model.facts import ModelFacts
from zeroplan.estimate.result import CategoryBytes, ParamParts, Phase, PhaseBytes, Step
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec


def with_adapters(result: EngineEstimate, facts: ModelFacts, model: TransformerSpec, training: TrainingSpec,
                  setup: Setup) -> EngineEstimate:
    """The engine's phases with the base stored as `training.quant` says, the fp32 adapters and the copies."""
    param = state_bytes(training.precision, training.optimizer).param
    delta = lora.base_params_delta(model, training, param, setup.gpus)
    phases = []
    converting = lora.nf4_conversion_moment(model, training)  # torchao's to_nf4 at set-up
    for p in result.phases:
        categories = p.categories._replace(params=max(0, p.categories.params + delta
                                                      + _fp32_adapters(facts, training, param, p.step, setup.gpus)))
        if converting is not None and p.phase == Phase.INIT and p.step == Step.FIRST:
            if converting[0]:  # built whole: the model before conversion, in place of the engine's set-up if larger
                moment = CategoryBytes(params=converting[0], temporaries=converting[1])
                categories = moment if moment.total_bytes > categories.total_bytes else categories
            else:  # built on meta: one full weight converted beside the shards loaded so far
                categories = categories._replace(temporaries=categories.temporaries + converting[1])
        phases.append(PhaseBytes(p.step, p.phase, categories))
    host = lora.base_host_delta(model, training, param, setup.gpus) * training.node_gpus
    per_node = result.per_node
    if host:  # FSDP1's offloaded 4-bit base: its flat shards on the host as stored, pinned on a GPU machine
        per_node = per_node._replace(cpu_bytes=per_node.cpu_bytes + host,
                                     pinned_bytes=per_node.pinned_bytes + (host if per_node.pinned_bytes else 0))
    return result._replace(phases=tuple(phases), per_node=per_node)


def adapter_param_parts(phases: tuple[PhaseBytes, ...], facts: ModelFacts, training: TrainingSpec,
                        setup: Setup) -> ParamParts:
    """The peak's params as the frozen base's bytes and what trains (adapters, DoRA magnitudes, copies)."""
    param = state_bytes(training.precision, training.optimizer).param
    peak = max(phases, key=lambda p: p.total_bytes)
    adapter = min(peak.categories.params, lora.adapter_param_bytes(facts, training, param, peak.step == Step.STEADY,
                                                                   setup.gpus)
                  + _fp32_adapters(facts, training, param, peak.step, setup.gpus))
    return ParamParts(peak.categories.params - adapter, adapter)


def lora_notes(model: TransformerSpec, training: TrainingSpec, facts: ModelFacts) -> tuple[str, ...]:
    return lora.lora_notes(model, training, facts)


def _fp32_adapters(facts: ModelFacts, training: TrainingSpec, param: int, step: Step, shard_ranks: int) -> int:
    """The Trainer's adapters kept fp32 under DeepSpeed ZeRO-3 (estimate/adapters/trainer.py)."""
    import zeroplan.estimate.adapters.trainer as lora_trainer

    if not lora_trainer.adapters_stay_fp32(training):
        return 0
    return lora_trainer.adapter_params_delta(lora.adapter_param_bytes(facts, training, param, step == Step.STEADY,
                                                                      shard_ranks), training)
