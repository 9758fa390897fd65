"""Checked reading of single values out of engine config files, shared by the DeepSpeed JSON and
ColossalAI-style readers. Every failure is a one-line `SpecError` that names the file and the key.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping

from zeroplan.errors import SpecError
from zeroplan.spec.limits import MAX_COUNT
from zeroplan.spec.validation import shown

# HF-Trainer DeepSpeed configs put "auto" where the Trainer fills in a value; DeepSpeed itself drops
# "auto" entries before validating (deepspeed/runtime/config_utils.py, DeepSpeedConfigModel.__init__,
# non-strict mode). We do the same: "auto" means "not set here, use the default".
AUTO = "auto"

# `where(field)` returns the prefix of an error message: "ds.json" or "zero.py:7".
Where = Callable[[str], str]

OFFLOAD_DEVICES = ("none", "cpu", "nvme")  # deepspeed/runtime/zero/offload_config.py, OffloadDeviceEnum

# Every key DeepSpeed 0.19.8 accepts in the offload sections; the models forbid extra keys
# (DeepSpeedConfigModel: extra="forbid"), so anything else is a typo that DeepSpeed would reject.
# deepspeed/runtime/zero/offload_config.py, DeepSpeedZeroOffloadOptimizerConfig / ...ParamConfig.
OFFLOAD_OPTIMIZER_KEYS = frozenset(
    {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write", "fast_init",
     "ratio", "super_offload", "cpuadam_cores_perc"}
)
OFFLOAD_PARAM_KEYS = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})


def fail(where: Where, field: str, problem: str) -> SpecError:
    return SpecError(f"{where(field)}: {field} {problem}")


def is_auto(value: object) -> bool:
    return isinstance(value, str) and value == AUTO


def as_int(value: object, field: str, where: Where, minimum: int = 0, maximum: int = MAX_COUNT) -> int:
    """A count. JSON writes 5e8 as a float: accept floats with no fractional part, reject the rest. No count in
    a config is more than MAX_COUNT (spec/limits.py): a 400-digit number is a typo, named here by its key."""
    if isinstance(value, bool):
        raise fail(where, field, f"must be a whole number, got {shown(value)}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise fail(where, field, f"must be a whole number, got {shown(value)}")
        value = int(value)
    if not isinstance(value, int):
        raise fail(where, field, f"must be a whole number, got {shown(value)}")
    if value < minimum:
        raise fail(where, field, f"must be >= {minimum}, got {shown(value)}")
    if value > maximum:
        raise fail(where, field, f"must be at most {maximum:,}, got {shown(value)}")
    return value


def as_bool(value: object, field: str, where: Where) -> bool:
    # DeepSpeed's pydantic models would also coerce "true" and 0/1; a config that relies on that is
    # unusual enough that we ask for a real boolean rather than guess.
    if not isinstance(value, bool):
        raise fail(where, field, f"must be true or false, got {value!r}")
    return value


def as_section(value: object, field: str, where: Where) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise fail(where, field, f"must be a mapping of options, got {value!r}")
    for key in value:
        if not isinstance(key, str):
            raise fail(where, field, f"has a non-string key {key!r}")
    return value


def check_keys(section: Mapping[str, object], known: Iterable[str], field: str, where: Where, engine: str) -> None:
    """Reject keys the engine itself would reject, with a did-you-mean hint."""
    known = sorted(set(known))
    for key in section:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise fail(where, f"{field}.{key}", f"is not a {engine} option{hint}")


def pick(section: Mapping[str, object], names: tuple[str, ...], field: str, where: Where) -> tuple[str, object] | None:
    """The one value given under any of a field's names (DeepSpeed accepts a field by name or alias:
    populate_by_name=True in DeepSpeedConfigModel). "auto" counts as not given."""
    given = [(name, section[name]) for name in names if name in section and not is_auto(section[name])]
    if len(given) > 1:
        raise fail(where, f"{field}.{given[0][0]}", f"is given twice (also as {given[1][0]}); keep one")
    return given[0] if given else None


def read_offload(
    value: object, field: str, where: Where, engine: str, *, param: bool
) -> tuple[str | None, bool | None, dict[str, int]]:
    """(device, pin_memory, knobs) of one DeepSpeed-style offload section; None where not given.

    Knobs are the `DeepSpeedKnobs` fields of parameter offload: offload_buffer_count, offload_buffer_size,
    offload_max_in_cpu. Minimums are DeepSpeed's (offload_config.py: ge=0).
    """
    if value is None:  # DeepSpeed: Optional[...] = None, i.e. no offload
        return None, None, {}
    section = as_section(value, field, where)
    keys = OFFLOAD_PARAM_KEYS if param else OFFLOAD_OPTIMIZER_KEYS
    check_keys(section, keys, field, where, engine)
    device = None
    if "device" in section and not is_auto(section["device"]):
        device = section["device"]
        if device not in OFFLOAD_DEVICES:
            raise fail(where, f"{field}.device", f"must be one of {', '.join(OFFLOAD_DEVICES)}, got {device!r}")
    pin = None
    if "pin_memory" in section and not is_auto(section["pin_memory"]):
        pin = as_bool(section["pin_memory"], f"{field}.pin_memory", where)
    knobs: dict[str, int] = {}
    if param:
        for key, knob in (("buffer_count", "offload_buffer_count"), ("buffer_size", "offload_buffer_size"),
                          ("max_in_cpu", "offload_max_in_cpu")):
            if key in section and not is_auto(section[key]):
                knobs[knob] = as_int(section[key], f"{field}.{key}", where)
    return device, pin, knobs


def check_nvme_path(value: object, field: str, where: Where) -> None:
    """An offload section with device nvme names the folder it swaps to: DeepSpeed's swappers join their files
    under nvme_path (runtime/swap_tensor/partitioned_param_swapper.py and optimizer_utils.py: os.path.join(
    nvme_path, ...)), which fails when it is missing. Call it where the engine swaps (ZeRO-3)."""
    if isinstance(value, Mapping) and value.get("device") == "nvme" and value.get("nvme_path") in (None, "", "none"):
        raise fail(where, f"{field}.nvme_path", "is missing, and device nvme needs it: the folder on the NVMe drive "
                   "DeepSpeed swaps to (e.g. \"/local_nvme\")")


def merge_pin_memory(pins: list[tuple[str, str | None, bool | None]], where: Where) -> bool | None:
    """zeroplan keeps one offload_pin_memory for both offload sections. Sections that really offload
    decide; if none does, any section that states a value does. Two different values is an error."""
    active = [(field, pin) for field, device, pin in pins if pin is not None and device not in (None, "none")]
    stated = active or [(field, pin) for field, _device, pin in pins if pin is not None]
    values = {pin for _field, pin in stated}
    if len(values) > 1:
        (first, a), (second, b) = stated[0], stated[1]
        raise fail(where, f"{first}.pin_memory",
                   f"is {str(a).lower()} but {second}.pin_memory is {str(b).lower()}; zeroplan models one "
                   "pin_memory for both offloads: make them equal")
    return values.pop() if values else None
