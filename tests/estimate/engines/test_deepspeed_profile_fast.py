"""The DeepSpeed profile's fast path gives what its definition gives.

The profile skips module groups that cannot hold a backward peak (`_contenders`) and caches what
does not depend on the activations per model and `Setup`. Over random small models and
configurations, these tests compare it with the direct definition (every module group evaluated,
every cache empty). That the definition itself matches DeepSpeed 0.19.8 is
tests/estimate/engines/test_deepspeed_accuracy.py's job (measured runs).
"""

from __future__ import annotations

from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroplan.estimate import clear_caches, estimate
from zeroplan.estimate.engines import deepspeed
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.model import ParamCountSpec, TransformerSpec
from zeroplan.spec.training import TrainingSpec

# Small buckets as `zeroplan validate` runs them; "tight" adds stage 3 limits that release
# parameters (max live / reuse distance) and a small prefetch; "overlap" doubles stage 1-2 buckets.
KNOBS = [
    {},
    {"reduce_bucket_size": 2_000, "allgather_bucket_size": 2_000},
    {"reduce_bucket_size": 5_000, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 3_000,
     "stage3_max_live_parameters": 20_000, "stage3_max_reuse_distance": 20_000},
    {"reduce_bucket_size": 50_000, "stage3_param_persistence_threshold": 500, "stage3_max_live_parameters": 100_000,
     "stage3_max_reuse_distance": 60_000},
    {"overlap_comm": True, "reduce_bucket_size": 20_000},
]
OFFLOADS = {  # (optimizer, params) valid per stage
    0: [("none", "none")],
    1: [("none", "none"), ("cpu", "none")],
    2: [("none", "none"), ("cpu", "none")],
    3: [("none", "none"), ("cpu", "none"), ("nvme", "none"), ("cpu", "cpu"), ("nvme", "nvme"), ("none", "cpu")],
}


@st.composite
def small_models(draw) -> TransformerSpec | ParamCountSpec:
    """Transformers of every family the layout knows, a few blocks of small widths; or a count."""
    if draw(st.integers(0, 9)) == 0:
        params = draw(st.integers(1_000, 2_000_000))
        return ParamCountSpec(name="count", params=params, largest_layer_params=draw(st.integers(100, params)))
    family = draw(st.sampled_from(["llama", "gpt2", "gpt_neox", "phi3", "mixtral"]))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    kv_heads = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0])) if family != "gpt2" else heads
    experts = draw(st.integers(2, 4)) if family == "mixtral" else 1
    gpt2 = family == "gpt2"
    return TransformerSpec(
        name=f"random-{family}", hf_model_type=family, vocab_size=draw(st.integers(16, 600)),
        hidden_size=heads * head_dim, num_layers=draw(st.integers(1, 6)), num_heads=heads, num_kv_heads=kv_heads,
        intermediate_size=draw(st.integers(8, 300)), max_position_embeddings=draw(st.integers(8, 300)),
        position_embedding="learned" if gpt2 else "rotary", norm="layernorm" if family in ("gpt2", "gpt_neox") else "rmsnorm",
        mlp="gated" if family in ("llama", "phi3", "mixtral") else "gelu", attention_bias=draw(st.booleans()),
        attention_out_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()), num_experts=experts,
        experts_per_token=draw(st.integers(1, experts)))


@st.composite
def deepspeed_trainings(draw) -> TrainingSpec:
    stage = draw(st.integers(0, 3))
    optimizer, params = draw(st.sampled_from(OFFLOADS[stage]))
    gpus = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 64]))
    return TrainingSpec(
        engine="deepspeed", zero_stage=stage, gpus=gpus, gpus_per_node=min(gpus, 8) if gpus != 3 else 3,
        offload_optimizer=optimizer, offload_params=params,
        precision=draw(st.sampled_from(["fp32", "bf16", "fp16", "pure-bf16"])),
        optimizer=draw(st.sampled_from(["adamw", "adam", "sgd", "adam8bit"])),
        micro_batch=draw(st.integers(1, 4)), seq_len=draw(st.sampled_from([8, 32, 64])),
        grad_accum=draw(st.sampled_from([1, 2])), checkpointing=draw(st.sampled_from(["none", "selective", "full"])),
        attention=draw(st.sampled_from(["fused", "eager"])), device=draw(st.sampled_from(["cuda", "cpu"])),
        freeze=draw(st.sampled_from([(), (), ("embeddings",), ("blocks",), ("final",)])),
        deepspeed=draw(st.sampled_from(KNOBS)),
        model_init=draw(st.sampled_from(["host", "device"] + (["zero-init"] if stage == 3 else []))))


