"""The ZeRO paper's idealised accounting, nothing else (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", section 5 and Table 1):

    stage 0: (2 + 2 + K) Ψ          stage 1: 2Ψ + 2Ψ + KΨ/N_d
    stage 2: 2Ψ + (2 + K)Ψ/N_d       stage 3: (2 + 2 + K)Ψ/N_d

with K = 12 for mixed-precision Adam. Other precisions and optimizers change the 2, 2 and K
(zeroplan.estimate.dtypes). Offload (ZeRO-Offload, Ren et al. 2021, section 4; ZeRO-Infinity,
Rajbhandari et al. 2021, section 5) moves the optimizer's KΨ/N_d (and at stage 2 the gradient
partition it reads) or the parameter partition to the host or NVMe.
"""

from __future__ import annotations

from zeroplan.estimate.dtypes import StateBytes
from zeroplan.estimate.engines.common import EngineEstimate, Setup, phase
from zeroplan.estimate.model.facts import ModelFacts
from zeroplan.estimate.result import NodeBytes, Phase, Step
from zeroplan.estimate.terms import named, register
from zeroplan.spec.training import Offload

register({
    "parameters (ZeRO paper)": "Rajbhandari et al. 2020 section 5, Table 1 (2Psi, /N_d at stage 3)",
    "gradients (ZeRO paper)": "Rajbhandari et al. 2020 section 5, Table 1 (2Psi, /N_d from stage 2)",
    "optimizer states (ZeRO paper)": "Rajbhandari et al. 2020 section 5, Table 1 (K Psi, /N_d from stage 1)",
})


def estimate_paper(facts: ModelFacts, setup: Setup, dtypes: StateBytes) -> EngineEstimate:
    n = setup.gpus
    psi, trainable = facts.total_params, facts.trainable_params
    stage = setup.zero_stage
    params = psi * dtypes.param / (n if stage >= 3 else 1)
    grads = trainable * dtypes.grad / (n if stage >= 2 else 1)
    states = trainable * dtypes.k / (n if stage >= 1 else 1)
    host = nvme = 0.0
    if setup.offload_optimizer != Offload.NONE:
        moved = states + (grads if stage >= 2 else 0)
        if setup.offload_optimizer == Offload.CPU:
            host += moved
        else:
            nvme += moved
        states = 0
        grads = grads if stage < 2 else 0
    if setup.offload_params != Offload.NONE:
        if setup.offload_params == Offload.CPU:
            host += params
        else:
            nvme += params
        params = 0
    gpus_per_node = setup.node_gpus
    only = phase(Step.STEADY, Phase.OPTIMIZER_STEP, params=named("parameters (ZeRO paper)", int(params)),
                 grads=named("gradients (ZeRO paper)", int(grads)),
                 optimizer_states=named("optimizer states (ZeRO paper)", int(states)))
    per_node = NodeBytes(cpu_bytes=int(host * gpus_per_node), pinned_bytes=0, nvme_bytes=int(nvme * gpus_per_node))
    note = "paper engine: model states only (ZeRO paper Table 1 accounting); no activations, buffers or overhead"
    return EngineEstimate((only,), per_node, (note,))
