"""Trainer config files <-> zeroplan training settings.

`load_training_config(path)` recognises the format from the content (never running it) and returns a
`TrainingConfig`: the catalogue model the file names, if any, notes on what the run does that zeroplan
does not model, and `settings(gpus, hidden_size)`, a *partial* mapping of `TrainingSpec` field names
to plain values that the caller merges with its own options (explicit options win) and validates
with `TrainingSpec`. The formats:
- a DeepSpeed JSON (or hjson) config: `{` first, or a .json name;
- a ColossalAI-style Python config: a .py name, or Python assignments that no other reader takes;
- a torchtitan job TOML (v0.2.2 and the 2024 schema of its published benchmarks): [model]/[training] tables;
- a torchtune recipe YAML: `model: {_component_: torchtune.models...}`;
- an accelerate config YAML: `distributed_type`.
A .toml or .yaml/.yml name decides how a file that does not parse is reported (with its line).

The writers go the other way: `write_deepspeed_config` (a DeepSpeed config dict) and
`write_fsdp2_snippet` (Python source using fully_shard).
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

from zeroplan.errors import SpecError, ZeroplanWarning
from zeroplan.importers.files import check_nesting, read_text

# Each format's reader is imported when a file of that format is read (a torchtitan TOML read back after
# `plan --emit` needs none of the others); the writers when first asked for (`__getattr__`).
__all__ = ["TrainingConfig", "load_training_config", "read_training_config", "write_deepspeed_config",
           "write_fsdp2_snippet"]


def __getattr__(name: str):
    if name == "write_deepspeed_config":
        from zeroplan.importers.deepspeed_json import write_deepspeed_config

        return write_deepspeed_config
    if name == "write_fsdp2_snippet":
        from zeroplan.importers.fsdp2_snippet import write_fsdp2_snippet

        return write_fsdp2_snippet
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# (gpus, hidden_size) -> partial TrainingSpec mapping.
Settings = Callable[[int | None, int | None], dict[str, object]]

_TOML_TABLE = re.compile(r"^\s*\[[\w.\" -]+\]\s*(#.*)?$", re.MULTILINE)  # a [table] header line
_YAML_KEY = re.compile(r"^[\w.-]+\s*:(\s|$)", re.MULTILINE)  # a top-level `key:` line
_FORMATS = "a DeepSpeed JSON, a ColossalAI-style .py, a torchtitan TOML, a torchtune or an accelerate YAML"


class TrainingConfig(NamedTuple):
    """One trainer config file, read and checked."""

    path: Path
    kind: str  # "DeepSpeed JSON", "ColossalAI Python", "torchtitan TOML", "torchtune YAML", "accelerate YAML"
    model: str | None  # the catalogue model the file names (torchtitan, torchtune), else None
    notes: tuple[str, ...]  # what the run does that the estimate does not model
    read: Settings
    warnings: list[str]  # keys the program ignores, held back until the settings validate (see `warn`)

    def settings(self, gpus: int | None = None, hidden_size: int | None = None) -> dict[str, object]:
        """The training settings for `gpus` (the caller's --gpus) and the model's `hidden_size` (from which
        the Hugging Face Trainer fills some "auto" values of a DeepSpeed config; None: unknown)."""
        return self.read(gpus, hidden_size)

    def warn(self) -> None:
        """Issue the held-back warnings, once: a bad input stays one line, with no warning before it."""
        while self.warnings:
            warnings.warn(self.warnings.pop(0), ZeroplanWarning, stacklevel=2)


def load_training_config(path: str | Path) -> TrainingConfig:
    """The config in `path`, its format recognised from its content. Its warnings are held in the record
    until `TrainingConfig.warn`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ZeroplanWarning)
        config = _load(Path(path))
    for item in caught:
        if issubclass(item.category, ZeroplanWarning):
            config.warnings.append(str(item.message))
        else:
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)
    return config


def _load(path: Path) -> TrainingConfig:
    suffix = path.suffix.lower()
    where = str(path)

    def at(_field: str) -> str:
        return where

    if suffix == ".py":
        return _colossalai(path)
    text = None if suffix == ".json" else read_text(path, "config file")
    if text is None or text.lstrip().startswith(("{", "//", "/*")):
        from zeroplan.importers.deepspeed_json import load_json, settings_from_deepspeed

        config = load_json(path)
        return TrainingConfig(path, "DeepSpeed JSON", None, (),
                              lambda gpus, hidden: settings_from_deepspeed(config, at, gpus, hidden), [])
    if not text.strip():
        raise SpecError(f"{where}: is empty; expected {_FORMATS}")
    parsed = _toml_or_yaml(text, suffix, where)
    if parsed is None:
        if _is_python(text):
            return _colossalai(path)
        raise SpecError(f"{where}: unknown config format: expected {_FORMATS}")
    return _recognise(*parsed, text, path, at)


