"""torchao float8 training as torchtitan applies it (issue 23), for runs on a GPU: float8 matmuls
(torch._scaled_mm) need an sm_89+ GPU, so a CPU run refuses it (spec/training.py) and the rows that check it are
GPU rows (measure/gpu_rows.py). torchtitan's float8 converter (components/quantization/float8.py) swaps the
blocks' nn.Linear for torchao's Float8Linear with `convert_to_float8_training`, leaving the output head alone
(filter_fqns ["output"] in its configs); tensorwise is `Float8LinearConfig(enable_fsdp_float8_all_gather=...)`,
rowwise and rowwise_with_gw_hp `Float8LinearConfig.from_recipe_name`."""

from __future__ import annotations

from torch import nn

from zeroplan.errors import MeasureError, MissingDependencyError
from zeroplan.spec.training import Float8Knobs


def convert_linears(lm: nn.Module, knobs: Float8Knobs, head: nn.Module) -> None:
    """Swap every nn.Linear of `lm` but `head` for a Float8Linear, in place."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        raise MissingDependencyError(f"float8: torchao float8 training needs torchao ({error}); pip install torchao") from None
    if knobs.saved == "float8":
        # torchao 12396c64 (2025-01-13) on: Float8Linear saves its high-precision input and weight
        raise MeasureError("float8.saved: float8 is what torchao of 2024 saved; an installed torchao saves the "
                           "high-precision tensors: use --float8-saved high-precision")
    if knobs.recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=knobs.fsdp_all_gather)
    else:
        config = Float8LinearConfig.from_recipe_name(knobs.recipe)
    convert_to_float8_training(lm, config=config, module_filter_fn=lambda module, fqn: module is not head)
