"""The Python API: zeroplan's commands as functions (docs/api.md).

    import zeroplan
    result = zeroplan.estimate("llama-2-7b", gpus=8, zero=3)
    result.to_dict()                 # the document of `zeroplan estimate ... --format json`
    print(result.render("table"))    # what the command prints

Each function takes its command's options as keyword arguments, named as the long option
underscored (`--micro-batch 4` -> `micro_batch=4`, `--no-ddp` -> `ddp=False`), with the same
defaults and the same checks: a bad value raises a `zeroplan.errors.ZeroplanError` with a one-line
message (`FieldError` naming the keyword). `--format` and `--units` are not keywords: the result
renders itself (`render(format, units)`). The command line is a layer over the same code: it
prints `render` of the result these functions return (zeroplan/api/keywords.py says how keyword
arguments become the command's options).

`ZeroplanCallback` (a transformers `TrainerCallback`) and `track` estimate and measure a run
inside your own training program (zeroplan/measure/live/); they import torch when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zeroplan.api.results import CompareResult, EstimateResult, MeasureReport, PlanResult

__all__ = ["estimate", "compare", "plan", "measure", "ZeroplanCallback", "track"]


def estimate(model: str | None = None, *, snapshot: str | None = None, **options: Any) -> EstimateResult:
    """`zeroplan estimate MODEL [OPTIONS]`: the memory per GPU of one training configuration.

    `model` is a catalogue name, a model spec file or a Hugging Face config.json (or give
    `params=7.5e9`, or a `config=` file that names the model). `snapshot="step.pickle"` also writes
    the predicted step for PyTorch's memory viewer (`--snapshot FILE`; `result.snapshot(path)` later).
    Options: `zeroplan estimate --help`."""
    from zeroplan.api.estimates import estimate_from_options
    from zeroplan.api.keywords import options_from_keywords, parameters
    from zeroplan.cli.common import estimate_option_list

    keywords = {"model": model, **options}
    return estimate_from_options(options_from_keywords("estimate", parameters(estimate_option_list()), keywords),
                                 snapshot=None if snapshot is None else str(snapshot))


def compare(model: str | None = None, **options: Any) -> CompareResult:
    """`zeroplan compare MODEL [OPTIONS]`: ZeRO stages x GPU counts x offload targets, one row each
    (`zero=[0, 1, 2, 3]`, `gpus=[8, 64]`, `offload=["none", "cpu"]`; `plot="FILE.png"` also draws it in GiB).
    Options: `zeroplan compare --help`."""
    from zeroplan.api.estimates import compare_from_options
    from zeroplan.api.keywords import options_from_keywords, parameters
    from zeroplan.cli.grid_options import compare_option_list

    keywords = {"model": model, **options}
    result = compare_from_options(options_from_keywords("compare", parameters(compare_option_list()), keywords))
    if options.get("plot") is not None:
        result.plot(options["plot"])
    return result


def plan(model: str | None = None, **options: Any) -> PlanResult:
    """`zeroplan plan MODEL [OPTIONS]`: the configurations that fit the GPU (`gpu="h100-80gb"` or
    `gpu_memory="80GiB"`), ranked by estimated step cost; `mesh=True` searches meshes too;
    `emit=("deepspeed", "ds.json")` writes the best plan's config. Options: `zeroplan plan --help`."""
    from zeroplan.api.keywords import options_from_keywords
    from zeroplan.api.plans import plan_from_options
    from zeroplan.cli.plan import command

    keywords = {"model": model, **options}
    return plan_from_options(options_from_keywords("plan", command.params, keywords))


def measure(model: str | None = None, **options: Any) -> MeasureReport | None:
    """`zeroplan measure MODEL --nproc N [OPTIONS]`: real training steps on local ranks (needs torch),
    measured beside the estimate. `output="m.json"` also writes the JSON. A rank that ran out of
    device memory is a result (`report.fits` is False). Across nodes (`nnodes=`, `node_rank=`,
    `rdzv_endpoint=`) node 0 returns every rank's report, the other nodes None.
    Options: `zeroplan measure --help`."""
    from zeroplan.api.keywords import options_from_keywords, parameters
    from zeroplan.api.measurements import measure_from_options
    from zeroplan.cli.measure_options import MEASURE_OPTIONS

    keywords = {"model": model, **options}
    return measure_from_options(options_from_keywords("measure", parameters(MEASURE_OPTIONS), keywords))


def __getattr__(name: str) -> Any:  # PEP 562: the in-program tools import torch and transformers when used
    if name in ("ZeroplanCallback", "track"):
        from zeroplan.measure import live

        return getattr(live, name)
    raise AttributeError(f"module 'zeroplan.api' has no attribute {name!r}")
