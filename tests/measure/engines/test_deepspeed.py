"""The DeepSpeed engine of `zeroplan measure`: its config and errors (no processes), and DeepSpeed's
memory physics measured on 2 real gloo ranks (docs/engines/deepspeed.md).

The distributed cases run the real launcher and worker on a tiny Llama (139,584 parameters) with
a reduce bucket of 2e6 elements (8 MB of fp32) so that the bucket stands out of everything else
the model holds. A cold machine first JIT-builds DeepSpeed's shm comm op (about 35 s, once,
cached in ~/.cache/zeroplan/torch_extensions; see .ci/deepspeed_cache.sh), in the session fixture
`deepspeed_ops` (tests/conftest.py), before any run's clock starts; after that each run takes
10-20 s. The optimizer-offload case also builds cpu_adam (about 60 s, 2 GB): it is slow.
"""

from __future__ import annotations

import math
import sys

import pytest

from zeroplan.estimate.model.layout import param_layout
from zeroplan.estimate.result import Step
from zeroplan.errors import MeasureError, MissingDependencyError
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec

TINY = TransformerSpec(
    name="tiny-llama", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    intermediate_size=128, max_position_embeddings=64, position_embedding="rotary", norm="rmsnorm",
    mlp="gated", tie_word_embeddings=False, hf_model_type="llama",
)
N = 2
BUCKET = 2_000_000  # reduce_bucket_size, elements
FP32 = 4
PSI = param_layout(TINY).total_params
# Stages 1-2: the flat parameter group is padded to a multiple of 2N and split evenly
# (stage_1_and_2.py, DeepSpeedZeroOptimizer.__init__, nccl_start_alignment_factor = 2).
P12 = math.ceil(PSI / (2 * N)) * 2
# Stage 3: every tensor is padded to a multiple of N and split (partition_parameters.py, _partition_param).
P3 = sum(math.ceil(t.numel / N) for t in param_layout(TINY).all_tensors)
N_MAX = max(t.numel for t in param_layout(TINY).all_tensors)


def _training(**fields) -> TrainingSpec:
    knobs = {"reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET, **fields.pop("deepspeed", {})}
    fields.setdefault("precision", "fp32")
    fields.setdefault("recipe", "plain")  # zeroplan's own loop (the default recipe runs the Trainer)
    return TrainingSpec(engine="deepspeed", gpus=N, micro_batch=2, seq_len=32, device="cpu", deepspeed=knobs, **fields)


def _ctx():
    torch = pytest.importorskip("torch")  # a RunContext holds a torch.device

    from zeroplan.measure.engines.common import RunContext

    return RunContext(rank=0, world_size=N, local_rank=0, device=torch.device("cpu"), backend="gloo")


# -- config and errors: no processes ------------------------------------------------------------


def test_missing_deepspeed_says_how_to_install(monkeypatch):
    import zeroplan.measure.engines.deepspeed_engine as deepspeed_engine

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'zeroplan\[deepspeed\]'"):
        deepspeed_engine.import_deepspeed()


def test_extensions_dir_is_kept_and_can_be_overridden(monkeypatch, tmp_path):
    from zeroplan.measure.engines.deepspeed_engine import EXTENSIONS_ENV, extensions_dir

    monkeypatch.delenv(EXTENSIONS_ENV, raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert extensions_dir().parts[-3:] == (".cache", "zeroplan", "torch_extensions")
    monkeypatch.setenv(EXTENSIONS_ENV, str(tmp_path))
    assert extensions_dir() == tmp_path


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"zero_stage": 2, "precision": "pure-bf16"}, "precision: pure-bf16"),
        ({"zero_stage": 1, "precision": "fp16"}, "precision: fp16 needs a GPU"),
        ({"zero_stage": 3, "offload_optimizer": "nvme"}, "offload: nvme needs an nvme_path"),
        ({"zero_stage": 2, "offload_optimizer": "cpu", "optimizer": "sgd"}, "optimizer: sgd cannot be offloaded"),
        ({"zero_stage": 2, "optimizer": "adam8bit"}, "optimizer: adam8bit cannot be measured"),
    ],
)
def test_configs_deepspeed_cannot_run_are_one_line_errors(fields, message):
    from zeroplan.measure.engines.deepspeed_engine import deepspeed_config

    with pytest.raises(MeasureError, match=message):
        deepspeed_config(_training(**fields), _ctx())


