"""The step-time model (zeroplan/plan/step_time.py, work.py, rates.py) against its definitions: the FLOPs of a
token (Kaplan et al. 2020; PaLM appendix B with the causal mask's half; FlashAttention's backward), each
checkpointing policy's recomputation, the ZeRO paper's communication volumes on the links they cross (once), what
overlaps them, the pipeline's bubble, and the knobs. The published throughput it is checked against is
tests/project/test_published_throughput.py."""

from __future__ import annotations

import pytest

from zeroplan.errors import FieldError
from zeroplan.estimate.model.facts import model_facts
from zeroplan.estimate.model.layout import param_layout
from zeroplan.estimate.adapters.lora import adapter_params
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.gpus import get_gpu, gpu_names
from zeroplan.plan.rates import COMPILE_SPEEDUP, gpu_speeds, rates_for
from zeroplan.plan.step_time import StepModel, exposed, ring_latency, step_time
from zeroplan.plan.work import ATTENTION_BACKWARD, model_shape, pace, work
from zeroplan.spec.lora import LoraSpec, QuantSpec
from zeroplan.spec.mesh import MeshSpec, PPSchedule
from zeroplan.spec.model import ParamCountSpec
from zeroplan.spec.training import Checkpointing, TrainingSpec

H100 = get_gpu("h100-80gb")
RATES = rates_for(H100)
# the volumes alone: no latency per collective
BANDWIDTH_ONLY = RATES.model_copy(update={"ring_base_latency_s": 0.0, "ring_step_latency_intra_s": 0.0,
                                          "ring_step_latency_inter_s": 0.0})
LLAMA8 = resolve_model("llama-3.1-8b")


def test_every_gpu_preset_has_its_compute_rates():
    for name in gpu_names():
        speeds = gpu_speeds(name)
        assert speeds.matmul_bf16_tflops <= get_gpu(name).bf16_tflops  # a measured rate is below the datasheet's
        assert 0 < speeds.step_mfu < speeds.matmul_bf16_tflops / get_gpu(name).bf16_tflops


def test_a_token_costs_6_flops_per_trained_matmul_parameter_and_the_causal_half_of_palms_attention():
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=8, seq_len=8192)
    shape, w = model_shape(LLAMA8, training), work(LLAMA8, training)
    h, vocab, layers, seq = 4096, 128_256, 32, 8192
    # matmul parameters a token runs: everything but the input embedding (a lookup) and the norms
    block = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14_336
    assert shape.layer_params == pytest.approx(block + 2 * h, rel=1e-3)  # the two RMSNorm weights are counted too
    assert shape.head_params == vocab * h
    palm = 12 * layers * 32 * 128 * seq  # PaLM appendix B, forward and backward of QK^T and AV, no mask
    assert w.model_flops == pytest.approx(6 * (layers * shape.layer_params + vocab * h) + palm / 2)
    # FlashAttention's own count: the forward's two matmuls on the causal half, the backward 2.5 times that
    assert w.attention_flops == pytest.approx(layers * 4 * (seq / 2) * 4096 * (1 + ATTENTION_BACKWARD))


def test_a_frozen_parameter_costs_4_flops_per_token_and_a_trained_one_6():
    full, lora = TrainingSpec(gpus=8), TrainingSpec(gpus=8, lora=LoraSpec(rank=8, targets=("q_proj", "v_proj")))
    shape = model_shape(resolve_model("llama-2-7b"), lora)
    trained = model_facts(resolve_model("llama-2-7b"), lora)
    assert shape.trained_share == trained.trainable_params / trained.total_params
    assert work(resolve_model("llama-2-7b"), lora).matmul_flops == pytest.approx(
        (4 + 2 * shape.trained_share) / 6 * work(resolve_model("llama-2-7b"), full).matmul_flops, rel=1e-3)
    assert model_shape(ParamCountSpec(params=100, trainable_params=25), full).trained_share == 0.25


