"""Engine config files <-> zeroplan training settings.

`read_training_config(path)` returns a *partial* mapping of `TrainingSpec` field names to plain values
(strings, ints, bools, and a partial "deepspeed" dict of `DeepSpeedKnobs` fields). The caller merges it
with its own options (explicit options win) and validates the result with `TrainingSpec`.
The format is chosen by suffix: `.json` is a DeepSpeed config, `.py` a ColossalAI-style config.

The writers go the other way: `write_deepspeed_config` (a DeepSpeed config dict) and
`write_fsdp2_snippet` (Python source using fully_shard).
"""

from __future__ import annotations

from pathlib import Path

from zeroplan.importers.colossalai_py import load_python_config, settings_from_colossalai
from zeroplan.importers.deepspeed_json import load_json, settings_from_deepspeed, write_deepspeed_config
from zeroplan.importers.fsdp2_snippet import write_fsdp2_snippet
from zeroplan.errors import SpecError

__all__ = ["read_training_config", "write_deepspeed_config", "write_fsdp2_snippet"]


def read_training_config(path: str | Path, *, gpus: int | None = None,
                         hidden_size: int | None = None) -> dict[str, object]:
    """Training settings found in an engine config file.

    `gpus` is the data-parallel world size if the caller knows it. DeepSpeed needs it to split a
    `train_batch_size` given without both `train_micro_batch_size_per_gpu` and
    `gradient_accumulation_steps`; when all three are given and `gpus` is None, the world size they
    imply is returned as "gpus". `hidden_size` is the model's, from which the Hugging Face Trainer
    fills some "auto" values of a DeepSpeed config (None: the model has none, and such an "auto"
    is an error).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        config = load_json(path)
        return settings_from_deepspeed(config, lambda _field: str(path), gpus, hidden_size)
    if suffix == ".py":
        names, source = load_python_config(path)
        return settings_from_colossalai(names, source)
    raise SpecError(f"{path}: unknown config format {suffix or '(no suffix)'!r}: use a DeepSpeed .json "
                    "or a ColossalAI-style .py file")
