"""Per-rank estimates on a mesh (issue 14), checked against their definitions: TP cuts each sharded
linear exactly, pipeline stages hold the whole model between them, the schedules keep the micro-batches
torch's pipelining code says, Korthikanti et al. 2022's TP + SP activations, and an all-ones mesh is
today's estimate."""

from __future__ import annotations

import pytest

from zeroplan.estimate import estimate
from zeroplan.estimate import estimate_mesh
from zeroplan.estimate.result import RankKind
from zeroplan.estimate.parallel.mesh import in_flight, rank_activations, rank_facts, stage_layers
from zeroplan.estimate.model.layout import param_layout
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.mesh import MeshSpec, PPSchedule
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec

WHOLE = RankKind(0, (0,), 0, True, True, 1)


def fsdp(gpus: int = 8, **mesh) -> TrainingSpec:
    return TrainingSpec(recipe="torchtitan", engine="fsdp2", zero_stage=3, gpus=gpus, grad_accum=8, seq_len=4096, mesh=MeshSpec(**mesh))


@pytest.mark.parametrize("name", ["llama-3-8b", "gpt2", "pythia-1b", "mixtral-8x7b"])
def test_all_ones_mesh_is_todays_estimate(name):
    model, training = resolve_model(name), fsdp()
    mesh = estimate_mesh(model, training)
    assert len(mesh.ranks) == 1 and mesh.worst.estimate == estimate(model, training)


def test_tp2_halves_every_sharded_linear_and_keeps_the_norms_whole():
    model = resolve_model("llama-3-8b")
    whole = {t.name: t.numel for t in param_layout(model).block}
    kind = WHOLE._replace(layers=model.num_layers)
    facts = rank_facts(model, fsdp(tp=2), kind)
    block = {t.name: t.numel for t in next(g for g in facts.groups if g.role == "block").tensors}
    for name, numel in whole.items():
        expected = numel if "norm" in name else numel // 2
        assert block[name] == expected, name
    embedding = next(g for g in facts.groups if g.role == "embedding").params
    head = next(g for g in facts.groups if g.role == "final").params
    assert embedding == model.vocab_size * model.hidden_size // 2
    assert head == model.vocab_size * model.hidden_size // 2 + model.hidden_size  # lm_head cut, final norm whole


def test_gpt2_conv1d_and_biases_follow_the_plans():
    model = resolve_model("gpt2")
    facts = rank_facts(model, fsdp(tp=4), WHOLE._replace(layers=model.num_layers))
    block = {t.name: t for t in next(g for g in facts.groups if g.role == "block").tensors}
    h = model.hidden_size
    assert block["attn.c_attn.weight"].numel == h * 3 * h // 4 and block["attn.c_attn.weight"].rows == h
    assert block["attn.c_attn.bias"].numel == 3 * h // 4  # colwise bias cut with its outputs
    assert block["attn.c_proj.weight"].rows == h // 4  # rowwise Conv1D: its input rows
    assert block["attn.c_proj.bias"].numel == h  # rowwise bias replicated


