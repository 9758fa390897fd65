"""The mesh options (issue 14): one per `MeshSpec` field, named `mesh_<field>` for
`zeroplan.importers.options.training_spec_from_options`, None meaning "not given"."""

from __future__ import annotations

import click

from zeroplan.spec.limits import field_bounds
from zeroplan.spec.mesh import MeshSpec, PPSchedule


def _degree(field: str) -> click.IntRange:
    """The range of a mesh degree, as MeshSpec bounds it (zeroplan/spec/limits.py)."""
    return click.IntRange(*field_bounds(MeshSpec, field))


def _help(field: str) -> str:
    return f"{MeshSpec.model_fields[field].description} [default: {MeshSpec.model_fields[field].default!s}]".replace(
        "PPSchedule.ONE_F_ONE_B", "1f1b")


MESH_OPTIONS = [
    click.option("--tp", "mesh_tp", type=_degree("tp"), metavar="N", help=_help("tp")),
    click.option("--cp", "mesh_cp", type=_degree("cp"), metavar="N", help=_help("cp")),
    click.option("--pp", "mesh_pp", type=_degree("pp"), metavar="N", help=_help("pp")),
    click.option("--pp-schedule", "mesh_pp_schedule", type=click.Choice([s.value for s in PPSchedule]),
                 help=_help("pp_schedule")),
    click.option("--pp-virtual-stages", "mesh_pp_virtual_stages", type=_degree("pp_virtual_stages"), metavar="N",
                 help=_help("pp_virtual_stages")),
    click.option("--ep", "mesh_ep", type=_degree("ep"), metavar="N", help=_help("ep")),
    click.option("--dp-replicate", "mesh_dp_replicate", type=_degree("dp_replicate"), metavar="N", help=_help("dp_replicate")),
    click.option("--sequence-parallel/--no-sequence-parallel", "mesh_sequence_parallel", default=None,
                 help=_help("sequence_parallel")),
    click.option("--loss-parallel/--no-loss-parallel", "mesh_loss_parallel", default=None, help=_help("loss_parallel")),
    click.option("--moe-imbalance", "mesh_moe_imbalance", type=click.FloatRange(min=1.0), metavar="F",
                 help=_help("moe_imbalance")),
]


def mesh_options(function):
    """Every mesh option on a command (`zeroplan compare`; estimate has them through `estimate_options`)."""
    for decorator in reversed(MESH_OPTIONS):
        function = decorator(function)
    return function