def read_training_config(path: str | Path, *, gpus: int | None = None,
                         hidden_size: int | None = None) -> dict[str, object]:
    """Training settings found in a trainer config file (see `TrainingConfig.settings`).

    `gpus` is the data-parallel world size if the caller knows it. DeepSpeed needs it to split a
    `train_batch_size` given without both `train_micro_batch_size_per_gpu` and
    `gradient_accumulation_steps`; when all three are given and `gpus` is None, the world size they
    imply is returned as "gpus".
    """
    config = load_training_config(path)
    settings = config.settings(gpus, hidden_size)
    config.warn()
    return settings


def _colossalai(path: Path) -> TrainingConfig:
    from zeroplan.importers.colossalai_py import load_python_config, settings_from_colossalai

    names, source = load_python_config(path)
    settings = settings_from_colossalai(names, source)
    return TrainingConfig(path, "ColossalAI Python", None, (), lambda _gpus, _hidden: dict(settings), [])


def _toml_or_yaml(text: str, suffix: str, where: str) -> tuple[Mapping[str, object], bool] | None:
    """(the mapping the text holds, whether it was TOML), or None if it is neither TOML nor YAML; a file
    named, or shaped, as one of them that does not parse is that format's one-line error, with the line."""
    from zeroplan.importers.documents import parse_toml, parse_yaml

    toml_shaped = suffix == ".toml" or (suffix not in (".yaml", ".yml") and _TOML_TABLE.search(text) is not None)
    if toml_shaped:
        return parse_toml(text, where), True
    yaml_shaped = suffix in (".yaml", ".yml") or _YAML_KEY.search(text) is not None
    if not yaml_shaped:
        return None
    if suffix not in (".yaml", ".yml") and _is_python(text):
        return None
    check_nesting(text, where)  # PyYAML's parser takes seconds over a few thousand nested [
    document = parse_yaml(text, where)
    if not isinstance(document, dict):
        if suffix in (".yaml", ".yml"):
            raise SpecError(f"{where}: a trainer config is a YAML mapping of keys, got {type(document).__name__}")
        return None
    return document, False


def _is_python(text: str) -> bool:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    # `key: value` lines are annotations to Python: a config of Python assignments has `=`.
    return any(isinstance(node, ast.Assign) for node in tree.body)


def _recognise(document: Mapping[str, object], is_toml: bool, text: str, path: Path,
               at: Callable[[str], str]) -> TrainingConfig:
    for key in document:
        if not isinstance(key, str):
            raise SpecError(f"{path}: has a key that is not a name: {key!r}")
    if is_toml:
        from zeroplan.importers import torchtitan_toml

        if not torchtitan_toml.is_torchtitan(document):
            raise SpecError(f"{path}: unknown config format: a TOML file without torchtitan's [model] or [training] table")
        notes = torchtitan_toml.check_torchtitan(document, at)
        model = torchtitan_toml.model_from_torchtitan(document, at)
        return TrainingConfig(path, "torchtitan TOML", model, notes,
                              lambda gpus, _hidden: torchtitan_toml.settings_from_torchtitan(document, at, gpus), [])
    from zeroplan.importers import accelerate_yaml, torchtune_yaml
    from zeroplan.importers.deepspeed_json import settings_from_deepspeed

    if torchtune_yaml.is_torchtune(document):
        notes = torchtune_yaml.check_torchtune(document, text, at)
        model = torchtune_yaml.model_from_torchtune(document, at)
        return TrainingConfig(path, "torchtune YAML", model, notes,
                              lambda gpus, _hidden: torchtune_yaml.settings_from_torchtune(document, text, at, gpus), [])
    if accelerate_yaml.is_accelerate(document):
        notes = accelerate_yaml.check_accelerate(document, at)
        return TrainingConfig(path, "accelerate YAML", None, notes,
                              lambda gpus, hidden: accelerate_yaml.settings_from_accelerate(
                                  document, at, path.parent, gpus, hidden), [])
    if "zero_optimization" in document or "train_micro_batch_size_per_gpu" in document:  # a DeepSpeed config in YAML
        return TrainingConfig(path, "DeepSpeed config", None, (),
                              lambda gpus, hidden: settings_from_deepspeed(document, at, gpus, hidden), [])
    raise SpecError(f"{path}: unknown config format: a YAML mapping with neither torchtune's model._component_ "
                    "nor accelerate's distributed_type")
