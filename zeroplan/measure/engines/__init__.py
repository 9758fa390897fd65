"""The measure mode's dispatch: which runner wraps a model (an engine module of this folder, or a mesh
runner: mesh.py for tensor, sequence, context and pipeline parallelism with FSDP2, mesh_moe.py for expert
parallelism, deepspeed_mesh.py for AutoTP and Ulysses), where the worker builds the model and in what context.
Every runner follows the contract of engines/common.py and imports only that (no runner imports this module).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable

from zeroplan.errors import MeasureError
from zeroplan.measure.engines.common import EngineRunner, RunContext
from zeroplan.spec.training import TrainingSpec

if TYPE_CHECKING:  # torch is imported lazily: zeroplan.measure must import without it
    import torch


# engine name (TrainingSpec.engine value) -> module exposing build_runner(model, training, ctx)
_ENGINE_MODULES = {
    "torch": "zeroplan.measure.engines.torch_engine",
    "fsdp2": "zeroplan.measure.engines.fsdp2_engine",
    "fsdp1": "zeroplan.measure.engines.fsdp1_engine",
    "deepspeed": "zeroplan.measure.engines.deepspeed_engine",
}

BuildRunner = Callable[["torch.nn.Module", TrainingSpec, RunContext], EngineRunner]


def model_device(training: TrainingSpec, ctx: RunContext):
    """Where the worker builds the model (spec/program.py ModelInit): meta (sharded or moved, then
    materialised: torchtitan), the host (cast and moved by the engine or the runner: the Trainer,
    accelerate, DeepSpeed), or the rank's device (also inside `deepspeed.zero.Init`)."""
    import torch

    init = training.program.model_init.value
    if _mesh(training, ctx) is not None:  # a mesh run builds on meta, then shards (measure/engines/mesh.py)
        return torch.device("meta")
    return torch.device("meta") if init == "meta" else torch.device("cpu") if init == "host" else ctx.device


def model_context(training: TrainingSpec, ctx: RunContext):
    """The context the worker builds the model in: `deepspeed.zero.Init` for model_init zero-init."""
    import contextlib

    if training.program.model_init.value != "zero-init":
        return contextlib.nullcontext()
    return importlib.import_module(_ENGINE_MODULES["deepspeed"]).zero_init_context(training, ctx)


def _mesh(training: TrainingSpec, ctx: RunContext):
    """The mesh of a run whose degrees are not all one (measure/engines/mesh.py `MeshShape`), else None."""
    from zeroplan.measure.mesh_rules import is_mesh_run

    if not is_mesh_run(training) or training.engine.value == "deepspeed":  # measure/engines/deepspeed_mesh.py runs those
        return None
    return importlib.import_module("zeroplan.measure.engines.mesh").mesh_shape(training, ctx.world_size)


def engine_names() -> tuple[str, ...]:
    return tuple(_ENGINE_MODULES)


def build_runner(model: "torch.nn.Module", training: TrainingSpec, ctx: RunContext) -> EngineRunner:
    """Wrap `model` with the engine `training.engine` names and create its optimizer."""
    if training.mesh.ep > 1:  # expert parallelism with FSDP2 (measure/engines/mesh_moe.py)
        return importlib.import_module("zeroplan.measure.engines.mesh_moe").build_runner(model, training, ctx)
    shape = _mesh(training, ctx)
    if shape is not None:  # tensor, sequence and pipeline parallelism with FSDP2 (measure/engines/mesh.py)
        return importlib.import_module("zeroplan.measure.engines.mesh").build_mesh_runner(model, training, ctx, shape)
    name = training.engine.value
    if name == "deepspeed" and not training.mesh.is_trivial:  # AutoTP or Ulysses
        return importlib.import_module("zeroplan.measure.engines.deepspeed_mesh").build_runner(model, training, ctx)
    if name not in _ENGINE_MODULES:
        raise MeasureError(f"engine: {name} cannot be measured; choose one of {', '.join(_ENGINE_MODULES)}")
    module = importlib.import_module(_ENGINE_MODULES[name])
    return module.build_runner(model, training, ctx)
