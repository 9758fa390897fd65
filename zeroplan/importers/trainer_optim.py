"""`--optim NAME`: the Hugging Face Trainer's optimizer names (TrainingArguments.optim) as zeroplan's knobs.

transformers 5.23.0 training_args.py `OptimizerNames`, trainer_optimizer.py: `adamw_torch` is torch's AdamW
with its kernel left to torch (foreach on CUDA tensors, the for-loop on CPU ones: torch/optim/optimizer.py
`_default_to_fused_or_foreach`), `adamw_torch_fused` the fused one; the bitsandbytes names build
`bitsandbytes.optim.AdamW` with `optim_bits = 8 if "8bit" in name else 32` and `is_paged = "paged" in name`
(`_get_bitsandbytes_optimizer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zeroplan.errors import SpecError

# name -> (optimizer, paged_optimizer, optimizer_impl or None: bitsandbytes runs its own update)
TRAINER_OPTIMIZERS: dict[str, tuple[str, bool, str | None]] = {
    "adamw_torch": ("adamw", False, "torch-default"),
    "adamw_torch_fused": ("adamw", False, "fused"),
    "adamw_bnb_8bit": ("adam8bit", False, None),
    "adamw_8bit": ("adam8bit", False, None),  # "just an alias for adamw_bnb_8bit"
    "paged_adamw_8bit": ("adam8bit", True, None),
    "paged_adamw_32bit": ("adam32bit", True, None),
}
_SET = {"optimizer": "--optimizer", "paged_optimizer": "--paged-optimizer", "optimizer_impl": "--optimizer-impl"}


def optim_values(options: Mapping[str, Any]) -> dict[str, Any]:
    """The TrainingSpec fields `--optim` sets (none when it is not given); a SpecError for an unknown name
    or one given with the options it sets."""
    name = options.get("optim")
    if name is None:
        return {}
    key = str(name).strip().lower()
    if key not in TRAINER_OPTIMIZERS:
        raise SpecError(f"--optim: {name!r} is not one of the TrainingArguments.optim names zeroplan models: "
                        f"{', '.join(TRAINER_OPTIMIZERS)}")
    clash = [flag for field, flag in _SET.items() if options.get(field) is not None]
    if clash:
        raise SpecError(f"--optim {key} sets {clash[0]} too: give one of them")
    optimizer, paged, impl = TRAINER_OPTIMIZERS[key]
    values: dict[str, Any] = {"optimizer": optimizer, "paged_optimizer": paged}
    if impl == "torch-default":
        values["optimizer_impl"] = "for-loop" if options.get("device") == "cpu" else "foreach"
    elif impl is not None:
        values["optimizer_impl"] = impl
    return values
