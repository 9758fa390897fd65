"""The mesh options (`--tp`, `--pp`, ... as `mesh_<field>`) laid over the mesh a config file gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zeroplan.spec.mesh import MeshSpec


def mesh_values(options: Mapping[str, Any], values: dict[str, Any]) -> None:
    """Set `values["mesh"]` (a field mapping, validated with the rest of the TrainingSpec) from the options given."""
    given = {name: options[f"mesh_{name}"] for name in MeshSpec.model_fields if options.get(f"mesh_{name}") is not None}
    if given:
        base = values.get("mesh") or {}
        values["mesh"] = {**(base.model_dump() if isinstance(base, MeshSpec) else base), **given}
