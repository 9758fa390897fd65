"""DeepSpeed ZeRO-3 steps its optimizer one sub-group at a time (DeepSpeed 0.19.8 runtime/zero/stage3.py
`step`: `_prepare_sub_group`, `_optimizer_step`, `_release_sub_group`), so only one sub-group's fp32
gradient is alive at once. Checked against DeepSpeed's own `_create_fp16_sub_groups` and against a
measurement on 2 gloo ranks (the accuracy grid's row
tiny-llama/deepspeed-3+smallbkt+subgroup50000/bf16/ckpt/2x128/w2, docs/accuracy.json)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zeroplan.estimate import estimate
from zeroplan.estimate.engines.deepspeed import sub_groups_of
from zeroplan.estimate.model.facts import model_facts
from zeroplan.estimate.result import Phase, Step
from zeroplan.importers.catalog import resolve_model
from zeroplan.measure.grid import GRID, row_specs
from zeroplan.spec.training import TrainingSpec

TINY = resolve_model("tiny-llama")  # hidden 128, 2 blocks, intermediate 352, vocabulary 512, untied head
# tiny-llama's tensors in model.parameters() order (elements, decays): the embeddings, per block q, k,
# v, o, gate, up, down and two RMSNorms, then the final norm and the head
BLOCK = ((16384, True), (8192, True), (8192, True), (16384, True), (45056, True), (45056, True), (45056, True),
         (128, False), (128, False))
ORDER = ((65536, True), *BLOCK, *BLOCK, (128, False), (65536, True))
ROW = "tiny-llama/deepspeed-3+smallbkt+subgroup50000/bf16/ckpt/2x128/w2"


class _Param:
    """What `_create_fp16_sub_groups` reads of a parameter: its partition's element count."""

    def __init__(self, numel: int, n: int):
        self.partition = -(-numel // n)  # partition_parameters.py `_partition_param`: padded to N, split

    def partition_numel(self) -> int:
        return self.partition


def _deepspeeds_sub_groups(n: int, sub_group_size: int, trainer: bool) -> tuple[int, ...]:
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    cut = stage3.DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups
    if trainer:  # transformers trainer.py `create_optimizer`: decay group, then the biases and norms
        groups = [[numel for numel, decays in ORDER if decays], [numel for numel, decays in ORDER if not decays]]
    else:  # one group: DeepSpeed's config optimizer, or the plain loop's client optimizer
        groups = [[numel for numel, _ in ORDER]]
    sizes = []
    for group in groups:
        for sub_group in cut(SimpleNamespace(sub_group_size=sub_group_size), [_Param(x, n) for x in group]):
            sizes.append(sum(p.partition_numel() for p in sub_group))
    return tuple(sizes)


@pytest.mark.parametrize("trainer", [False, True], ids=["one group", "trainer groups"])
@pytest.mark.parametrize("n", [1, 2, 3, 64])
@pytest.mark.parametrize("sub_group_size", [0, 1, 20_000, 50_000, 57_344, 69_759, 100_000, 250_176, 1_000_000_000])
def test_sub_groups_are_cut_as_deepspeed_cuts_them(n, sub_group_size, trainer):
    # a sub-group closes once its partitions reach sub_group_size (so it can hold up to one tensor's
    # partition, less one element, more), or at its param group's last tensor
    training = TrainingSpec(engine="deepspeed", zero_stage=3, gpus=n, device="cpu",
                            recipe="hf-trainer" if trainer else "plain", deepspeed={"client_optimizer": trainer})
    got = sub_groups_of(model_facts(TINY, training), n, sub_group_size, trainer)
    assert got == _deepspeeds_sub_groups(n, sub_group_size, trainer)


def test_the_first_step_peaks_at_the_last_sub_groups_update_as_measured():
    """Measured on 2 gloo ranks, both alike (`zeroplan validate --rows ROW`): the first step's peak is
    the optimizer step of the last of the four sub-groups (55,488 elements per rank), with its fp32
    gradient, its AdamW temporaries and every sub-group's states (created one sub-group at a time).
    The whole partition's fp32 gradient at once (250,176 elements) was 15% over."""
    row = next(r for r in GRID if r.id == ROW)
    assert row.sub_group_size == 50_000
    model, training = row_specs(row)
    result = estimate(model, training)
    assert _deepspeeds_sub_groups(2, 50_000, trainer=False) == (57_344, 67_584, 69_760, 55_488)
    first = next(p for p in result.phases if (p.step, p.phase) == (Step.FIRST, Phase.OPTIMIZER_STEP))
    assert result.peak_of(Step.FIRST) == first
    # measured: grads 722,304 B (the bf16 gradient partitions and the last sub-group's fp32 .grad),
    # optimizer_states 3,002,128 B (master and moments, with four 4-byte AdamW step counts), temporaries
    # 443,952 B (the sub-group's two AdamW temporaries, and 48 B of scalars), peak 4,868,865 B
    assert first.categories.grads == 722_304
    assert first.categories.optimizer_states == pytest.approx(3_002_128, abs=16)
    assert first.categories.temporaries == pytest.approx(443_952, abs=48)
    assert first.total_bytes == pytest.approx(4_868_865, rel=0.001)
    # the steady peak stays the backward pass (measured 7,190,249 B)
    assert result.peak_of(Step.STEADY).total_bytes == pytest.approx(7_190_249, rel=0.03)


def test_the_trainers_two_param_groups_are_two_sub_groups_as_measured():
    """The Hugging Face Trainer's AdamW as DeepSpeed's client optimizer (the grid row
    tiny-llama/deepspeed-3/bf16/ckpt/2x128/w2/hf-trainer, docs/accuracy.json): its weight-decay group
    (249,856 elements per rank) and its norms (320) are two sub-groups even under the default
    sub_group_size. Measured on 2 gloo ranks, both alike: the first step peaks at the decay group's
    update, with that group's fp32 gradient and states only (the norms' come after)."""
    row = next(r for r in GRID if r.id == "tiny-llama/deepspeed-3/bf16/ckpt/2x128/w2/hf-trainer")
    model, training = row_specs(row)
    assert _deepspeeds_sub_groups(2, training.deepspeed.sub_group_size, trainer=True) == (249_856, 320)
    first = estimate(model, training).peak_of(Step.FIRST)
    assert first.phase == Phase.OPTIMIZER_STEP
    # measured: grads 1,499,776 B (bf16 partitions and the decay group's fp32 .grad), optimizer_states
    # 2,999,556 B (master, the decay group's moments and a 4-byte AdamW step count)
    assert first.categories.grads == 1_499_776
    assert first.categories.optimizer_states == pytest.approx(2_999_556, abs=4)