def test_user_json_must_agree_with_the_training_spec():
    from zeroplan.measure.engines.deepspeed_engine import user_config

    config = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}
    with pytest.raises(MeasureError, match="zero_optimization.stage is 3 but the training spec says zero_stage 2"):
        user_config(config, _training(zero_stage=2), N)
    with pytest.raises(MeasureError, match="gradient_accumulation_steps is 4 but the training spec says grad_accum 1"):
        user_config({**config, "gradient_accumulation_steps": 4}, _training(zero_stage=3), N)
    # no optimizer section: the runner passes a client torch optimizer, as the Hugging Face Trainer does
    assert "optimizer" not in user_config({"zero_optimization": {"stage": 2}}, _training(zero_stage=2), N)
    # Hugging Face style "auto" batch sizes take the training spec's values (2 x 1 micro-batches x N ranks).
    filled = user_config({**config, "train_batch_size": "auto"}, _training(zero_stage=3), N)
    assert (filled["train_micro_batch_size_per_gpu"], filled["train_batch_size"]) == (2, 2 * N)


# -- measured on 2 gloo ranks ---------------------------------------------------------------------


def _measure(training: TrainingSpec):
    pytest.importorskip("deepspeed")
    from zeroplan.measure.launcher import run_measurement

    return run_measurement(TINY, training, nproc=N, backend="gloo", steps=2, timeout_s=400)


def _phase(rank, step: int, name: str):
    return next(p for p in rank.phases if p.step == step and p.phase == name)


@pytest.fixture(scope="module", params=[1, 2], ids=["stage1", "stage2"])
def stage12(request, deepspeed_ops):
    deepspeed_ops("deepspeed_shm_comm")
    return request.param, _measure(_training(zero_stage=request.param))


@pytest.mark.distributed
def test_stage12_fp32_master_partition_is_one_nth(stage12):
    """DeepSpeed keeps an fp32 master partition of P12 elements even in an fp32 run; Adam's two
    moments of the same size appear at the first step (docs/engines/deepspeed.md, stages 1-2)."""
    _, result = stage12
    for rank in result.ranks:
        # the engine phase peaks while the parameters are flattened, before the master exists
        assert _phase(rank, 1, "forward").categories["optimizer_states"] == P12 * FP32
        # 2 Adam moments + the master, + the 4-byte `step` counter of torch AdamW
        assert _phase(rank, 1, "optimizer_step").categories["optimizer_states"] == 3 * P12 * FP32 + 4


@pytest.mark.distributed
def test_stage12_reduce_bucket_appears_in_backward_not_at_init(stage12):
    """Stages 1-2 allocate the reduce bucket (reduce_bucket_size elements) at the first gradient
    hook of each backward (setup_buckets), not in deepspeed.initialize."""
    _, result = stage12
    for rank in result.ranks:
        assert _phase(rank, 0, "engine").peak_bytes < BUCKET * FP32
        for step in (1, 2):
            # everything live after initialize is still live in backward; the rest (activations,
            # gradients in the making) is far below 8 MB on this model, the bucket alone is 8 MB
            grown = _phase(rank, step, "backward").peak_bytes - _phase(rank, 0, "engine").live_bytes
            assert grown >= BUCKET * FP32


@pytest.mark.distributed
def test_stage12_adam_reads_a_one_nth_fp32_gradient_partition(stage12):
    """In step() the owned gradients are flattened into one fp32 partition of P12 elements, set as
    the master's .grad (stage_1_and_2.py, step); the other ranks' gradients are gone by then."""
    _, result = stage12
    for rank in result.ranks:
        assert _phase(rank, 1, "optimizer_step").categories["grads"] == P12 * FP32


@pytest.mark.distributed
def test_stage2_gradients_of_activations_are_temporaries_in_the_run_and_activations_in_the_estimate(deepspeed_ops):
    """Issue 21: `measure --engine deepspeed --zero 2` showed activations +24.6% and temporaries -100% at a
    peak of +0.0%, without a word. The bytes are the last block's gradients of activations in flight at
    the backward peak: the comparison names the move, and its size is that term of the estimate."""
    deepspeed_ops("deepspeed_shm_comm")
    from zeroplan.estimate.activations.transformer import activation_bytes
    from zeroplan.estimate import estimate_mesh
    from zeroplan.estimate.serialize import estimate_to_dict
    from zeroplan.importers.catalog import resolve_model
    from zeroplan.measure.comparison import compare, run_peaks
    from zeroplan.measure.launcher import run_measurement

    model, training = resolve_model("tiny-llama"), _training(zero_stage=2).varied(seq_len=128)
    result = run_measurement(model, training, nproc=N, backend="gloo", steps=2, timeout_s=400)
    estimated = estimate_to_dict(estimate_mesh(model, training), training)
    steady = compare(estimated["phases"], run_peaks(result.to_json_dict()), engine="deepspeed").steady
    assert steady.peak.ok and steady.measured_phase == "backward"
    (move,) = steady.moves()
    assert (move.estimated_as, move.measured_as) == ("activations", "temporaries")
    in_flight = activation_bytes(model, training, FP32).block_backward_temporary_at(model.num_layers)
    assert move.moved_bytes == pytest.approx(in_flight, abs=1024)  # 1,212,428 measured, 1,212,416 derived
    assert "DeepSpeed's estimate counts them with the activations" in move.reason


