"""The `zeroplan` command line: a thin click layer over the library.

Each command is a module of this package exposing `command` (a click command), loaded only when
it runs. To add one, write `zeroplan/cli/<name>.py` and list it in COMMANDS with the first
sentence of its help.
"""

from __future__ import annotations

import gc
import os

import click

from zeroplan import __version__
from zeroplan.cli.group import LazyGroup

# command name (its module under zeroplan.cli) -> the first sentence of its help, which
# `zeroplan --help` lists without importing the command (tests/cli/test_startup.py holds them equal)
COMMANDS = {
    "compare": "Compare the per-GPU memory of MODEL over ZeRO stages x GPU counts x offload targets: one row "
               "per configuration with its breakdown at the peak, host memory per node, the saving against ZeRO-0 "
               "on the same GPU count, and whether it fits.",
    "estimate": "Estimate the memory per GPU of training MODEL: by category at the peak, phase by phase, and per "
                "node under offload.",
    "measure": "Run real training steps of MODEL on --nproc ranks and print the memory each rank used, by category "
               "at the peak, beside the estimate for the same configuration, with the error (estimate / measured - "
               "1), for the steady state and the first step.",
    "models": "List the models MODEL can name, with their exact parameter counts (as Hugging Face transformers "
              "instantiates them).",
    "plan": "Find the configurations of MODEL that fit the GPUs (ZeRO stage x offload x checkpointing x micro-batch, "
            "GPU counts when a list or range is given, and meshes with --mesh), rank them by their step time, and "
            "say why each ranks where it does.",
    "validate": "Estimate and measure a grid of configurations (models x engines x stages x precision x offload x "
                "checkpointing x batch x world size), one row at a time, and report the estimate's error per row "
                "and category with its distribution.",
}


@click.group(
    "zeroplan",
    cls=LazyGroup,
    commands=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, "-V", "--version", prog_name="zeroplan")
def cli() -> None:
    """Plan ZeRO / FSDP training memory: how many bytes per GPU, in which phase, and does it fit.

    \b
    Examples:
      zeroplan estimate llama-2-7b --gpus 8 --zero 3
      zeroplan estimate --params 7.5e9 --gpus 64 --zero 3 --engine paper --units GB
      zeroplan compare llama-2-7b --zero 0,1,2,3 --gpus 8,64 --offload none,cpu --gpu h100-80gb
      zeroplan plan llama-2-13b --gpu a100-40gb --gpus 8 --emit deepspeed ds_config.json
      zeroplan measure tiny-llama --engine fsdp2 --zero 3 --nproc 2 --precision fp32
      zeroplan models
    """


def main(args: list[str] | None = None) -> None:
    """Entry point of the `zeroplan` console script and `python -m zeroplan`."""
    # zeroplan uses no pydantic plugins: skip pydantic's scan of every installed distribution's
    # entry points for them (pydantic/plugin/_loader.py, get_plugins), about 25 ms of start-up in
    # a large environment. Setting PYDANTIC_DISABLE_PLUGINS yourself (even to "") takes precedence.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    # A command is one short process that builds no reference cycles worth collecting; the cyclic
    # collector's passes over the freshly imported modules were 6% of `zeroplan estimate`
    # (bench/results/estimate_speed.md). Reference counting still frees everything as before.
    gc.disable()
    try:
        cli.main(args=args, prog_name="zeroplan")
    finally:
        # The interpreter's exit runs the cyclic collector over every object still alive, disabled or not
        # (CPython Python/pylifecycle.c finalize_modules and interpreter_clear: _PyGC_CollectNoFail): for
        # estimate's objects (pydantic's schemas, click's options, the estimator's records) about 25 ms of CPU, a
        # sixth of the command (bench/estimate_speed.py: 1.77x -> 1.47x its floor). Frozen objects are out of its
        # reach; reference counting still frees them as the modules are cleared, atexit handlers run, and the
        # rest goes back with the process.
        gc.freeze()
