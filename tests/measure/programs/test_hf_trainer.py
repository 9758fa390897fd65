"""`zeroplan measure --recipe hf-trainer`: the real transformers.Trainer on 2 gloo ranks, held to the
estimate of the same spec (issue 11, item 4), and the spec-to-Trainer mapping without processes.

The distributed cases run the launcher and worker on the catalogue's tiny-llama (micro-batch 2 x
128 tokens, 2 steps): each takes 10-25 s on 2 busy cores (DeepSpeed's shm comm op is built ahead by
the `deepspeed_ops` fixture, outside the clock).
"""

from __future__ import annotations

import pytest

from zeroplan.errors import MeasureError
from zeroplan.importers.catalog import resolve_model
from zeroplan.measure.comparison import TARGETS, compare, run_peaks
from zeroplan.spec.training import TrainingSpec

TINY = resolve_model("tiny-llama")
N = 2


def _training(**fields) -> TrainingSpec:
    base = dict(recipe="hf-trainer", gpus=N, micro_batch=2, seq_len=128, precision="fp32", device="cpu")
    return TrainingSpec(**(base | fields))


# -- the spec as the Trainer's arguments (no processes) --------------------------------------------

def test_runnable_recipes_add_the_trainer_and_keep_plain_as_the_default():
    from zeroplan.measure.launcher import DEFAULT_RECIPE, RUNNABLE_RECIPES

    assert DEFAULT_RECIPE == "plain"
    assert {"plain", "hf-trainer"} <= set(RUNNABLE_RECIPES)