@pytest.fixture(scope="module")
def stage3(deepspeed_ops):
    deepspeed_ops("deepspeed_shm_comm")
    return _measure(_training(zero_stage=3, deepspeed={"stage3_param_persistence_threshold": 0}))


@pytest.mark.distributed
def test_stage3_partitions_params_grads_and_master_at_init(stage3):
    """ZeRO-3 (no persistent parameters): parameters, gradient partitions and the fp32 master
    are each Σ ceil(n_t/N) elements per rank right after deepspeed.initialize."""
    for rank in stage3.ranks:
        engine = _phase(rank, 0, "engine").categories
        assert engine["params"] == P3 * FP32  # lp_param_buffer
        assert engine["grads"] == P3 * FP32  # grad_partitions_flat_buffer
        assert engine["optimizer_states"] == P3 * FP32  # fp32_partitioned_groups_flat, a copy even in fp32


@pytest.mark.distributed
def test_stage3_allocates_the_reduce_bucket_in_initialize(stage3):
    for rank in stage3.ranks:
        engine = _phase(rank, 0, "engine")
        assert engine.live_bytes >= BUCKET * FP32
        assert engine.categories["buffers"] >= BUCKET * FP32


@pytest.mark.distributed
@pytest.mark.slow
def test_stage2_optimizer_offload_keeps_an_fp32_gradient_partition_and_staging_buffers(deepspeed_ops):
    """With offload_optimizer cpu, stage 2 creates at init the fp32 gradient partition CPU Adam
    reads (P12), a model-dtype copy of the partition for the update (P12) and two gradient
    staging buffers of the largest tensor's size (stage_1_and_2.py, __init__)."""
    deepspeed_ops("deepspeed_shm_comm", "cpu_adam")
    result = _measure(_training(zero_stage=2, offload_optimizer="cpu", deepspeed={"reduce_bucket_size": 50_000}))
    for rank in result.ranks:
        engine = _phase(rank, 0, "engine").categories
        assert engine["grads"] == P12 * FP32
        assert engine["optimizer_states"] == P12 * FP32
        assert engine["buffers"] >= P12 * FP32 + 2 * N_MAX * FP32
        # DeepSpeedCPUAdam's moments at the first step; its step counter is not a tensor
        assert _phase(rank, 1, "optimizer_step").categories["optimizer_states"] == 3 * P12 * FP32


@pytest.mark.distributed
def test_user_json_bf16_with_fp32_accumulation_runs_bf16_optimizer(deepspeed_ops):
    """The user's JSON is what runs: bf16 with data_types.grad_accum_dtype fp32 at stage 1 is
    DeepSpeed's BF16_Optimizer (engine.py, _do_optimizer_sanity_check), which keeps an fp32
    gradient accumulator for the whole model from init (bf16_optimizer.py, fp32_groups_gradients_flat)
    where DeepSpeedZeroOptimizer would keep none."""
    deepspeed_ops("deepspeed_shm_comm")
    from zeroplan.measure.launcher import run_measurement

    config = {
        "train_batch_size": "auto", "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000},
    }
    training = _training(zero_stage=1, precision="bf16")
    result = run_measurement(TINY, training, nproc=N, backend="gloo", steps=1, timeout_s=400, engine_config=config)
    flat = P12 * N  # the flat group, padded to a multiple of 2N
    for rank in result.ranks:
        forward = _phase(rank, 1, "forward").categories
        assert forward["grads"] == flat * FP32
        assert forward["params"] == flat * 2
        assert forward["optimizer_states"] == P12 * FP32


@pytest.mark.distributed
def test_user_json_without_an_optimizer_section_runs_the_client_torch_optimizer():
    """Issue 10: measure required an optimizer section that estimate does not (and the AdamW one it
    suggested meant a fused_adam build of over ten minutes on CPU). Without one, DeepSpeed steps
    the client optimizer it is given, as under the Hugging Face Trainer: torch AdamW here."""
    pytest.importorskip("deepspeed")
    from zeroplan.estimate import estimate
    from zeroplan.measure.launcher import run_measurement

    config = {"train_batch_size": "auto", "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000}}
    training = _training(zero_stage=2, precision="fp32", deepspeed={"reduce_bucket_size": 50_000})
    result = run_measurement(TINY, training, nproc=N, backend="gloo", steps=2, timeout_s=400, engine_config=config)
    expected = estimate(TINY, training)
    for rank in result.ranks:
        steady = _phase(rank, 2, "optimizer_step").categories
        # within the client AdamW's step counter: one 4-byte tensor per flat partition (not modelled)
        assert 0 <= steady["optimizer_states"] - expected.peak_of(Step.STEADY).categories.optimizer_states <= 4
