"""Which kernel steps a run's optimizer: the program's torch optimizer, or DeepSpeed's own.

Under DeepSpeed the optimizer of its JSON steps unless the client passes one (a JSON without an
`optimizer` section: `deepspeed.client_optimizer`). deepspeed 0.19.8 runtime/engine.py
`get_optimizer_configuration` picks DeepSpeedCPUAdam under optimizer offload (ops/adam/cpu_adam.py)
and FusedAdam otherwise (ops/adam/fused_adam.py), both updating in place; with `torch_adam` it is
torch's AdamW, which a CPU run takes (zeroplan measure sets it there: FusedAdam would need a JIT
build), and torch's AdamW on CPU tensors runs its for-loop (optimizer.py `_default_to_fused_or_foreach`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from zeroplan.spec.program import OptimizerImpl

if TYPE_CHECKING:
    from zeroplan.spec.training import TrainingSpec


class OptimizerStep(NamedTuple):
    impl: OptimizerImpl
    via: str | None  # who chose the kernel when it is not the program's torch optimizer


def deepspeed_optimizer_step(*, cpu_run: bool, offload_optimizer: bool, client_optimizer: bool, optimizer: str,
                             program_impl: OptimizerImpl) -> OptimizerStep:
    """The kernel that steps DeepSpeed's fp32 master partition (`optimizer`: adam, adamw or sgd)."""
    # SGD is not among DeepSpeed's config optimizers: zeroplan's runs pass a client torch.optim.SGD
    if client_optimizer or optimizer == "sgd":
        return OptimizerStep(program_impl, None)
    if offload_optimizer or not cpu_run:
        return OptimizerStep(OptimizerImpl.FUSED, None)  # DeepSpeedCPUAdam, FusedAdam: in place
    return OptimizerStep(OptimizerImpl.FOR_LOOP, "DeepSpeed's torch_adam")


def training_optimizer_step(training: "TrainingSpec") -> OptimizerStep:
    """The kernel that steps this run's optimizer: the program's, or under DeepSpeed its own."""
    impl = training.program.optimizer_impl
    if training.engine.value != "deepspeed":
        return OptimizerStep(impl, None)
    return deepspeed_optimizer_step(cpu_run=training.device.value == "cpu",
                                    offload_optimizer=training.offload_optimizer.value != "none",
                                    client_optimizer=training.deepspeed.client_optimizer,
                                    optimizer=training.optimizer.value, program_impl=impl)
