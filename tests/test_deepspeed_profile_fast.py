"""The DeepSpeed profile, made fast, gives exactly the estimates it gave before.

tests/data/deepspeed_golden.json pins the accuracy-checked profile of commit 23c250b
(zeroplan/estimate/engines/deepspeed.py; the rest of the estimator as of 8273398; checked against DeepSpeed 0.19.8 measurements in
tests/test_accuracy_deepspeed.py), generated before the profile was optimised: every phase, every
category and the per-node bytes of a broad grid of configurations, byte for byte. Regenerated
once since, when activations.py began counting the rotary embedding's cos and sin (the profile's
later speed work was checked against the file before that).

The golden file also depends on activations.py, common.py and facts.py. If one of them changes an
estimate on purpose, check the change against tests/test_accuracy_deepspeed.py and regenerate:

    python tests/test_deepspeed_profile_fast.py
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import given, settings
from hypothesis import strategies as st

from zeroplan.importers.catalog import resolve_model
from zeroplan.estimate import clear_caches, estimate
from zeroplan.estimate.engines import deepspeed
from zeroplan.spec.model import ParamCountSpec
from zeroplan.spec.training import TrainingSpec

GOLDEN = Path(__file__).parent / "data" / "deepspeed_golden.json"

MODELS = ["tiny-llama", "tiny-gpt2", "llama-100m", "llama-2-7b", "mixtral-8x7b", "count-7b"]
# Small buckets as `zeroplan validate` runs them; "tight" adds stage 3 limits that release
# parameters (max live / reuse distance) and a small prefetch; "overlap" doubles stage 1-2 buckets.
KNOBS = {
    "default": {},
    "small": {"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000},
    "tight": {"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000, "stage3_param_persistence_threshold": 0,
              "stage3_prefetch_bucket_size": 20_000, "stage3_max_live_parameters": 30_000,
              "stage3_max_reuse_distance": 30_000},
    "overlap": {"overlap_comm": True, "reduce_bucket_size": 2_000_000},
}
OFFLOADS = {  # (optimizer, params) valid per stage
    0: [("none", "none")],
    1: [("none", "none"), ("cpu", "none")],
    2: [("none", "none"), ("cpu", "none")],
    3: [("none", "none"), ("cpu", "none"), ("nvme", "none"), ("cpu", "cpu"), ("nvme", "nvme"), ("none", "cpu")],
}
STRIDE = 29  # keep every 29th point of the full product (a prime, so values of all dimensions mix)


def _model(name: str):
    if name == "count-7b":
        return ParamCountSpec(name=name, params=6_738_415_616, largest_layer_params=202_383_360)
    return resolve_model(name)


def grid() -> list[tuple[str, dict]]:
    """(model name, TrainingSpec fields) of every point checked."""
    points = []
    dims = itertools.product(
        MODELS, range(4), ["fp32", "bf16", "pure-bf16"], [1, 3], ["none", "full"], ["cpu", "cuda"], KNOBS,
        [1, 3, 8], [2, 8, 64])
    counter = 0
    for index, (model, stage, precision, accum, ckpt, device, knobs, micro, gpus) in enumerate(dims):
        for opt, par in OFFLOADS[stage]:
            counter += 1
            # every llama-2-7b default point with micro-batch 1 (the planner's), a sample of the rest
            always = model == "llama-2-7b" and knobs == "default" and micro == 1 and accum == 1
            if counter % STRIDE and not always:
                continue
            seq = 128 if model.startswith("tiny") else 512
            freeze = [] if always or model == "count-7b" else {0: ["embeddings"], 5: ["blocks"]}.get(index % 11, [])
            points.append((model, {
                "engine": "deepspeed", "zero_stage": stage, "precision": precision, "grad_accum": accum,
                "checkpointing": ckpt, "device": device, "micro_batch": micro, "seq_len": seq, "gpus": gpus,
                "offload_optimizer": opt, "offload_params": par, "freeze": freeze, "deepspeed": KNOBS[knobs]}))
    return points


def record(model: str, fields: dict) -> dict:
    result = estimate(_model(model), TrainingSpec(**fields))
    return {
        "phases": [[f"{p.step.value} {p.phase.value}", *p.categories.as_dict().values()] for p in result.phases],
        "per_node": [result.per_node.cpu_bytes, result.per_node.pinned_bytes, result.per_node.nvme_bytes],
        "notes": list(result.notes),
    }


def _key(model: str, fields: dict) -> str:
    """e.g. "llama-2-7b s3 bf16 ga1 full cuda mb1 n64 opt:cpu par:none freeze:- default"."""
    return " ".join([model, f"s{fields['zero_stage']}", fields["precision"], f"ga{fields['grad_accum']}",
                     fields["checkpointing"], fields["device"], f"mb{fields['micro_batch']}", f"seq{fields['seq_len']}",
                     f"n{fields['gpus']}", f"opt:{fields['offload_optimizer']}", f"par:{fields['offload_params']}",
                     "freeze:" + (",".join(fields["freeze"]) or "-"),
                     next(name for name, knobs in KNOBS.items() if knobs == fields["deepspeed"])])


def test_grid_is_broad():
    points = grid()
    assert len(points) > 1500
    assert len({_key(m, f) for m, f in points}) == len(points)
    seen = {(m, f["zero_stage"], f["offload_optimizer"], f["offload_params"]) for m, f in points}
    assert len(seen) == len(MODELS) * sum(len(v) for v in OFFLOADS.values())


def test_profile_matches_golden():
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    points = grid()
    assert sorted(golden) == sorted(_key(m, f) for m, f in points)
    wrong = [key for (model, fields), key in ((p, _key(*p)) for p in points) if record(model, fields) != golden[key]]
    assert not wrong, f"{len(wrong)} of {len(points)} estimates changed, first: {wrong[0]}"


def test_golden_holds_published_structure():
    """The golden file is not the code checking itself: its stage-3 rows keep ZeRO's ordering
    (ZeRO paper, section 5: each stage holds no more per GPU than the one before)."""
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    peaks = {}
    for name, fields in grid():
        value = golden[_key(name, fields)]
        if name == "llama-2-7b" and fields["deepspeed"] == {} and fields["offload_optimizer"] == "none" \
                and fields["gpus"] == 64 and fields["micro_batch"] == 1 and fields["grad_accum"] == 1 \
                and fields["precision"] == "bf16" and fields["device"] == "cuda" and fields["checkpointing"] == "none" \
                and not fields["freeze"]:
            peaks[fields["zero_stage"]] = max(sum(p[1:]) for p in value["phases"])
    assert sorted(peaks) == [0, 1, 2, 3]
    assert peaks[0] > peaks[1] >= peaks[2] > peaks[3]


def test_fast_path_matches_every_entry_kept(monkeypatch):
    """`_contenders` drops module groups that cannot hold a backward peak; keeping every one (the
    slow reference path) gives the same estimates, whatever the activations module says."""
    points = grid()[::3]
    fast = [record(m, f) for m, f in points]
    clear_caches()
    monkeypatch.setattr(deepspeed, "_contenders", lambda entries, last: tuple(entries))
    try:
        slow = [record(m, f) for m, f in points]
    finally:
        clear_caches()
    assert slow == fast


def test_cached_parts_follow_the_configuration():
    """What the profile caches per model and configuration is looked up, not reused by mistake:
    after other configurations (grad_accum 2 and other micro-batches first) the estimates equal
    those made with empty caches."""
    points = grid()[1::5]
    cold = []
    for model, fields in points:
        clear_caches()
        cold.append(record(model, fields))
    for model, fields in points:
        record(model, dict(fields, grad_accum=2, micro_batch=fields["micro_batch"] + 1))
    assert [record(m, f) for m, f in points] == cold


def test_contenders_keep_ends_of_lines_and_records():
    # head 0, blocks 1-5, embedding 6: blocks 1-3 on one line (slope 10), 4-5 on another
    entries = tuple((i, cost) for i, cost in enumerate([50, 10, 20, 30, 5, 4, 0]))
    assert deepspeed._contenders(entries, 6) == ((0, 50), (6, 0))
    entries = tuple((i, cost) for i, cost in enumerate([5, 10, 20, 30, 5, 40, 0]))
    assert deepspeed._contenders(entries, 6) == ((0, 5), (1, 10), (3, 30), (5, 40), (6, 0))


def _write() -> None:
    data = {_key(m, f): record(m, f) for m, f in grid()}
    GOLDEN.write_text(json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {len(data)} estimates to {GOLDEN}")


if __name__ == "__main__":
    _write()


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
