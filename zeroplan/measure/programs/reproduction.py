"""What `zeroplan measure --recipe torchtitan|torchtune` runs, and the name its result gives it.

Neither program itself is run (docs/measure.md, "torchtitan and torchtune"): torchtitan 0.3.0
trains on a CPU only with six patches, the attention kernel swapped among them; torchtune 0.6.1
runs on a CPU as shipped but needs torchao 0.15 beside torch 2.13, and its recipes own their
loops. zeroplan's loop reproduces each from its source instead: every knob of
`TrainingSpec.program` (model init, gradient sync, optimizer kernel, optimizer in backward, loss,
DDP or not) resolved from the recipe's defaults, checkpointing and precision from the spec.
"""

from __future__ import annotations

from zeroplan.spec.program import GradSync, Loss
from zeroplan.spec.training import Checkpointing, Precision, TrainingSpec

REPRODUCED = {"torchtitan": "torchtitan 0.3.0", "torchtune": "torchtune 0.6.1"}
"""The recipes measure reproduces in its own loop, and the program version each follows."""


def _checkpointing(training: TrainingSpec) -> str | None:
    if training.checkpointing == Checkpointing.NONE:
        return None
    if training.checkpoint_every:
        return f"full checkpointing of one block in {training.checkpoint_every}"
    return f"{training.checkpointing.value} checkpointing"


def _loss(training: TrainingSpec) -> str:
    program = training.program
    if program.loss != Loss.CHUNKED:
        return f"{program.loss.value} loss"
    flow = "ChunkedLossWrapper" if program.recipe.value == "torchtitan" else "CEWithChunkedOutputLoss"
    return f"chunked loss ({flow}, {program.loss_chunks} chunks)"


def reproduction_name(training: TrainingSpec, model_implementation: str) -> str:
    """The `implementation` of a reproduced recipe's result: which program, the knobs the loop ran,
    and the model code, e.g. "zeroplan loop reproducing torchtitan 0.3.0 (model init meta, op
    checkpointing, chunked loss (ChunkedLossWrapper, 8 chunks), reduce every micro-batch, fused
    AdamW) on hf-transformers-5.23.0:LlamaForCausalLM/sdpa"."""
    program = training.program
    parts = [f"model init {program.model_init.value}", _checkpointing(training), _loss(training)]
    if training.grad_accum > 1:
        parts.append("reduce every micro-batch" if program.grad_sync == GradSync.EVERY else "reduce the last micro-batch")
    parts.append(f"{program.optimizer_impl.value} AdamW" + (" in backward" if program.optimizer_in_backward else ""))
    if program.ddp:
        parts.append("DDP")
    if training.precision == Precision.PURE_BF16:
        parts.append("pure bf16")
    knobs = ", ".join(part for part in parts if part)
    return f"zeroplan loop reproducing {REPRODUCED[program.recipe.value]} ({knobs}) on {model_implementation}"
