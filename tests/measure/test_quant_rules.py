"""A bitsandbytes base that could not be quantized is refused before any worker starts (issue 21).

Before: `zeroplan measure tiny-llama --engine fsdp2 --zero 3 --nproc 2 --lora-rank 8 --base-precision nf4
--quant-storage bf16` started its ranks, which failed with "rank 0 failed: MeasureError: training.quant:
bitsandbytes quantizes weights where they are; ...": zeroplan's loop builds an fsdp2 model on the meta
device, where bitsandbytes has nothing to quantize. The same run with --model-init host measures
(the QLoRA rows of the accuracy grid)."""

from __future__ import annotations

import importlib.util
import re

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import MeasureError
from zeroplan.measure.quant_rules import refuse_unmeasurable_quant
from zeroplan.spec.training import TrainingSpec

QLORA = {"lora": {"rank": 8, "targets": ["all-linear"]}, "quant": {"base_precision": "nf4", "quant_storage": "bf16"}}


def _training(**fields) -> TrainingSpec:
    return TrainingSpec(**{"gpus": 2, "precision": "bf16", "device": "cpu", "recipe": "plain", **QLORA, **fields})


@pytest.mark.parametrize(
    ("fields", "simulate", "message"),
    [
        ({"engine": "fsdp2", "zero_stage": 3}, False,
         r"^training\.quant: bitsandbytes quantizes weights where they are, and a model built on the meta device \(model "
         r"init meta, the plain recipe's default for fsdp2\) has none to quantize; measure with --model-init host"),
        ({"engine": "fsdp2", "zero_stage": 2, "model_init": "meta"}, False, r"\(model init meta\) has none to quantize"),
        ({"engine": "deepspeed", "zero_stage": 3}, False,
         r"^training\.quant: bitsandbytes cannot quantize weights partitioned by deepspeed\.zero\.Init \(model init "
         r"zero-init, the plain recipe's default for deepspeed: each weight is an empty placeholder\)"),
        ({"engine": "fsdp2", "zero_stage": 3, "model_init": "host"}, True, r"cannot be simulated"),
    ],
)
def test_a_base_that_could_not_be_quantized_is_refused(fields, simulate, message):
    with pytest.raises(MeasureError, match=message):
        refuse_unmeasurable_quant(_training(**fields), simulate)


@pytest.mark.parametrize(
    "fields",
    [
        {"engine": "fsdp2", "zero_stage": 3, "model_init": "host"},  # FSDP-QLoRA: loaded on the host, then sharded
        {"engine": "fsdp2", "zero_stage": 3, "model_init": "device"},
        {"engine": "deepspeed", "zero_stage": 3, "model_init": "device"},
        {"engine": "torch", "zero_stage": 0},
        {"engine": "fsdp2", "zero_stage": 3, "quant": {"base_precision": "bf16"}},  # not quantized: meta is fine
    ],
)
def test_what_runs_is_not_refused(fields):
    refuse_unmeasurable_quant(_training(**fields), simulate=False)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="zeroplan measure needs torch")
def test_measure_refuses_it_before_any_worker_starts(monkeypatch):
    from zeroplan.measure import launcher

    def never(*args, **kwargs):
        pytest.fail("a worker was started")

    monkeypatch.setattr(launcher, "start_worker", never)
    monkeypatch.setattr(launcher, "spawn", never)
    result = CliRunner().invoke(cli, ["measure", "tiny-llama", "--engine", "fsdp2", "--zero", "3", "--nproc", "2",
                                      "--lora-rank", "8", "--base-precision", "nf4", "--quant-storage", "bf16",
                                      "--precision", "bf16", "--seq-len", "32"])
    assert result.exit_code == 2, result.output
    assert re.fullmatch(r"Error: training\.quant: bitsandbytes quantizes weights where they are, .*; measure with "
                        r"--model-init host \(as FSDP-QLoRA loads it\) or device\n", result.stderr)
