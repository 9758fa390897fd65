"""A checkpoint's `quantization_config` (config.json) as the frozen base's storage (issue 23): what
`from_pretrained` loads, for the methods zeroplan models, as `TrainingSpec.quant` settings; the others read,
named and estimated in their dequantized dtype, in one line each.

transformers 5.23.0 quantizers/:
- bitsandbytes (`quantizer_bnb_4bit.py`, `quantizer_bnb_8bit.py`): the layers load as Linear4bit / Linear8bitLt,
  trainable through adapters (`is_trainable`): load_in_4bit with bnb_4bit_quant_type nf4/fp4,
  bnb_4bit_use_double_quant, bnb_4bit_compute_dtype, bnb_4bit_quant_storage; load_in_8bit -> int8;
- gptq (`quantizer_gptq.py`, gptqmodel's QuantLinear) and awq (`quantizer_awq.py`, trainable with gptqmodel >= 5):
  packed int32 weights with per-group fp16 scales and zeros; PEFT adapts them (peft tuners/lora/gptq.py, awq.py);
- fp8 (`quantizer_finegrained_fp8.py`, DeepSeek-V3's and others' e4m3 blocks): `validate_environment`
  dequantizes to bf16 without a GPU and on GPUs below compute capability 8.9; on 8.9 and later the layers
  are FP8Linear, not modelled: estimated as the bf16 it dequantizes to;
- anything else (torchao, compressed-tensors, ...): read, not modelled, estimated in the checkpoint's dtype.
Each says so in one note of the estimate (`checkpoint_quant_note`, through importers/hf_config.py's notes).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from zeroplan.errors import SpecError

_DTYPE = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "float16": "fp16", "torch.float16": "fp16",
          "float32": "fp32", "torch.float32": "fp32", "uint8": "uint8", "torch.uint8": "uint8"}


def quant_from_checkpoint(config: Mapping[str, Any], where: str = "config.json") -> dict[str, Any] | None:
    """The `quant` settings of a config.json's quantization_config (None without one); a method estimated in the
    dtype it dequantizes to is that dtype (the estimate's note says so: `checkpoint_quant_note`); a SpecError for a
    value that cannot be read."""
    section = config.get("quantization_config")
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise SpecError(f"{where}: quantization_config: expected an object, got {type(section).__name__}")
    method = str(section.get("quant_method", "bitsandbytes" if "load_in_4bit" in section else "")).lower()
    dtype = _dtype(config.get("dtype", config.get("torch_dtype")), "bf16")
    if method == "bitsandbytes":
        return _bitsandbytes(section, where, dtype)
    if method in ("gptq", "awq"):
        return _packed_int(section, method, where, dtype)
    if method == "fp8":
        return {"base_precision": "bf16"}  # what transformers dequantizes it to (`checkpoint_quant_note`)
    return {"base_precision": dtype if dtype in ("bf16", "fp16", "fp32") else "bf16"}


def checkpoint_quant_note(config: Mapping[str, Any]) -> str:
    """The estimate's note on a config.json's quantization_config (importers/hf_config.py `_notes`): what the base is
    counted as, or which method is read but not modelled and what is estimated instead."""
    section = config["quantization_config"]
    method = str(section.get("quant_method", "bitsandbytes" if "load_in_4bit" in section else "unknown method")).lower()
    bits = section.get("bits") or (4 if section.get("load_in_4bit") else 8 if section.get("load_in_8bit") else None)
    what = method + (f", {bits}-bit" if bits else "")
    if method in ("bitsandbytes", "gptq", "awq"):
        precision = (str(section.get("bnb_4bit_quant_type", "fp4")) if bits == 4 else "int8") \
            if method == "bitsandbytes" else method
        return (f"quantization_config ({what}): with adapters (--lora-rank R) the frozen base is counted as the "
                f"checkpoint stores it (--base-precision {precision}); without them it cannot train")
    if method == "fp8":
        return (f"quantization_config ({what}, {section.get('fmt', 'e4m3')} blocks {section.get('weight_block_size')}) "
                "is read but not modelled as FP8Linear: transformers dequantizes it to bf16 without a GPU and below "
                "compute capability 8.9 (quantizer_finegrained_fp8.py), and so it is estimated")
    dtype = _dtype(config.get("dtype", config.get("torch_dtype")), "bf16")
    return f"quantization_config ({what}) is read but not modelled: estimated as {dtype} weights"


def _dtype(value: Any, default: str) -> str:
    return _DTYPE.get(str(value), default) if value is not None else default


def _bitsandbytes(section: Mapping[str, Any], where: str, dtype: str) -> dict[str, Any]:
    if section.get("load_in_8bit"):
        return {"base_precision": "int8", "compute_dtype": dtype}
    if not section.get("load_in_4bit"):
        raise SpecError(f"{where}: quantization_config: bitsandbytes without load_in_4bit or load_in_8bit")
    kind = str(section.get("bnb_4bit_quant_type", "fp4"))  # BitsAndBytesConfig's default
    if kind not in ("nf4", "fp4"):
        raise SpecError(f"{where}: quantization_config.bnb_4bit_quant_type: {kind!r} is not nf4 or fp4")
    return {"base_precision": kind, "double_quant": bool(section.get("bnb_4bit_use_double_quant", False)),
            "compute_dtype": _dtype(section.get("bnb_4bit_compute_dtype"), "fp32"),  # BitsAndBytesConfig: float32
            "quant_storage": _dtype(section.get("bnb_4bit_quant_storage"), "uint8")}


def _packed_int(section: Mapping[str, Any], method: str, where: str, dtype: str) -> dict[str, Any]:
    bits, group = section.get("bits", section.get("w_bit", 4)), section.get("group_size", section.get("q_group_size", 128))
    if not isinstance(bits, int) or not isinstance(group, int):
        raise SpecError(f"{where}: quantization_config: bits and group_size must be integers (got {bits!r}, {group!r})")
    return {"base_precision": method, "bits": bits, "group_size": group, "compute_dtype": dtype}


@lru_cache(maxsize=32)  # keyed by the file's stat too: a rewritten file is read again
def _read(path: str, stamp: tuple[int, int]) -> dict[str, Any] | None:
    import json  # here, not at start-up: only a model read from a config.json has one to read

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_quant(model: Any) -> dict[str, Any] | None:
    """`quant_from_checkpoint` of the config.json a model spec was read from (its `source`), if any."""
    source = getattr(model, "source", None)
    if not source or not str(source).endswith(".json") or not Path(source).is_file():
        return None
    stat = Path(source).stat()
    data = _read(str(source), (stat.st_mtime_ns, stat.st_size))
    return quant_from_checkpoint(data, str(source)) if data is not None else None
