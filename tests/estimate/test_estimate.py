"""The analytic model against published figures and the engines' own formulas, plus the
properties ZeRO guarantees (more sharding never costs memory; shards add up to the whole)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroplan.importers.catalog import resolve_model
from zeroplan.estimate import estimate
from zeroplan.estimate.activations.transformer import activation_bytes
from zeroplan.estimate.engines.common import ceil_div
from zeroplan.estimate.engines.torch_ddp import zero_redundancy_shards
from zeroplan.estimate.result import Phase, Step
from zeroplan.spec.model import ParamCountSpec
from zeroplan.spec.training import TrainingSpec

GB = 10**9


def model_states_bytes(model, training: TrainingSpec) -> int:
    """Parameters + gradients + optimizer states at the steady optimizer step."""
    step = next(p for p in estimate(model, training).phases if (p.step, p.phase) == (Step.STEADY, Phase.OPTIMIZER_STEP))
    c = step.categories
    return c.params + c.grads + c.optimizer_states


@pytest.mark.parametrize(
    ("stage", "published_gb"),
    # ZeRO paper (Rajbhandari et al. 2020) Table 1: Ψ = 7.5B, N_d = 64, K = 12.
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.88)],
)
def test_paper_engine_reproduces_zero_table_1(stage, published_gb):
    model = ParamCountSpec(params=7_500_000_000)
    training = TrainingSpec(engine="paper", zero_stage=stage, gpus=64, precision="bf16")
    assert estimate(model, training).peak_bytes / GB == pytest.approx(published_gb, abs=0.005 * published_gb + 0.01)


@pytest.mark.parametrize(
    ("gpus", "stage", "published_gb"),
    # ZeRO paper Table 1, other rows: Ψ = 7.5B at N_d = 4 and 1024.
    [(4, 1, 52.5), (4, 2, 41.3), (4, 3, 30.0), (1024, 1, 30.1), (1024, 2, 15.1), (1024, 3, 0.12)],
)
def test_paper_engine_other_table_1_rows(gpus, stage, published_gb):
    model = ParamCountSpec(params=7_500_000_000)
    training = TrainingSpec(engine="paper", zero_stage=stage, gpus=gpus)
    assert estimate(model, training).peak_bytes / GB == pytest.approx(published_gb, rel=0.01, abs=0.01)


def test_deepspeed_zero2_model_states_match_deepspeed_formula():
    # deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs (no offload):
    # 2Ψ + 18Ψ/N ("2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit +
    # 8_optimizer_states_32bit"); for 7.5e9 on 8 nodes x 8 GPUs it prints 15.93 GB (GiB, really).
    psi, gpus = 7_500_000_000, 64
    training = TrainingSpec(engine="deepspeed", zero_stage=2, gpus=gpus, gpus_per_node=8)
    ours = model_states_bytes(ParamCountSpec(params=psi), training)
    deepspeed_formula = 2 * psi + int(18 * psi / gpus)
    assert ours == pytest.approx(deepspeed_formula, rel=1e-6)
    assert ours / 2**30 == pytest.approx(15.93, abs=0.01)


@pytest.mark.parametrize("name", ["llama-2-7b", "gpt2", "mixtral-8x7b"])
def test_peak_is_the_largest_phase_and_categories_sum_to_it(name):
    result = estimate(resolve_model(name), TrainingSpec(engine="fsdp2", zero_stage=3, gpus=8))
    assert result.peak_bytes == max(p.total_bytes for p in result.phases)
    assert sum(result.peak.categories.as_dict().values()) == result.peak_bytes


def test_activations_grow_with_micro_batch_and_full_checkpointing_cuts_them():
    model = resolve_model("llama-2-7b")
    base = dict(engine="deepspeed", zero_stage=3, gpus=8, seq_len=4096)

    def forward_activations(**overrides) -> int:
        phases = estimate(model, TrainingSpec(**base, **overrides)).phases
        return next(p for p in phases if (p.step, p.phase) == (Step.STEADY, Phase.FORWARD)).categories.activations

    one, two = forward_activations(micro_batch=1), forward_activations(micro_batch=2)
    # per sequence, plus the rotary cos and sin the batch shares (2 x seq x head_dim, bf16)
    assert 2 * one - two == 2 * 4096 * 128 * 2
    # Korthikanti et al. 2022 section 5: full recomputation keeps 2sbh per layer (16-bit); here
    # what remains is dominated by the logits (vocab 32000 > 32 layers x hidden 4096 / 6).
    assert forward_activations(checkpointing="full") < one / 5


def test_eager_attention_adds_the_score_matrix():
    model = resolve_model("gpt2")  # without its dropout: tests/estimate/activations/test_dropout.py counts what that adds
    fused = estimate(model, TrainingSpec(engine="torch", seq_len=1024, precision="fp32", attention="fused", dropout=0))
    eager = estimate(model, TrainingSpec(engine="torch", seq_len=1024, precision="fp32", attention="eager", dropout=0))
    extra = eager.peak.categories.activations - fused.peak.categories.activations
    # a x s x s fp32 softmax output per layer: 12 heads x 1024^2 x 4 bytes x 12 layers, minus
    # the k/v expansion difference (none for GPT-2: kv heads = heads) and lse (12 x 4 bytes/token).
    expected = 12 * (12 * 1024 * 1024 * 4 - 1024 * 12 * 4)
    assert extra == expected


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "llama-2-7b"])
def test_a_block_s_backward_moments_keep_their_defining_sums(name):
    """ActivationBytes derives each moment's intercept once (the profiles read them per moment):
    the fast forms must equal saved + allocated, at every number of blocks left, for both the
    MLP's moment and eager attention's."""
    model = resolve_model(name)
    moments = set()
    for checkpointing in ("none", "selective", "full"):
        for attention in ("fused", "eager"):
            for seq_len in (128, 1024):
                training = TrainingSpec(checkpointing=checkpointing, attention=attention, seq_len=seq_len, micro_batch=2)
                acts = activation_bytes(model, training, 2)
                mlp_allocated = acts.recompute_block - (acts.block_backward_freed if acts.recompute_block else 0) + acts.block_backward_transient
                for left in range(acts.num_blocks + 1):
                    assert acts.block_backward_peak(left) == acts.block_backward_saved(left) + acts.block_backward_temporary
                    assert acts.block_mlp_peak(left) == acts.blocks_left_saved(left) + mlp_allocated
                    if left:
                        assert acts.block_backward_peak(left) >= acts.block_mlp_peak(left)  # the larger moment
                moments.add(acts.attention_peaks)
    assert moments == {True, False}


def test_zero_redundancy_optimizer_shards_cover_every_tensor_once():
    numels = [50257 * 768, 1024 * 768] + [768] * 50 + [768 * 2304] * 12
    shards = zero_redundancy_shards(numels, 4)
    assert sorted(n for shard in shards for n in shard) == sorted(numels)


@given(rows=st.integers(1, 10_000), cols=st.integers(1, 64), world=st.integers(1, 128))
def test_fsdp2_padded_shards_cover_the_tensor(rows, cols, world):
    # FSDP2 pads dim 0 to a multiple of the world size; the padding is less than one row per rank.
    shard_rows = ceil_div(rows, world)
    assert shard_rows * world >= rows
    assert shard_rows * world - rows < world


CONFIG = st.fixed_dictionaries(
    {
        "engine": st.sampled_from(["deepspeed", "fsdp2", "paper"]),
        "precision": st.sampled_from(["fp32", "bf16", "pure-bf16"]),
        "optimizer": st.sampled_from(["adamw", "sgd"]),
        "micro_batch": st.integers(1, 4),
        "seq_len": st.sampled_from([128, 1024, 4096]),
    }
)


@settings(max_examples=60, deadline=None)
@given(config=CONFIG, gpus=st.sampled_from([2, 8, 64]), name=st.sampled_from(["gpt2", "llama-2-7b", "tiny-llama"]))
def test_model_states_never_grow_with_a_higher_stage(config, gpus, name):
    model = resolve_model(name)
    stages = [2, 3] if config["engine"] == "fsdp2" else [1, 2, 3]
    sizes = [model_states_bytes(model, TrainingSpec(**config, zero_stage=s, gpus=gpus)) for s in stages]
    assert sizes == sorted(sizes, reverse=True)


@settings(max_examples=60, deadline=None)
@given(config=CONFIG, stage=st.integers(1, 3), name=st.sampled_from(["gpt2", "llama-2-7b"]))
def test_per_gpu_bytes_never_grow_with_more_gpus(config, stage, name):
    if config["engine"] == "fsdp2" and stage == 1:
        stage = 2
    model = resolve_model(name)
    peaks = [estimate(model, TrainingSpec(**config, zero_stage=stage, gpus=g)).peak_bytes for g in (2, 4, 8, 64)]
    assert peaks == sorted(peaks, reverse=True)


@settings(max_examples=40, deadline=None)
@given(config=CONFIG, gpus=st.sampled_from([2, 8, 64]))
def test_offload_never_grows_gpu_bytes(config, gpus):
    model = resolve_model("llama-2-7b")
    if config["engine"] == "fsdp2":
        plain = TrainingSpec(**config, zero_stage=3, gpus=gpus)
        offloaded = [TrainingSpec(**config, zero_stage=3, gpus=gpus, offload_optimizer="cpu", offload_params="cpu")]
    else:
        plain = TrainingSpec(**config, zero_stage=3, gpus=gpus)
        offloaded = [
            TrainingSpec(**config, zero_stage=3, gpus=gpus, offload_optimizer="cpu"),
            TrainingSpec(**config, zero_stage=3, gpus=gpus, offload_optimizer="nvme", offload_params="cpu"),
        ]
    plain_peak = estimate(model, plain).peak_bytes
    for spec in offloaded:
        result = estimate(model, spec)
        assert result.peak_bytes <= plain_peak
        assert result.per_node.cpu_bytes + result.per_node.nvme_bytes > 0


def test_offload_moves_bytes_to_the_host_per_node():
    model = ParamCountSpec(params=7_500_000_000)
    training = TrainingSpec(engine="paper", zero_stage=3, gpus=64, gpus_per_node=8, offload_optimizer="cpu", offload_params="nvme")
    result = estimate(model, training)
    # ZeRO-Infinity: the optimizer's 12Ψ/N and gradients' 2Ψ/N per GPU to the host, 2Ψ/N to NVMe.
    assert result.per_node.cpu_bytes == pytest.approx(14 * 7.5e9 / 64 * 8, rel=1e-9)
    assert result.per_node.nvme_bytes == pytest.approx(2 * 7.5e9 / 64 * 8, rel=1e-9)
    assert result.peak_bytes == 0


def test_cpu_device_has_no_cuda_overhead():
    model = resolve_model("tiny-llama")
    cuda = estimate(model, TrainingSpec(engine="fsdp2", zero_stage=3, gpus=2))
    cpu = estimate(model, TrainingSpec(engine="fsdp2", zero_stage=3, gpus=2, device="cpu"))
    assert cpu.peak.categories.overhead == 0
    assert cuda.peak.categories.overhead > 0


def test_eight_bit_adam_states_follow_bitsandbytes_layout():
    # bitsandbytes 0.50.2 Optimizer2State.init_state: state1/state2 uint8 plus absmax1/absmax2 fp32 per
    # 256-element block (`blocksize = 256`); torch AdamW: exp_avg and exp_avg_sq fp32.
    model = ParamCountSpec(params=256 * 1000)
    adamw = estimate(model, TrainingSpec(engine="torch", zero_stage=0, gpus=1, precision="fp32", optimizer="adamw"))
    eight = estimate(model, TrainingSpec(engine="torch", zero_stage=0, gpus=1, precision="fp32", optimizer="adam8bit"))
    assert adamw.peak_of(Step.STEADY).categories.optimizer_states == 2 * 4 * 256 * 1000
    step = next(p for p in eight.phases if (p.step, p.phase) == (Step.STEADY, Phase.OPTIMIZER_STEP))
    # and the two 256-value fp32 code tables one 8-bit optimizer keeps (fill_qmap)
    assert step.categories.optimizer_states == 2 * (256 * 1000 + 4 * 1000) + 2 * 256 * 4


def test_fsdp2_says_when_dim0_padding_inflates_the_shards():
    """Mixtral's expert tensors have 8 rows on dim 0: on 64 ranks FSDP2 pads them to 64 rows, so
    each rank holds 1/8 of them (about 7.8x an even share of the model, as the estimate counts)."""
    mixtral = estimate(resolve_model("mixtral-8x7b"), TrainingSpec(engine="fsdp2", zero_stage=3, gpus=64))
    assert any("padded to a multiple of 64 ranks" in note and "as few as 8 rows" in note for note in mixtral.notes)
    assert mixtral.peak.categories.params > 7 * 46_702_792_704 * 4 // 64  # fp32 shards, 7.8x the even share
    llama = estimate(resolve_model("llama-2-7b"), TrainingSpec(engine="fsdp2", zero_stage=3, gpus=64))
    assert not any("padded" in note for note in llama.notes)
