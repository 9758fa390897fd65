"""The model catalogue, and turning a MODEL argument into a validated `ModelSpec`.

A MODEL is one of:
- a catalogue name: a `<name>.toml` file in `model_specs/` (shipped inside the package as
  `zeroplan/model_specs/`, read from the repository's top-level `model_specs/` in a checkout);
- a spec file (.toml or .json) whose keys are the fields of `TransformerSpec` or `ParamCountSpec`;
- a Hugging Face `config.json` (a JSON object with a `model_type` key), or a folder holding one.

Files are parsed with the standard library only (tomllib, json) and validated by pydantic; every
failure becomes one `SpecError` line that names the file and, where it can, the line or key.
"""

from __future__ import annotations

import tomllib
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from zeroplan.errors import SpecError, UnknownModelError
from zeroplan.importers.files import check_nesting, invalid_json, read_text
from zeroplan.spec.model import ModelSpec, ParamCountSpec, TransformerSpec
from zeroplan.spec.validation import describe_validation_error, shown

_MODEL_SPEC = TypeAdapter(ModelSpec)
_MODEL_KINDS = {"transformer": TransformerSpec, "params": ParamCountSpec}  # the union's tags


def _catalogue_dir() -> Path:
    """The installed `zeroplan/model_specs/`, else the checkout's top-level `model_specs/`. The catalogue is read
    as files, so the package is a folder: this module's (importlib.resources finds the same one, and imports its
    readers to do so)."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "model_specs"
    if installed.is_dir():
        return installed
    return package.parent / "model_specs"


def _catalogue_files() -> dict[str, Path]:
    folder = _catalogue_dir()
    return {path.stem: path for path in sorted(folder.glob("*.toml"), key=lambda path: path.stem)}


def spec_from_data(data: Any, where: str) -> ModelSpec:
    """Validate a mapping of spec fields; `kind` defaults to transformer unless `params` is given."""
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a table of spec fields, got {type(data).__name__}")
    if "kind" not in data:
        data = {"kind": "params" if "params" in data else "transformer", **data}
    try:
        return _MODEL_SPEC.validate_python(data)
    except ValidationError as exc:
        raise SpecError(describe_validation_error(exc, where, _MODEL_KINDS)) from None


def _read_toml(path: Path, where: str) -> dict[str, Any]:
    text = read_text(path, "model file", where)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message already ends with "(at line L, column C)".
        raise SpecError(f"{where}: invalid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise SpecError(f"{where}: nested too deeply for a model file") from None


def _read_json(path: Path, where: str) -> Any:
    text = read_text(path, "model file", where)
    check_nesting(text, where)
    import json  # here, not at start-up: only a .json spec file needs it

    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4,300 digits
        raise SpecError(invalid_json(where, exc)) from None


_USE_CONFIG = "give it with --config (and MODEL the model it trains, unless the file names it)"


def load_spec_file(path: Path, where: str | None = None) -> ModelSpec:
    """A spec file (.toml or .json) or a Hugging Face config.json, validated. A trainer's config given as
    MODEL, or a config.json without its model_type, is named as such rather than checked field by field."""
    where = where or str(path)
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml", ".py"):
        raise SpecError(f"{where}: a {suffix} file is a trainer's config (torchtune, accelerate, ColossalAI), not a model; "
                        f"{_USE_CONFIG}")
    if suffix == ".toml":
        data = _read_toml(path, where)
        from zeroplan.importers.documents import is_torchtitan

        if is_torchtitan(data) and not {"hidden_size", "num_layers"} & set(data):
            raise SpecError(f"{where}: is a torchtitan job TOML, not a model spec; {_USE_CONFIG}")
        return spec_from_data(data, where)
    if suffix != ".json":
        raise SpecError(f"{where}: a model file must end in .toml or .json")
    data = _read_json(path, where)
    from zeroplan.importers import hf_config  # only where a JSON file is read

    if isinstance(data, dict) and hf_config.is_hf_config(data):
        # A config.json is named after its folder (…/Llama-2-7b-hf/config.json -> Llama-2-7b-hf).
        name = path.resolve().parent.name if path.stem == "config" else path.stem
        return hf_config.spec_from_hf_config(data, name or path.stem, source=where)
    if isinstance(data, dict):
        _not_a_spec(data, where)
    return spec_from_data(data, where)


def _not_a_spec(data: dict[str, Any], where: str) -> None:
    """Refuse, in one line, a JSON object that is some other file than a model spec."""
    from zeroplan.importers import hf_config
    from zeroplan.importers.deepspeed_json import is_deepspeed_config

    if is_deepspeed_config(data) and "hidden_size" not in data:
        raise SpecError(f"{where}: is a DeepSpeed config, not a model; {_USE_CONFIG}")
    if "distributed_type" in data:
        raise SpecError(f"{where}: is an accelerate config, not a model; {_USE_CONFIG}")
    if hf_config.looks_like_hf_config(data):
        raise SpecError(f"{where}: {hf_config.missing_model_type(data)}")


@cache
def _catalogue_spec(name: str) -> ModelSpec:
    path = _catalogue_files()[name]
    spec = load_spec_file(path, where=f"model_specs/{path.name}")
    if spec.name != name:
        raise SpecError(f"model_specs/{path.name}: name {spec.name!r} differs from the file name {name!r}")
    return spec


def list_models() -> list[ModelSpec]:
    """Every catalogue model, sorted by name."""
    return [_catalogue_spec(name) for name in _catalogue_files()]


_NAME_SHOWN = 300  # characters of a MODEL a message repeats: a path, but not a 5,000-character name
_GIVE = "give a catalogue name (see `zeroplan models`), a .toml/.json spec file, a config.json or its folder"


def _kind(path: Path) -> str | None:
    """"dir", "file" or None for what `path` names; a name the file system refuses (longer than it allows)
    names nothing, as a missing file does."""
    try:
        return "dir" if path.is_dir() else "file" if path.is_file() else None
    except (OSError, ValueError):  # ENAMETOOLONG, ELOOP; ValueError: a NUL byte
        return None


def resolve_model(text: str) -> ModelSpec:
    """A MODEL argument (catalogue name, spec file, config.json, or folder with one) as a spec."""
    if not text.strip():
        raise UnknownModelError(f"MODEL is empty; {_GIVE}")
    names = _catalogue_files()
    if text in names:
        return _catalogue_spec(text)
    path = Path(text).expanduser()
    kind = _kind(path)
    if kind == "dir":  # a save_pretrained folder holds config.json (transformers looks there too)
        if _kind(path / "config.json") != "file":
            raise UnknownModelError(f"MODEL {shown(text, _NAME_SHOWN)} is a directory without a config.json; give a folder written "
                                    "by save_pretrained, a config.json or a spec file")
        return load_spec_file(path / "config.json", where=str(path / "config.json"))
    if kind == "file":
        return load_spec_file(path, where=text)
    folded = {name.lower(): name for name in names}
    if text.lower() in folded:
        return _catalogue_spec(folded[text.lower()])
    if path.suffix in (".toml", ".json") or "/" in text:
        raise UnknownModelError(f"model file {shown(text, _NAME_SHOWN)} does not exist")
    import difflib  # only an unknown name needs suggestions

    close = difflib.get_close_matches(text.lower(), list(names), n=3, cutoff=0.5) if len(text) <= 100 else []
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UnknownModelError(
        f"unknown model {shown(text, _NAME_SHOWN)}{hint} (run `zeroplan models` for the catalogue, or pass a .toml/.json spec or a config.json)"
    )


def params_model(params: int, largest_layer: int | None = None, trainable: int | None = None) -> ParamCountSpec:
    """A model known only by its parameter count (for model-states-only estimates)."""
    return spec_from_data(
        {"kind": "params", "name": f"{params:,} params", "params": params,
         "largest_layer_params": largest_layer, "trainable_params": trainable},
        where="parameter-count model",
    )
