"""torchao float8 training of the blocks' linears (issue 23): what a Float8Linear keeps and allocates beside a
high-precision linear's (torchao/float8/float8_linear.py; derivation: docs/engines/programs.md, "float8").
Derived from the source, not measured: torch._scaled_mm does not run on CPU (the GPU check rows say what
would check it: measure/gpu_rows.py).

Per Float8Linear of `in` inputs and `out` outputs over T tokens (1-byte float8 elements, scales negligible):
- forward (`matmul_with_hp_or_float8_args.forward`): casts its input (T x in) and its weight (out x in; none when
  FSDP2 all-gathered it in float8) before the scaled mm; both freed after it;
- backward: casts the output's gradient twice (T x out: for grad_input and for grad_weight), the weight again
  (out x in, for grad_input; none when all-gathered in float8) and the input (T x in, for grad_weight);
- saved for backward: since torchao 12396c64 (2025-01-13) its high-precision input and weight, as an nn.Linear
  keeps them (nothing changes); before (`manual_float8_matmul_with_args_in_float8`, the tensorwise path of the
  published December-2024 runs) the float8 casts: each linear keeps its own 1-byte copy of its input, where
  the high-precision linears reading one tensor (q, k, v; gate, up) keep that tensor once.
"""

from __future__ import annotations

from zeroplan.estimate.dtypes import FLOAT8_BYTES
from zeroplan.estimate.terms import register, relabel
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import Checkpointing, TrainingSpec

_SOURCE = "torchao/float8/float8_linear.py matmul_with_hp_or_float8_args (docs/engines/programs.md, float8)"
register({
    "float8 casts of a linear's input and weight (forward)": _SOURCE,
    "float8 casts of a linear's gradient, weight and input (backward)": _SOURCE,
    "float8 copies of the linears' inputs (saved)": "torchao eab345c float8_linear.py "
                                                    "manual_float8_matmul_with_args_in_float8 (docs/engines/programs.md, float8)",
})


def _linears(spec: TransformerSpec) -> list[tuple[int, int]]:
    """(in, out) of a Llama-family block's linears: q, k, v, o, gate, up, down."""
    h, inner = spec.hidden_size, spec.intermediate_size
    q_width = spec.num_heads * spec.dim_per_head
    kv_width = spec.kv_heads * spec.dim_per_head
    mlp = [(h, inner), (h, inner), (inner, h)] if spec.mlp == "gated" else [(h, inner), (inner, h)]
    return [(h, q_width), (h, kv_width), (h, kv_width), (q_width, h)] + mlp


def float8_changes(acts, spec: TransformerSpec, training: TrainingSpec, act_bytes: int) -> dict[str, int]:
    """The ActivationBytes fields float8 training changes (`training.float8`), for `acts` of one micro-batch."""
    knobs = training.float8
    tokens = training.micro_batch * training.seq_len
    weights = 0 if knobs.fsdp_all_gather else 1  # the weight's own cast, unless it arrived in float8
    linears = _linears(spec)
    forward = max(tokens * n_in + weights * n_in * n_out for n_in, n_out in linears) * FLOAT8_BYTES
    backward = max(2 * tokens * n_out + weights * n_in * n_out + tokens * n_in for n_in, n_out in linears) * FLOAT8_BYTES
    changes = dict(
        block_forward_transient=acts.block_forward_transient + relabel(
            "float8 casts of a linear's input and weight (forward)", forward),
        block_backward_transient=acts.block_backward_transient + relabel(
            "float8 casts of a linear's gradient, weight and input (backward)", backward),
    )
    if knobs.saved == "float8" and training.checkpointing == Checkpointing.NONE:
        # (under full checkpointing a block keeps its input alone; under per-op checkpointing the policy's outputs,
        # whatever the linears would save: docs/engines/programs.md)
        # every linear keeps its own 1-byte input; the high-precision tensors the linears alone kept go: the two
        # norms' outputs, the attention output as o_proj reads it, and the MLP's product (down_proj's input)
        h, inner = spec.hidden_size, spec.intermediate_size
        q_width = spec.num_heads * spec.dim_per_head
        copies = tokens * sum(n_in for n_in, _ in linears) * FLOAT8_BYTES
        dropped = tokens * act_bytes * (2 * h + q_width + inner)
        changes["saved_per_block"] = acts.saved_per_block + relabel("float8 copies of the linears' inputs (saved)",
                                                                    copies) - dropped
    return changes
