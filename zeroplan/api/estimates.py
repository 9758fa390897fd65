"""What `zeroplan estimate` and `zeroplan compare` compute from their options, for the command line and
`zeroplan.estimate(...)` / `zeroplan.compare(...)` alike: `options` is the dict the click command
passes to its callback (zeroplan/api/keywords.py builds the same from keyword arguments)."""

from __future__ import annotations

from typing import Any

from zeroplan.api.device import check_snapshot, gpu_figures_of
from zeroplan.api.results import CompareResult, EstimateResult


def estimate_from_options(options: dict[str, Any], snapshot: str | None = None) -> EstimateResult:
    """One estimate: the model and training options over a --config file; every rank kind's (one on plain data
    parallelism), the worst at the top level (issue 14). `snapshot`: also write the predicted step for PyTorch's
    memory viewer there (`EstimateResult.snapshot`), its folder checked before anything is estimated."""
    from zeroplan.importers.options import input_notes, load_config, model_from_options, training_spec_from_options

    if snapshot is not None:
        from zeroplan.spec.files import writable_file

        writable_file(snapshot, "--snapshot")
    from zeroplan.cli.grid_options import resolve_gpu
    from zeroplan.api.pricing import priced

    preset, gpu_memory = resolve_gpu(options["gpu"], options["gpu_memory"])
    config = load_config(options["config_file"])
    model = model_from_options(options["model"], options["params"], options["largest_layer"], options["trainable_params"],
                               config)
    training = training_spec_from_options(options, config, model)
    if snapshot is not None:
        check_snapshot(training)
    notes = input_notes(model, training, config, options["model"])
    from zeroplan.estimate import estimate_mesh
    from zeroplan.estimate.serialize import estimate_to_dict

    # one estimate per rank kind (tp, cp, pp, ep, HSDP: issue 14); plain data parallelism has one
    result = estimate_mesh(model, training)
    data = estimate_to_dict(result, training, gpu_memory_bytes=gpu_memory, notes=notes,
                            figures=gpu_figures_of(result, training, gpu_memory))
    lines = priced(data, model, training, preset, gpu_memory, options)  # `step` (with --gpu), `suggestions` (issue 24)
    estimated = EstimateResult(data, lines, result, training)
    if snapshot is not None:
        estimated.snapshot(snapshot)
    return estimated


def compare_from_options(options: dict[str, Any]) -> CompareResult:
    """The grid of ZeRO stages x GPU counts x offload targets; on a mesh every row is its worst rank."""
    from zeroplan.cli.grid_options import base_training, parse_choice_list, parse_int_list, resolve_gpu
    from zeroplan.importers.options import load_config, model_from_options
    from zeroplan.plan.grid import OFFLOAD_CHOICES, OnDevice, compare
    from zeroplan.plan.search import parse_gpu_counts
    from zeroplan.spec.files import writable_file

    if options["plot_file"]:  # before the grid is estimated
        from zeroplan.report.plot import check_plotting

        writable_file(options["plot_file"], "--plot")
        check_plotting()
    stages = parse_int_list(options["zero_stages"], "--zero", 0, 3)
    gpu_counts = parse_gpu_counts(options["gpu_counts"])  # plan's parser: a list, or a doubling range 8-64
    offloads = parse_choice_list(options["offloads"], "--offload", OFFLOAD_CHOICES)
    _, gpu_memory = resolve_gpu(options["gpu"], options["gpu_memory"])
    options = {**options, "config_file": load_config(options["config_file"])}  # read once, for every grid point
    model = model_from_options(options["model"], options["params"], options["largest_layer"], options["trainable_params"],
                               options["config_file"])
    base = base_training(options, stages, max(gpu_counts), model)
    estimator = None
    if not base.mesh.is_trivial:  # every row is the worst rank of the mesh (issue 14)
        from zeroplan.estimate import worst_rank_estimate as estimator
    from zeroplan.estimate import estimate_mesh

    def on_device(training):  # each row's fits as `zeroplan estimate`'s (one replay per row)
        figures = gpu_figures_of(estimate_mesh(model, training), training, gpu_memory)
        if figures is None:
            return None
        return OnDevice(max(found.device_bytes for found in figures.values()),
                        not all(found.fits for found in figures.values()))

    return CompareResult(compare(model, base, stages, gpu_counts, offloads, gpu_memory, options["headroom"], estimator,
                                 on_device))
