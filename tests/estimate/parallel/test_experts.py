"""Expert parallelism (issue 14), checked against definitions: torchtitan's FSDP2 wrapping of the experts
(a unit of their own over efsdp, Shard(1) past the experts), the pairs a rank receives under a load
imbalance, torchtitan's rank-major to expert-major permutation, and the knob's validation."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import SpecError
from zeroplan.estimate.engines.fsdp2 import _units
from zeroplan.estimate import estimate_mesh
from zeroplan.estimate.result import RankKind
from zeroplan.estimate.parallel.mesh import rank_facts
from zeroplan.estimate.parallel.experts import saved_per_block_delta
from zeroplan.importers.catalog import resolve_model
from zeroplan.measure.grid_ep import measured_imbalance, with_measured_imbalance
from zeroplan.spec.mesh import MeshSpec
from zeroplan.spec.training import TrainingSpec

MODEL = resolve_model("qwen3moe-tiny")  # 8 experts of width 64, top-2, hidden 128
WHOLE = RankKind(0, (0,), MODEL.num_layers, True, True, 1)


def titan(gpus: int, **mesh) -> TrainingSpec:
    return TrainingSpec(recipe="torchtitan", engine="fsdp2", zero_stage=3, gpus=gpus, loss="standard", mesh=MeshSpec(**mesh))


def block_of(training: TrainingSpec):
    return next(g for g in rank_facts(MODEL, training, WHOLE).groups if g.role == "block")


def test_gathered_block_is_its_dense_part_and_its_local_experts_whole():
    # torchtitan apply_fsdp: fully_shard(experts, mesh=efsdp), then the block over dp_shard. ep 2 on 4 ranks:
    # efsdp 2, fsdp 4; the block's all-gathers return every tensor it holds whole, its 4 experts included
    training = titan(4, ep=2)
    block = block_of(training)
    units = _units(rank_facts(MODEL, training, WHOLE), 4, False, expert_n=2)
    assert units.block_unsharded == sum(t.numel for t in block.tensors)
    experts = sum(t.numel for t in block.tensors if ".experts." in t.name)
    assert experts == 3 * 128 * 64 * 8 // 2
    # each rank's shard: the dense tensors over 4 ranks, the experts over 2 (their rows divide evenly here)
    assert units.block == (block.params - experts) // 4 + experts // 2


def test_experts_shard_on_dim1_once_efsdp_times_ep_exceeds_them():
    # 16 ranks, ep 4: efsdp 4, efsdp x ep = 16 > 8 experts -> Shard(1): gate_up (2, 2i, h) by its 2i rows
    block = {t.name: t for t in block_of(titan(16, ep=4)).tensors}
    assert block["moe.experts.gate_up_proj"].rows == 2 * 64
    assert block["moe.experts.down_proj"].rows == 128
    assert {t.name: t for t in block_of(titan(4, ep=2)).tensors}["moe.experts.gate_up_proj"].rows == 8 // 2


def test_received_pairs_grow_with_the_imbalance():
    # S = 512 pairs sent; the busiest rank receives F x S; each received pair keeps its permuted input (h)
    # and the gate's four intermediate-width tensors, plus the permutation's int64 index
    tokens, comp = 256, 4
    balanced = saved_per_block_delta(MODEL, MeshSpec(ep=2), tokens, comp)
    assert balanced == 512 * 8
    skewed = saved_per_block_delta(MODEL, MeshSpec(ep=2, moe_imbalance=1.5), tokens, comp)
    assert skewed - balanced == 256 * (8 + comp * (128 + 4 * 64))
    assert saved_per_block_delta(MODEL, MeshSpec(), tokens, comp) == 0


def test_imbalance_raises_the_worst_rank():
    low = estimate_mesh(MODEL, titan(2, ep=2)).worst.estimate.peak_bytes
    high = estimate_mesh(MODEL, titan(2, ep=2, moe_imbalance=2.0)).worst.estimate.peak_bytes
    assert high > low


def test_imbalance_beyond_ep_is_refused():
    with pytest.raises(SpecError, match="mesh.moe_imbalance: 3 exceeds ep 2"):
        estimate_mesh(MODEL, titan(2, ep=2, moe_imbalance=3.0))
    result = CliRunner().invoke(cli, ["estimate", "qwen3moe-tiny", "--gpus", "2", "--ep", "2", "--engine", "fsdp2",
                                      "--recipe", "torchtitan", "--moe-imbalance", "0.5"])
    assert result.exit_code == 2 and "--moe-imbalance" in result.output


def test_ep_counts_the_experts_of_a_moe_spec():
    with pytest.raises(SpecError, match="mesh.ep: 3 does not divide the model's num_experts 8"):
        estimate_mesh(MODEL, TrainingSpec(recipe="torchtitan", engine="fsdp2", zero_stage=3, gpus=3, mesh=MeshSpec(ep=3)))


def test_a_run_is_estimated_with_the_imbalance_it_measured():
    notes = ["moe imbalance measured: 1.1445 (the busiest rank's received token-expert pairs over the mean)"]
    assert measured_imbalance(notes) == 1.1445
    assert with_measured_imbalance(titan(4, ep=4), notes).mesh.moe_imbalance == 1.1445
    assert with_measured_imbalance(titan(4), notes).mesh.moe_imbalance == 1.0  # not an EP run


def test_permutation_is_torchtitans_rank_major_to_expert_major():
    torch = pytest.importorskip("torch")
    from zeroplan.measure.engines.mesh_moe import _permute_indices

    # torchtitan models/common/moe/utils.py `_generate_permute_indices`' own example: 2 ranks x 3 local experts,
    # counts [4, 2, 1, 1, 3, 2] (rank-major); expert-major groups start at 0, 7, 4, 8, 6, 11 in the input
    order, per_expert = _permute_indices(torch.tensor([4, 2, 1, 1, 3, 2]), 2, 3, 13)
    assert order.tolist() == [0, 1, 2, 3, 7, 4, 5, 8, 9, 10, 6, 11, 12]
    assert per_expert.tolist() == [5, 5, 3]


def test_backward_prefetches_the_previous_blocks_dense_part_only():
    # FSDP2 prefetches the next unit in reverse post-forward order; the experts' post-forward comes before their
    # block's, so the previous block is prefetched before its experts, and its experts reduce apart
    from zeroplan.estimate.engines.common import setup_of
    from zeroplan.estimate.engines.fsdp2 import _sizes

    training = titan(4, ep=2).varied(precision="fp32")
    facts = rank_facts(MODEL, training, WHOLE)
    sizes = _sizes(facts, setup_of(training)._replace(gpus=4, expert_gpus=2))
    block = block_of(training)
    experts = sum(t.numel for t in block.tensors if ".experts." in t.name)
    assert sizes.block_gathered == 4 * block.params  # fp32, every tensor whole
    assert sizes.block_prefetched == 4 * (block.params - experts)
    assert sizes.block_experts_reduce_in == 4 * experts


def test_recomputed_sparse_block_peaks_where_its_recomputation_stops():
    # measured (gloo, 4 ranks, ep 2 x efsdp 2, bf16, full checkpointing, rank 0 receiving R = 539 pairs): where
    # the recomputation stops at the combine, beyond the block's saved tensors, the block output's gradient
    # (65,536), the sum's contiguous gradient (131,072), the down output and its un-permuted copy (137,984
    # each), the weighted pairs (131,072), the sort's values and the arange (4,096 each), the decoder layer's
    # residual (65,536), the router's discarded logits (4,096) and 16-bit routing weights (1,024): 682,496 bytes
    from zeroplan.estimate.parallel.experts import recompute_end_transient

    mesh = MeshSpec(ep=2, moe_imbalance=539 / 512)
    measured = 65_536 + 131_072 + 2 * 137_984 + 131_072 + 2 * 4_096 + 65_536 + 4_096 + 1_024
    assert recompute_end_transient(MODEL, mesh, 256, 2, 65_536) == measured
    assert recompute_end_transient(MODEL, MeshSpec(), 256, 2, 65_536) == 0