def _every_entry_kept(entries, last):
    """The definition `_contenders` shortcuts: every module group is a contender."""
    return tuple(entries)


def _ledger(estimate_):
    """The estimate's terms, phase by phase (Estimate equality compares the bytes, not the ledger)."""
    return [(moment.step, moment.phase, sorted(moment.terms)) for moment in estimate_.ledger]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=small_models(), training=deepspeed_trainings())
def test_fast_walk_equals_every_module_group_evaluated(model, training):
    """`_contenders` drops module groups that cannot hold a backward peak (the proof is in
    docs/engines/deepspeed.md); evaluating every one, with empty caches, gives the same estimate,
    made of the same terms."""
    clear_caches()
    fast = estimate(model, training)
    clear_caches()
    with mock.patch.object(deepspeed, "_contenders", _every_entry_kept):
        slow = estimate(model, training)
    clear_caches()
    assert fast == slow
    assert _ledger(fast) == _ledger(slow)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=small_models(), training=deepspeed_trainings(), others=st.lists(deepspeed_trainings(), max_size=4))
def test_cached_parts_follow_the_configuration(model, training, others):
    """What the profile caches per model and `Setup` is looked up, not reused by mistake: after
    other configurations of the same model, and the same one at grad_accum 3 and another
    micro-batch, the estimate equals the one made with empty caches."""
    clear_caches()
    cold = estimate(model, training)
    for other in [*others, training.model_copy(update={"grad_accum": 3, "micro_batch": training.micro_batch + 1})]:
        estimate(model, other)
    warm = estimate(model, training)
    assert warm == cold
    assert _ledger(warm) == _ledger(cold)


def test_stages_keep_zero_ordering():
    """ZeRO paper, section 5: each stage holds no more per GPU than the one before (llama-2-7b,
    64 GPUs, bf16, micro-batch 1, DeepSpeed's default knobs)."""
    model = resolve_model("llama-2-7b")
    peaks = [estimate(model, TrainingSpec(engine="deepspeed", zero_stage=stage, gpus=64, seq_len=512)).peak_bytes
             for stage in range(4)]
    assert peaks[0] > peaks[1] >= peaks[2] > peaks[3]


def test_contenders_keep_ends_of_lines_and_records():
    # head 0, blocks 1-5, embedding 6: blocks 1-3 on one line (slope 10), 4-5 on another
    entries = tuple((i, cost) for i, cost in enumerate([50, 10, 20, 30, 5, 4, 0]))
    assert deepspeed._contenders(entries, 6) == ((0, 50), (6, 0))
    entries = tuple((i, cost) for i, cost in enumerate([5, 10, 20, 30, 5, 40, 0]))
    assert deepspeed._contenders(entries, 6) == ((0, 5), (1, 10), (3, 30), (5, 40), (6, 0))


@settings(max_examples=500, deadline=None)
@given(numels=st.lists(st.integers(1, 50), min_size=2, max_size=30), ranks=st.integers(1, 300),
       padding=st.integers(0, 3))
def test_owned_elements_by_runs_equal_the_definition(numels, ranks, padding):
    """`_owned_elements` computes each run of interchangeable ranks once; the definition
    (stage_1_and_2.py `copy_grads_in_partition`) is, rank by rank, the sum of the whole tensors
    meeting the rank's slice of the flat group, padded to 2 x ranks (the last rank's slice runs to
    the end). Up to 300 ranks for at most 30 tensors: most slices fall inside one tensor or the
    padding (`padding` more alignments of it, as a larger group would leave)."""
    alignment = 2 * ranks
    partition = (-(-sum(numels) // alignment) + padding) * alignment // ranks
    expected = [0] * ranks
    start = 0
    for numel in numels:
        for rank in range(ranks):
            low, high = rank * partition, (rank + 1) * partition if rank < ranks - 1 else float("inf")
            if start < high and start + numel > low:
                expected[rank] += numel
        start += numel
    runs = deepspeed._owned_elements(tuple(numels), partition, ranks)
    assert all(count >= 1 for count, _ in runs)
    assert len(runs) <= min(ranks, 2 * len(numels) + 1)
    assert tuple(elements for count, elements in runs for _ in range(count)) == tuple(expected)
