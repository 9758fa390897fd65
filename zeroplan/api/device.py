"""What an estimate holds on a GPU, for `zeroplan estimate` and `zeroplan.estimate(...)`: the three figures of
each rank kind (allocated, reserved, device: estimate/device/), and the same replay drawn for PyTorch's memory
viewer (`--snapshot`), under the allocator settings the run would have."""

from __future__ import annotations


def check_snapshot(training) -> None:
    """A snapshot draws the caching allocator of a GPU: a CPU run has none."""
    from zeroplan.errors import SpecError

    if training.device.value != "cuda":
        raise SpecError(f"--snapshot: a {training.device.value} run has no CUDA caching allocator to draw; "
                        "estimate --device cuda")


def gpu_snapshot_of(result, training) -> dict:
    """The estimate as `torch.cuda.memory._snapshot()` would give it: the replay behind each rank kind's figures
    (estimate/device/snapshot.py), with the same allocator settings."""
    from zeroplan.estimate.device.snapshot import estimate_snapshot

    check_snapshot(training)
    settings = allocator_settings_of(training)
    return estimate_snapshot(result, gpu_figures_of(result, training, record_history=True), settings)


def allocator_settings_of(training):
    """PYTORCH_CUDA_ALLOC_CONF of this process's environment, or the recipe's (torchtitan turns expandable
    segments on: torchtitan/train.py sets PYTORCH_CUDA_ALLOC_CONF)."""
    import os

    from zeroplan.estimate.device.alloc_conf import RECIPE_ALLOC_CONF, parse_alloc_conf, settings_from_environment

    settings = settings_from_environment(os.environ)
    if not any(variable in os.environ for variable in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        recipe_default = RECIPE_ALLOC_CONF.get(training.recipe.value)
        if recipe_default is not None:
            settings = parse_alloc_conf(recipe_default)
    return settings


def gpu_figures_of(result, training, gpu_memory_bytes: int | None = None, record_history: bool = False):
    """Each rank kind's allocated, reserved and device bytes on the run's GPU (estimate/device/estimate.py), with
    the allocator settings of this process's environment, or the recipe's (torchtitan turns expandable segments
    on: torchtitan/train.py sets PYTORCH_CUDA_ALLOC_CONF); None for a CPU run, whose one memory has no allocator.
    A GPU known by its memory alone (`--gpu-memory 80GiB`) is that much memory for the allocator's replay."""
    if training.device.value != "cuda" or any(rank.estimate.ledger is None for rank in result.ranks):
        return None
    from zeroplan.estimate.device.estimate import UnnamedGpu, device_figures

    gpu = training.gpu
    if gpu is None and gpu_memory_bytes is not None:
        gpu = UnnamedGpu(memory_bytes=gpu_memory_bytes)
    return device_figures(result, training, gpu, settings=allocator_settings_of(training),
                          record_history=record_history)