def test_deepspeed_json_leaves_to_the_trainer_what_the_trainer_fills():
    pytest.importorskip("transformers")
    from zeroplan.measure.programs.hf_trainer import trainer_deepspeed_config

    h = TINY.hidden_size
    # integrations/deepspeed.py trainer_config_finalize: reduce_bucket_size = h*h, and at stage 3
    # stage3_prefetch_bucket_size = 0.9*h*h, stage3_param_persistence_threshold = 10*h
    knobs = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
             "stage3_param_persistence_threshold": 10 * h}
    config = trainer_deepspeed_config(_training(engine="deepspeed", zero_stage=3, deepspeed=knobs | {"client_optimizer": True}), h)
    assert "optimizer" not in config  # the Trainer's own torch optimizer is the client optimizer
    # DeepSpeed's own AdamW otherwise (DummyOptim in deepspeed_optim_sched), torch's on a CPU run
    own = trainer_deepspeed_config(_training(engine="deepspeed", zero_stage=3, deepspeed=knobs), h)
    assert own["optimizer"] == {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert config[key] == "auto"
    assert config["bf16"]["enabled"] == config["fp16"]["enabled"] == "auto"
    assert all(config["zero_optimization"][key] == "auto" for key in knobs)
    # a bucket the Trainer would not choose is written out
    other = trainer_deepspeed_config(_training(engine="deepspeed", zero_stage=2, deepspeed={"reduce_bucket_size": 12345}), h)
    assert other["zero_optimization"]["reduce_bucket_size"] == 12345


@pytest.mark.parametrize(("fields", "message"), [
    ({"engine": "torch", "zero_stage": 1}, r"^zero_stage: the Trainer has no ZeroRedundancyOptimizer"),
    ({"engine": "torch", "checkpointing": "selective"}, r"^checkpointing: the Trainer checkpoints every decoder layer whole"),
    ({"engine": "torch", "precision": "fp16"}, r"^precision: fp16 needs a GPU with the Trainer"),
    ({"engine": "fsdp2", "zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}, r"^offload: accelerate's FSDP2"),
    ({"engine": "torch", "loss": "chunked"}, r"^loss / activation_offload: the Trainer computes the model's own loss"),
])
def test_what_the_trainer_cannot_run_is_one_line_naming_the_field(fields, message):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from zeroplan.measure.engines.common import RunContext
    from zeroplan.measure.programs.hf_trainer import check_supported

    ctx = RunContext(rank=0, world_size=N, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(MeasureError, match=message):
        check_supported(_training(**fields), ctx)


# -- the real Trainer on 2 gloo ranks ----------------------------------------------------------------

def _measure_and_compare(training: TrainingSpec, engine_config: dict | None = None):
    pytest.importorskip("accelerate")
    from zeroplan.estimate import estimate
    from zeroplan.estimate.serialize import phase_to_dict
    from zeroplan.measure.launcher import run_measurement

    result = run_measurement(TINY, training, nproc=N, backend="gloo", steps=2, timeout_s=300, engine_config=engine_config)
    assert result.implementation.startswith("transformers.Trainer-"), result.implementation
    measured = result.to_json_dict()
    comparison = compare([phase_to_dict(phase) for phase in estimate(TINY, training).phases], run_peaks(measured))
    return result, comparison


def _assert_peaks_within_targets(comparison) -> None:
    for step in ("steady", "first"):
        line = getattr(comparison, step).peak
        assert abs(line.error) <= TARGETS.peak_tolerance(step), f"{step}: {line.error:+.2%}"


@pytest.mark.distributed
def test_trainer_ddp_matches_the_estimate():
    result, comparison = _measure_and_compare(_training(engine="torch", zero_stage=0))
    assert any("find_unused_parameters=True" in note for note in result.notes)  # trainer.py _build_accelerator_args
    assert any("AdamW{'fused': True}" in note for note in result.notes)  # the Trainer's default optim
    _assert_peaks_within_targets(comparison)


@pytest.mark.distributed
def test_trainer_deepspeed_zero2_with_the_docs_auto_json_matches_the_estimate(deepspeed_ops):
    """The Hugging Face docs' ZeRO-2 JSON ("auto" buckets): the spec takes the buckets the Trainer
    fills from the model (as `zeroplan estimate --config` reads such a JSON), and the run checks
    that DeepSpeed got the same."""
    pytest.importorskip("deepspeed")
    deepspeed_ops("deepspeed_shm_comm")
    from zeroplan.importers.deepspeed_json import trainer_filled_buckets

    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
              "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                    "reduce_bucket_size": "auto", "allgather_bucket_size": 2e8}}
    knobs = trainer_filled_buckets(TINY.hidden_size, 2) | {"overlap_comm": True, "allgather_bucket_size": 200_000_000}
    training = _training(engine="deepspeed", zero_stage=2, deepspeed=knobs)
    result, comparison = _measure_and_compare(training, config)
    assert any(f'"reduce_bucket_size": {TINY.hidden_size ** 2}' in note for note in result.notes)
    _assert_peaks_within_targets(comparison)


# -- what the Trainer does that the estimate models for it -----------------------------------------

def test_trainer_ddp_forward_ends_with_the_fp32_logits_and_their_clone():
    """find_unused_parameters (the Trainer's default without checkpointing) makes DDP's _DDPSink
    clone the outputs (docs/engines/torch.md): at the end of the forward the fp32 logits and their
    clone, 2 x tokens x vocab x 4 bytes, are alive beside what the loss left."""
    from zeroplan.estimate import estimate
    from zeroplan.estimate.activations.transformer import activation_bytes
    from zeroplan.estimate.result import Phase, Step

    def steady_forward(training):
        return next(p for p in estimate(TINY, training).phases if (p.step, p.phase) == (Step.STEADY, Phase.FORWARD))

    for precision in ("fp32", "bf16"):
        training = _training(engine="torch", zero_stage=0, precision=precision)
        acts = activation_bytes(TINY, training, 4 if precision == "fp32" else 2)
        forward = steady_forward(training)
        logits_fp32 = training.micro_batch * training.seq_len * TINY.vocab_size * 4
        assert forward.categories.activations == acts.forward_end + 2 * logits_fp32
    # with checkpointing the Trainer turns find_unused_parameters off: nothing is cloned
    checkpointed = _training(engine="torch", zero_stage=0, checkpointing="full")
    plain = checkpointed.model_copy(update={"recipe": "plain"})
    assert steady_forward(checkpointed).categories.activations == steady_forward(plain).categories.activations


@pytest.mark.distributed
def test_trainer_deepspeed_zero2_bf16_steps_the_trainers_adamw_beside_the_gradient_partition(deepspeed_ops):
    """The grid's ZeRO-2 bf16 row: the Trainer's fused AdamW is DeepSpeed's client optimizer, stepped
    one of its two param groups at a time while the bf16 `grads_in_partition` is alive
    (stage_1_and_2.py `step`): the first step peaks in the first group's update."""
    pytest.importorskip("deepspeed")
    deepspeed_ops("deepspeed_shm_comm")
    from zeroplan.measure.grid import GRID, row_specs

    row = next(r for r in GRID if r.id == "tiny-llama/deepspeed-2/bf16/ckpt/2x128/w2/hf-trainer")
    _, training = row_specs(row)
    result, comparison = _measure_and_compare(training)
    assert comparison.first.measured_phase == comparison.first.estimated_phase == "optimizer_step"
    _assert_peaks_within_targets(comparison)
