"""TOML and YAML text -> a mapping, or one `SpecError` line naming the file and the line.

TOML is read with the standard library (tomllib). YAML is read with PyYAML's safe loader, the one
torchtune (OmegaConf) and accelerate (`yaml.safe_load`, commands/config/config_args.py) read their
configs with; it is imported only when a YAML file is read, so that `zeroplan estimate` without one
never pays for it. Neither loader runs code: safe_load builds only plain data.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from typing import Any

from zeroplan.errors import MissingDependencyError, SpecError


def is_torchtitan(document: Mapping[str, object]) -> bool:
    """A TOML is torchtitan's when it has its [model] or [training] table (every train_configs/*.toml does)."""
    return isinstance(document.get("model"), Mapping) or isinstance(document.get("training"), Mapping)


def parse_toml(text: str, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:  # its message ends with "(at line L, column C)"
        raise SpecError(f"{where}: invalid TOML: {error}") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise SpecError(f"{where}: nested too deeply for a config file") from None
    except ValueError as error:  # an integer of more than 4,300 digits (sys.get_int_max_str_digits)
        raise SpecError(f"{where}: invalid TOML: {error}") from None


def parse_yaml(text: str, where: str) -> Any:
    """The YAML document in `text` as plain data (a mapping for every config zeroplan reads)."""
    try:
        import yaml
    except ImportError:
        raise MissingDependencyError(f"{where}: reading a YAML config needs PyYAML: pip install pyyaml") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = error.problem or error.context or "cannot be read"
        raise SpecError(f"{where}{line}: invalid YAML: {problem}") from None
    except yaml.YAMLError as error:
        raise SpecError(f"{where}: invalid YAML: {error}") from None
    except RecursionError:
        raise SpecError(f"{where}: nested too deeply for a config file") from None
    except (ValueError, TypeError) as error:  # a huge integer; a key that cannot be a dict key ([a]: 1)
        raise SpecError(f"{where}: invalid YAML: {error}") from None
