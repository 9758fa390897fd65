"""The options of `zeroplan measure`, declared once for the command (cli/measure.py) and for
`zeroplan.measure(...)`, which reads its keyword arguments by them (zeroplan/api/keywords.py)."""

from __future__ import annotations

from pathlib import Path

import click

from zeroplan.cli.common import MODEL_OPTIONS, TRAINING_OPTIONS, units_option
from zeroplan.cli.mesh_options import MESH_OPTIONS
from zeroplan.cli.types import FiniteFloatRange

IMPLEMENTATIONS = ("auto", "hf", "reference")  # zeroplan.measure.workload.IMPLEMENTATIONS (that module imports torch)

MEASURE_OPTIONS = [
    *MODEL_OPTIONS,
    *TRAINING_OPTIONS,
    *MESH_OPTIONS,  # measure runs a mesh as zeroplan/measure/engines/mesh.py says
    click.option("--nproc", type=click.IntRange(min=1), required=True,
                 help="Ranks to run (local worker processes; simulated ranks with --simulate)."),
    click.option("--simulate", is_flag=True,
                 help="One process simulating --nproc ranks (fake tensors and process group; fsdp2 only)."),
    click.option("--backend", type=click.Choice(["gloo", "nccl"]),
                 help="gloo: CPU processes; nccl: one process per GPU. [default: nccl where GPUs are visible, else gloo]"),
    click.option("--steps", type=click.IntRange(min=2), default=2, show_default=True,
                 help="Training steps (step 1 creates the optimizer states; 2 and later are the steady state)."),
    click.option("--timeout", "timeout_s", type=FiniteFloatRange(min=0, min_open=True), default=600.0, show_default=True,
                 help="Seconds before every worker is stopped."),
    click.option("--implementation", type=click.Choice(IMPLEMENTATIONS), default="auto", show_default=True,
                 help="Model code: hf (transformers), reference (zeroplan's own), auto (hf where installed)."),
    click.option("--format", "output_format", type=click.Choice(["table", "json"]), default="table", show_default=True,
                 help="Output on stdout; json is a stable contract with sizes in bytes."),
    click.option("--output", type=click.Path(dir_okay=False), metavar="FILE",
                 help="Also write the JSON to FILE (atomically; nothing is written when the run fails); - writes it to "
                      "standard output and the table to standard error."),
    units_option(),
    click.option("--memory-check/--no-memory-check", "memory_check", default=True, show_default=True,
                 help="Refuse a run whose estimated host memory (every local rank; on CPU the device is the host) "
                      "exceeds what this machine has available (MemAvailable, or a container's limit)."),
    # across nodes (measure/nodes.py): torchrun's names
    click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
                 help="Nodes, each running this command with its own --node-rank; --nproc ranks on each."),
    click.option("--node-rank", "node_rank", type=click.IntRange(min=0), default=0, show_default=True,
                 help="This node's rank, 0 to --nnodes - 1; node 0 hosts the rendezvous and writes the result."),
    click.option("--rdzv-endpoint", "rdzv_endpoint", metavar="HOST:PORT",
                 help="Where node 0 hosts the rendezvous (a c10d TCPStore, as torchrun's): its name and a free port."),
    click.option("--rdzv-timeout", "rdzv_timeout_s", type=FiniteFloatRange(min=0, min_open=True), default=600.0,
                 show_default=True, help="Seconds a node waits for the others to join (torchrun's join_timeout)."),
]