@pytest.mark.parametrize(("policy", "every", "matmul", "attention"), [
    (Checkpointing.NONE, None, 0.0, 0.0),
    (Checkpointing.FULL, None, 1 / 3, 1.0),  # each block's forward again: a third of its matmuls, its attention forward
    (Checkpointing.FULL, 2, 1 / 6, 0.5),  # every other block (torchtitan selective_ac_option 2)
    (Checkpointing.FULL, 5, (32 // 5) / 32 / 3, (32 // 5) / 32),  # blocks 5, 10, ... 30
    (Checkpointing.SELECTIVE, None, 0.0, 1.0),  # the attention core (Korthikanti et al. 2022)
    (Checkpointing.OP, None, 1 / 6, 0.0),  # every other matmul's forward (torchtitan _apply_op_sac)
])
def test_each_checkpointing_policy_recomputes_its_share(policy, every, matmul, attention):
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=8, seq_len=8192, checkpointing=policy, checkpoint_every=every)
    w = work(LLAMA8, training)
    blocks = 32 * model_shape(LLAMA8, training).layer_params * 6
    attention_forward = w.attention_flops / (1 + ATTENTION_BACKWARD)
    assert w.recompute_matmul_flops == pytest.approx(matmul * blocks)
    assert w.recompute_attention_flops == pytest.approx(attention * attention_forward)


def test_a_collective_is_hidden_under_compute_but_its_first_unit():
    assert exposed(1.0, 10.0, 10) == pytest.approx(0.1)  # the first unit's collective: nothing runs before it
    assert exposed(10.0, 1.0, 10) == pytest.approx(10.0 - 0.9)  # the rest beyond the compute it overlaps
    assert exposed(0.0, 5.0, 4) == 0.0


def _collectives(**fields):
    training = TrainingSpec(**{"gpus": 8, "seq_len": 2048, **fields})
    return StepModel(LLAMA8, training, BANDWIDTH_ONLY).collectives, training


def test_the_zero_papers_volumes_at_each_stage():
    """ZeRO (Rajbhandari et al. 2020) section 7: stages 0-2 move 2Ψ per step, stage 3 3Ψ per micro-batch; ring
    collectives send (N - 1)/N of the data (NCCL's ring), on the node's links for 8 GPUs."""
    psi = pace(LLAMA8, TrainingSpec(gpus=8)).params
    one = 7 / 8 * psi * 2 / RATES.intra_node_bytes_per_s  # one pass over the 16-bit parameters
    zero0, _ = _collectives(zero_stage=0)
    assert zero0.step_exposed == pytest.approx(2 * one)  # DeepSpeed's all-reduce at the boundary, overlap_comm off
    zero1, _ = _collectives(zero_stage=1)
    assert zero1.step_exposed == pytest.approx(2 * one)  # reduce the gradients, gather the updated shards
    zero2, _ = _collectives(zero_stage=2)
    assert (zero2.backward_exposed, zero2.step_exposed) == pytest.approx((one, one))  # a reduce-scatter per micro-batch
    zero3, _ = _collectives(zero_stage=3)
    assert (zero3.forward, zero3.backward) == pytest.approx((one, 2 * one))  # gather twice, reduce once, per micro-batch
    fsdp2, _ = _collectives(zero_stage=2, engine="fsdp2", recipe="torchtitan")
    assert (fsdp2.forward, fsdp2.backward) == pytest.approx((one, one))  # FSDP2 re-gathers at every forward
    ddp_zero1, _ = _collectives(zero_stage=1, engine="torch")
    assert ddp_zero1.step_backward + ddp_zero1.step_exposed == pytest.approx(3 * one)  # DDP all-reduce + broadcast


def test_frozen_parameters_move_only_their_gradients_and_a_4bit_base_is_gathered_packed():
    lora = LoraSpec(rank=8, targets=("all-linear",))
    tiny = resolve_model("tiny-llama")
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=4, lora=lora, quant=QuantSpec(base_precision="nf4"))
    slowest = pace(tiny, training)
    layout = param_layout(tiny)
    quantized = [t for t in layout.block if t.name.endswith("proj.weight")]
    # bitsandbytes packs two 4-bit values per byte (quantize_4bit); FSDP2 gathers those bytes (uint8 storage), the
    # rest at bf16: the rank's gathered elements are counted in bf16 elements of 2 bytes
    packed_bytes = tiny.num_layers * sum(-(-t.numel // 2) for t in quantized)
    rest = layout.total_params - tiny.num_layers * sum(t.numel for t in quantized) + adapter_params(tiny, lora)
    assert 2 * slowest.params == packed_bytes + 2 * rest
    assert slowest.trained_params == adapter_params(tiny, lora)


def test_a_collective_across_nodes_runs_at_the_network_bandwidth_once():
    collectives, _ = _collectives(zero_stage=3, gpus=128, engine="fsdp2", recipe="torchtitan")
    psi = pace(LLAMA8, TrainingSpec(gpus=128)).params
    assert collectives.forward == pytest.approx(127 / 128 * psi * 2 / RATES.inter_node_bytes_per_s)


def test_ring_latency_is_nccls_base_and_steps():
    training = TrainingSpec(gpus=128)
    assert ring_latency(8, 8, training, RATES) == pytest.approx(8.4e-6 + 7 * 3.4e-6)
    assert ring_latency(128, 128, training, RATES) == pytest.approx(8.4e-6 + 112 * 3.4e-6 + 15 * 14e-6)
    assert ring_latency(1, 1, training, RATES) == 0.0


def test_hsdp_all_reduces_each_shard_across_the_replicas_and_pipelines_reduce_once_per_step():
    hsdp, training = _collectives(zero_stage=3, gpus=32, engine="fsdp2", recipe="torchtitan",
                                  mesh=MeshSpec(dp_replicate=4))
    trained = pace(LLAMA8, training).trained_params
    assert hsdp.replicate == pytest.approx(2 * 3 / 4 * trained / 8 * 2 / RATES.inter_node_bytes_per_s)
    pipeline, _ = _collectives(zero_stage=2, gpus=16, engine="fsdp2", recipe="torchtitan", grad_accum=8,
                               mesh=MeshSpec(pp=2))
    assert pipeline.forward == pipeline.backward == 0  # torch pipelining reduces at the end of the schedule
    assert pipeline.step_forward > 0 and pipeline.step_backward > 0


def test_the_pipeline_bubble_is_p_minus_1_over_v_m_of_the_ideal_time():
    def step(schedule, virtual, accum):
        training = TrainingSpec(engine="fsdp2", zero_stage=2, gpus=64, recipe="torchtitan", seq_len=4096,
                                grad_accum=accum, mesh=MeshSpec(pp=4, pp_schedule=schedule, pp_virtual_stages=virtual))
        return step_time(LLAMA8, training, RATES).terms
    one = step(PPSchedule.ONE_F_ONE_B, 1, 8)
    ideal = one["compute"] + one["recompute"] + one["tp"] + one["cp"] + one["ep"]
    assert one["pp bubble"] == pytest.approx(3 / 8 * ideal)  # Narayanan et al. 2021 section 2.2: (p - 1)/m
    assert step(PPSchedule.ONE_F_ONE_B, 1, 16)["pp bubble"] == pytest.approx(one["pp bubble"])  # the same seconds
    looped = step(PPSchedule.INTERLEAVED_1F1B, 2, 8)
    assert looped["pp bubble"] == pytest.approx(one["pp bubble"] / 2, rel=0.01)  # (p - 1)/(v m)


def test_a_micro_batch_too_small_for_its_matmuls_runs_at_the_memorys_pace():
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=8, seq_len=4096, micro_batch=1)
    model = StepModel(LLAMA8, training, RATES)
    assert model.roofline(8192) == pytest.approx(1.0)  # 8192 tokens: every matmul compute-bound
    assert model.roofline(16) < 0.2  # 16 tokens: reading the weights takes longer than multiplying
    m, k, n = 16, 4096, 4096  # one matmul by its definition (Williams et al. 2009): the slower of the two
    flops_s = 2 * m * k * n / (H100.bf16_flops_per_s * RATES.matmul_efficiency)
    bytes_s = 2 * (m * k + k * n + m * n) / H100.hbm_bytes_per_s
    assert bytes_s > flops_s


def test_the_knobs_are_rates_on_the_compute():
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=8, seq_len=8192, micro_batch=2, recipe="torchtitan")
    plain = step_time(LLAMA8, training, RATES).terms
    compiled = step_time(LLAMA8, training, RATES.model_copy(update={"compile": True})).terms
    assert compiled["compute"] == pytest.approx(plain["compute"] / COMPILE_SPEEDUP)
    calibrated = step_time(LLAMA8, training, RATES.model_copy(update={"calibration": 0.5})).terms
    assert calibrated["compute"] == pytest.approx(2 * plain["compute"])
    float8 = step_time(LLAMA8, training, rates_for(H100, float8=True)).terms
    assert plain["compute"] / 1.39 < float8["compute"] < plain["compute"]  # the linears only, at torchao's 1.39
    with pytest.raises(FieldError, match="^float8: no measured float8 linear speedup for a100-80gb"):
        rates_for(get_gpu("a100-80gb"), float8=True)


def test_mfu_is_the_model_flops_of_the_tokens_per_second_over_the_peak():
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=8, seq_len=8192, micro_batch=2, recipe="torchtitan")
    step = step_time(LLAMA8, training, RATES)
    assert step.mfu == pytest.approx(step.tokens_per_s * work(LLAMA8, training).model_flops / H100.bf16_flops_per_s)
    assert step.seconds == pytest.approx(sum(step.terms.values()))
    assert step.tokens == 2 * 8192  # a GPU's share of the global batch per step