@pytest.mark.parametrize("name, stages", [("llama-3-70b", 4), ("llama-3-70b", 16), ("gpt2", 3), ("llama-3-8b", 8)])
def test_pipeline_stages_hold_the_whole_model(name, stages):
    model = resolve_model(name)
    counts = stage_layers(model.num_layers, stages)
    assert sum(counts) == model.num_layers and min(counts) >= 0
    pp, virtual = (stages, 1) if stages <= 8 else (stages // 2, 2)
    schedule = "1f1b" if virtual == 1 else "interleaved-1f1b"
    training = fsdp(gpus=pp, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual).varied(grad_accum=pp * 2)
    mesh = estimate_mesh(model, training)
    assert sum(rank.params for rank in mesh.ranks) == estimate(model, TrainingSpec()).model.params


def test_torchtitan_split_counts_the_embedding_and_head_as_a_layer_each():
    # generate_llm_fqn_per_model_part: 80 + 2 effective layers over 4 stages -> 21, 21, 20, 20, less one at each end
    assert stage_layers(80, 4) == [20, 21, 20, 19]


@pytest.mark.parametrize("schedule, pp, v, n, expected", [
    ("gpipe", 4, 1, 8, [8, 8, 8, 8]),
    ("1f1b", 4, 1, 8, [4, 3, 2, 1]),  # Schedule1F1B: min(n, pp - stage) warmup forwards
    ("1f1b", 4, 1, 2, [2, 2, 2, 1]),
    # ScheduleInterleaved1F1B _get_warmup_ops: (v-1)*per_round + 2*(pp-1-rank), + the steady forward
    ("interleaved-1f1b", 4, 2, 8, [4 + 6 + 1, 4 + 4 + 1, 4 + 2 + 1, 4 + 0 + 1]),
    ("zero-bubble", 4, 2, 8, [4 + 3 + 1, 4 + 2 + 1, 4 + 1 + 1, 4 + 0 + 1]),
])
def test_micro_batches_in_flight_per_schedule(schedule, pp, v, n, expected):
    assert [in_flight(PPSchedule(schedule), pp, rank, v, n) for rank in range(pp)] == expected


def test_the_first_stage_of_1f1b_is_the_worst_rank():
    mesh = estimate_mesh(resolve_model("llama-3-70b"), fsdp(gpus=64, tp=8, pp=4).varied(seq_len=8192))
    peaks = [rank.estimate.peak_bytes for rank in mesh.ranks]
    assert mesh.worst.kind.pp_rank == 0 and peaks == sorted(peaks, reverse=True)


def _megatron_block(hidden: int, heads: int) -> TransformerSpec:
    """A block as Korthikanti et al. 2022 describe it: GPT, 4h GELU MLP, LayerNorm, bias."""
    return TransformerSpec(name="gpt", vocab_size=51200, hidden_size=hidden, num_layers=2, num_heads=heads,
                           intermediate_size=4 * hidden, max_position_embeddings=2048, position_embedding="learned",
                           norm="layernorm", mlp="gelu", attention_bias=True, attention_out_bias=True, mlp_bias=True,
                           tie_word_embeddings=True, hf_model_type="gpt2")


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_tp_with_sp_cuts_a_block_by_t_as_korthikanti_but_the_gathered_inputs(tp, dropout):
    # Korthikanti et al. 2022 sections 4.2.1-4.2.2: with TP and SP every tensor a block keeps is cut by t
    # (sbh(34/t + 5as/(ht))), its linears' inputs too, since Megatron keeps them sharded and all-gathers
    # them again in backward. torchtitan's colwise linears are DTensor matmuls that save their all-gathered
    # (Replicate) input, so exactly those two inputs (attention, MLP: 2sbh each in 16-bit) stay whole.
    model = _megatron_block(hidden=1024, heads=16).model_copy(update=dict(residual_dropout=dropout))
    s, b, h = 2048, 1, model.hidden_size
    base = TrainingSpec(recipe="torchtitan", engine="fsdp2", zero_stage=3, gpus=tp, seq_len=s, precision="bf16")
    kind = WHOLE._replace(layers=model.num_layers)
    whole = rank_activations(model, base, kind, 2).saved_per_block
    sp = rank_activations(model, base.varied(mesh=MeshSpec(tp=tp)), kind, 2).saved_per_block
    no_sp = rank_activations(model, base.varied(mesh=MeshSpec(tp=tp, sequence_parallel=False)), kind, 2).saved_per_block
    gathered_inputs = 2 * 2 * s * b * h
    assert sp == (whole - gathered_inputs) // tp + gathered_inputs
    # without SP (section 4.2.1) the norms' and dropouts' h-wide tensors stay whole on every rank
    norms = 2 * s * b * (2 * h + 8) + (2 * s * b * h if dropout else 0)  # LayerNorm input, mean, rstd; CUDA masks
    assert no_sp - sp == norms * (tp - 1) // tp


def test_context_parallel_cuts_the_sequence_and_adds_the_ring():
    model = resolve_model("llama-3-8b")
    plain = estimate_mesh(model, fsdp(gpus=8).varied(seq_len=32768)).worst.estimate
    cp = estimate_mesh(model, fsdp(gpus=8, cp=4).varied(seq_len=32768)).worst.estimate
    assert cp.peak.categories.activations < plain.peak.categories.activations / 3
    assert cp.peak.categories.params == plain.peak.categories.params  # FSDP shards over dp_shard x cp = 8


def test_experts_split_over_ep():
    model = resolve_model("mixtral-8x7b")
    training = fsdp(gpus=8, ep=8)
    facts = rank_facts(model, training.varied(mesh=MeshSpec(ep=8)), WHOLE._replace(layers=model.num_layers))
    whole = {t.name: t.numel for t in param_layout(model).block}
    block = {t.name: t.numel for t in next(g for g in facts.groups if g.role == "block").tensors}
    # ExpertParallel: Shard(0) over ep leaves each rank 1/ep of every fused expert tensor (FSDP2 then
    # shards them over efsdp: tests/estimate/parallel/test_experts.py)
    assert block["moe.experts.down_proj"] == whole["moe.experts.down_proj"] // 8
    assert estimate_mesh(model, training).worst.estimate.peak.categories.buffers > 0


def test_micro_batches_in_flight_keep_their_stage_chunks():
    # 1F1B: the profiled micro-batch covers the rank's stage; each further micro-batch in flight keeps its
    # blocks for the whole step
    model = resolve_model("llama-3-8b")
    kind = RankKind(0, (0,), 8, True, False, 1)
    one = rank_activations(model, fsdp(gpus=8, pp=4), kind, 2)
    many = rank_activations(model, fsdp(gpus=8, pp=4), kind._replace(in_flight=4), 2)
    assert many.embedding - one.embedding == 3 * (one.embedding + 8 * one.saved_per_block)


def test_looped_schedules_leave_the_chunks_in_flight_to_the_walk_of_their_actions():
    # interleaved schedules: one micro-batch through the rank's stages; the chunks alive at each moment come
    # from the schedule's action list (estimate/parallel/pipeline_schedule.py), not from a count
    model = resolve_model("llama-3-8b")
    training = fsdp(gpus=8, pp=4, pp_schedule="interleaved-1f1b", pp_virtual_stages=2)
    kind = RankKind(0, (0, 4), 8, True, False, 1)
    assert rank_activations(model, training, kind._replace(in_flight=11), 2) == rank_activations(model, training, kind, 2)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_eager_attention_keeps_korthikanti_5as2b_over_t(tp):
    # Korthikanti et al. 2022 sections 4.1-4.2: the attention core keeps 5as^2b bytes per layer in 16-bit
    # with dropout (softmax output 2, dropout mask 1, dropped probabilities 2 per score), 5as^2b/t under TP.
    # GPT-2's eager attention on CUDA keeps exactly these; the s^2 part is what doubling s adds beyond twice.
    model = _megatron_block(hidden=1024, heads=16).model_copy(update=dict(attention_dropout=0.1))
    kind = WHOLE._replace(layers=model.num_layers)

    def saved(seq: int) -> int:
        training = TrainingSpec(recipe="torchtitan", engine="fsdp2", zero_stage=3, gpus=8, seq_len=seq, attention="eager",
                                mesh=MeshSpec(tp=tp))
        return rank_activations(model, training, kind, 2).saved_per_block

    s, a = 1024, model.num_heads
    assert (saved(2 * s) - 2 * saved(s)) == 5 * a * (2 * s * s) // tp
