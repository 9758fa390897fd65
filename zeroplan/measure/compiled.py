"""torch.compile as torchtitan applies it (issue 23): each transformer block compiled as one graph, and the loss.

torchtitan v0.2.2 models/llama3/infra/parallelize.py `apply_compile` replaces every block of `model.layers` with
`torch.compile(block, fullgraph=True)` after activation checkpointing and before FSDP2 (`apply_fsdp` then shards
the compiled wrappers, whose parameters are the block's); components/loss.py `build_cross_entropy_loss` compiles
the loss function when "loss" is among [compile] components. Inductor's CPU backend builds C++ kernels with the
system compiler, tens of seconds a graph on 2 cores: its cache (TORCHINDUCTOR_CACHE_DIR) is a kept folder, one
per environment as DeepSpeed's ops are (measure/deepspeed_build.py), so a graph is built once per machine.

The accounting of a compiled run is the allocator's (measure/allocations.py): under a dispatch mode Dynamo runs
the eager ops, and a compiled run would be measured as an eager one.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CACHE_ENV = "ZEROPLAN_INDUCTOR_CACHE_DIR"
"""Where inductor's compiled kernels are kept; else ~/.cache/zeroplan/inductor; one subfolder per environment."""


def inductor_cache_dir() -> Path:
    """The kept folder of this environment: <root>/py311-torch2.13.0-<venv hash>."""
    chosen = os.environ.get(CACHE_ENV)
    root = Path(chosen).expanduser() if chosen else Path.home() / ".cache" / "zeroplan" / "inductor"
    venv = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    return root / f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}-{venv}"


def prepare_environment() -> None:
    """Point inductor at the kept cache (before the first compilation reads TORCHINDUCTOR_CACHE_DIR)."""
    folder = inductor_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder))


def compile_blocks(blocks: nn.ModuleList) -> None:
    """torchtitan's `apply_compile`: each block of `blocks` replaced by its compiled wrapper, in place."""
    prepare_environment()
    for index, block in enumerate(blocks):
        blocks[index] = torch.compile(block, fullgraph=True)


def standard_loss(logits: torch.Tensor, shifted_labels: torch.Tensor) -> torch.Tensor:
    """The standard loss of the compiled programs: the fp32 upcast of the logits and the mean cross-entropy
    (torchtitan components/loss.py `cross_entropy_loss`, transformers ForCausalLMLoss)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted_labels.reshape(-1), ignore_index=-100)


def compiled_loss():
    """`standard_loss` compiled, as torchtitan compiles its loss function (one graph)."""
    prepare_environment()
    return torch.compile(standard_loss, fullgraph=True)
