"""The estimate's ledger (estimate/terms.py, estimate/ledger.py): named terms that fold exactly into every
figure of the estimate, in every engine, mesh and adapter configuration; the planner's fast mode gives the
same bytes without names."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.estimate import estimate, fit
from zeroplan.estimate.ledger import allocation_events
from zeroplan.estimate import estimate_mesh
from zeroplan.estimate.result import CATEGORY_NAMES
from zeroplan.estimate.serialize import estimate_to_dict
from zeroplan.estimate.terms import UNNAMED, Terms, named, naming, naming_on, parts_of
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.training import TrainingSpec

# --- the arithmetic -----------------------------------------------------------------------------


def test_named_is_the_int_itself_outside_naming_mode():
    assert not naming_on()
    assert named("x", 7) == 7 and type(named("x", 7)) is int


def test_terms_do_the_int_arithmetic_exactly():
    rng = random.Random(3)
    for _ in range(2000):
        values = [rng.randint(-10**12, 10**12) for _ in range(4)]
        factor, divisor = rng.randint(0, 9), rng.randint(1, 13)
        with naming():
            a = named("a", values[0]) + named("b", values[1])
            b = named("c", values[2]) - named("a", values[3])
            total = (a * factor - b) // divisor
        assert int(total) == ((values[0] + values[1]) * factor - (values[2] - values[3])) // divisor
        assert sum(parts_of(total).values()) == int(total)
        assert (a > b) == (values[0] + values[1] > values[2] - values[3])
        assert max(a, b) == max(values[0] + values[1], values[2] - values[3])


def test_terms_keep_their_names_through_sums_and_scaling():
    with naming():
        saved = named("saved", 10) * 3 + named("ids", 4)
        half = saved // 2
    assert parts_of(saved) == {"saved": 30, "ids": 4}
    assert parts_of(half) == {"saved": 15, "ids": 2}
    assert isinstance(saved, Terms) and f"{saved:,}" == "34"


def test_a_plain_int_in_naming_mode_is_unnamed():
    with naming():
        value = named("a", 5) + 3
    assert parts_of(value) == {"a": 5, UNNAMED: 3}


# --- the ledger of real estimates ----------------------------------------------------------------

CONFIGURATIONS = [
    ("llama-2-7b", dict(gpus=8, zero_stage=3)),
    ("llama-2-7b", dict(gpus=8, zero_stage=2, offload_optimizer="cpu", checkpointing="full")),
    ("llama-2-7b", dict(gpus=16, zero_stage=3, offload_optimizer="nvme", offload_params="nvme")),
    ("llama-2-7b", dict(gpus=4, zero_stage=0, precision="fp16")),
    ("llama-2-7b", dict(gpus=4, zero_stage=1, engine="torch", precision="fp32")),
    ("llama-3-8b", dict(gpus=8, zero_stage=3, engine="fsdp2", grad_accum=4)),
    ("llama-3-8b", dict(gpus=8, zero_stage=3, engine="fsdp2", offload_optimizer="cpu", offload_params="cpu")),
    ("mixtral-8x7b", dict(gpus=64, zero_stage=3, engine="fsdp2")),
    ("gpt2", dict(gpus=2, zero_stage=3, engine="fsdp2", device="cpu", attention="eager")),
    ("llama-3-8b", dict(gpus=8, zero_stage=3, engine="fsdp2", lora={"rank": 16, "targets": ["q_proj", "v_proj"]},
                        quant={"base_precision": "nf4", "quant_storage": "bf16"})),
    ("llama-3-8b", dict(gpus=8, zero_stage=3, engine="deepspeed", lora={"rank": 16, "targets": ["q_proj", "v_proj"]})),
    ("llama-3-8b", dict(gpus=1, zero_stage=0, engine="torch", lora={"rank": 8, "targets": ["all-linear"]}, quant={"base_precision": "nf4"})),
    ("llama-3-70b", dict(gpus=64, zero_stage=3, engine="fsdp2", recipe="torchtitan", seq_len=8192,
                         mesh={"tp": 8, "pp": 4}, grad_accum=8)),
    ("llama-3-8b", dict(gpus=32, zero_stage=3, engine="fsdp2", recipe="torchtitan", grad_accum=8,
                        mesh={"pp": 4, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2})),
    ("llama-3-8b", dict(gpus=16, zero_stage=3, engine="fsdp2", seq_len=16384, mesh={"cp": 2})),
    ("mixtral-8x7b", dict(gpus=64, zero_stage=3, engine="fsdp2", recipe="torchtitan", mesh={"ep": 8})),
    ("llama-3-8b", dict(gpus=8, zero_stage=2, engine="deepspeed", mesh={"tp": 2})),
    ("llama-3-8b", dict(gpus=8, zero_stage=3, engine="deepspeed", seq_len=8192, mesh={"cp": 2})),
]


@pytest.mark.parametrize("name, fields", CONFIGURATIONS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGURATIONS)])
def test_every_rank_s_terms_fold_into_its_figures(name, fields):
    model, training = resolve_model(name), TrainingSpec(**fields)
    result = estimate_mesh(model, training)
    data = estimate_to_dict(result, training)
    for rank in [data] + data["ranks"]:
        for category in CATEGORY_NAMES:
            assert sum(t["bytes"] for t in rank["terms"] if t["category"] == category) == rank["per_gpu"][category]
        assert sum(t["bytes"] for t in rank["terms"]) == rank["per_gpu"]["peak"]
    for rank in result.ranks:
        for moment, phase in zip(rank.estimate.ledger, rank.estimate.phases):
            assert moment.categories() == phase.categories
            for term in moment.terms:
                assert term.name != UNNAMED, (rank.kind.label, moment.step, moment.phase, term)
                assert term.bytes > 0 and term.source, term


@pytest.mark.parametrize("name, fields", CONFIGURATIONS[:12], ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGURATIONS[:12])])
def test_the_fast_fit_gives_the_named_estimate_s_bytes(name, fields):
    model, training = resolve_model(name), TrainingSpec(**fields)
    named_estimate, fast = estimate(model, training), fit(model, training)
    assert named_estimate.ledger is not None and fast.estimate().ledger is None
    assert fast.peak_bytes == named_estimate.peak_bytes and fast.estimate() == named_estimate


def test_allocation_events_replay_every_moment():
    """Reading the ledger as allocations and frees, the live bytes after each moment's events are that moment's."""
    model = resolve_model("llama-2-7b")
    result = estimate(model, TrainingSpec(gpus=8, zero_stage=3, grad_accum=2))
    live = 0
    events = allocation_events(result.ledger)
    for index, phase in enumerate(result.phases):
        live += sum(e.bytes if e.allocate else -e.bytes for e in events if e.moment == index)
        assert live == phase.total_bytes


# --- the command line ----------------------------------------------------------------------------


def test_explain_lists_the_peak_s_terms_largest_first():
    result = CliRunner().invoke(cli, ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3", "--explain"])
    assert result.exit_code == 0, result.output
    section = result.output.split("Where the bytes go at the peak")[1].split("\n\n")[0]
    data = json.loads(CliRunner().invoke(cli, ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3",
                                               "--format", "json"]).output)
    names = [line.split("  ")[0] for line in section.splitlines()[3:]]
    assert names == [term["name"] for term in data["terms"]]
    assert data["terms"] == sorted(data["terms"], key=lambda term: -term["bytes"])


def test_the_json_of_plain_data_parallelism_has_one_rank_kind():
    data = json.loads(CliRunner().invoke(cli, ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3",
                                               "--format", "json"]).output)
    assert len(data["ranks"]) == 1 and data["worst_rank"] == 0 and data["ranks"][0]["ranks"] == 8
    assert data["ranks"][0]["per_gpu"] == data["per_gpu"] and data["ranks"][0]["terms"] == data["terms"]
