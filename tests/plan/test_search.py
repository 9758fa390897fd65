"""zeroplan plan: the search decides every configuration exactly as a full estimate would, ranks by the
step-time model (tests/plan/test_step_time.py checks its terms), never aborts on a candidate the spec refuses,
says the smallest change that would fit when nothing does, and the emitted DeepSpeed config reads back to the
same estimate."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from zeroplan.importers.catalog import resolve_model
from zeroplan.plan.policies import Policy
from zeroplan.plan.rates import rates_for
from zeroplan.errors import SpecError
from zeroplan.estimate import FitModel, estimate, fit
from zeroplan.estimate.activations.transformer import memory_checkpointing
from zeroplan.importers.gpus import get_gpu
from zeroplan.importers.options import training_spec_from_options
from zeroplan.plan.search import Limits, Planner, SearchSpace, parse_gpu_counts, plan
from zeroplan.spec.model import ParamCountSpec
from zeroplan.spec.training import Attention, Checkpointing, Device, Engine, Offload, TrainingSpec

GIB = 2**30
H100 = get_gpu("h100-80gb")
ASSUMPTIONS = rates_for(H100)
NONE, SELECTIVE = Policy(Checkpointing.NONE), Policy(Checkpointing.SELECTIVE)


def _cli():
    # The real group: click caches a command's help option the first time it is built, so a
    # test-only group without -h would leave `compare -h` broken for later tests.
    from zeroplan.cli import cli

    return cli


def _grid():
    """(model, training) pairs across engines, stages, offload and checkpointing, micro-batch 1."""
    for name in ("gpt2", "llama-2-7b"):
        model = resolve_model(name)
        for engine, stages in ((Engine.DEEPSPEED, (0, 1, 2, 3)), (Engine.FSDP2, (2, 3)), (Engine.TORCH, (0, 1))):
            for stage in stages:
                offloads = [(Offload.NONE, Offload.NONE)]
                if stage >= 1 and engine != Engine.TORCH:
                    offloads.append((Offload.CPU, Offload.NONE))
                if stage == 3:
                    offloads.append((Offload.CPU, Offload.CPU))
                for opt, params in offloads:
                    for checkpointing in Checkpointing:
                        yield model, TrainingSpec(engine=engine, zero_stage=stage, gpus=8, offload_optimizer=opt,
                                                  offload_params=params, checkpointing=checkpointing, seq_len=1024)


@pytest.mark.parametrize("accum", [1, 3])
def test_peak_is_monotone_and_convex_in_micro_batch(accum):
    """The two properties the search relies on, against full estimates: the peak never shrinks as
    the micro-batch grows (so what fits is a prefix), and its second difference is >= 0 (convex,
    so secants and chords bracket the last micro-batch that fits)."""
    for model, training in _grid():
        estimates = [estimate(model, training.model_copy(update={"micro_batch": m, "grad_accum": accum})) for m in range(1, 10)]
        peaks = [e.peak_bytes for e in estimates]
        assert all(a <= b for a, b in zip(peaks, peaks[1:])), (model.name, training)
        hosts = [(e.per_node.cpu_bytes, e.per_node.nvme_bytes) for e in estimates]  # host limits are searched the same way
        assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(hosts, hosts[1:])), (model.name, training)
        assert all(peaks[i - 1] + peaks[i + 1] >= 2 * peaks[i] for i in range(1, len(peaks) - 1)), (model.name, training)


def test_grad_accum_matters_only_by_being_on():
    """The search groups micro-batches by accumulation on/off; any accumulation count above 1
    must give the same estimate."""
    for model, training in _grid():
        two = estimate(model, training.model_copy(update={"grad_accum": 2}))
        for accum in (3, 16):
            assert estimate(model, training.model_copy(update={"grad_accum": accum})) == two


def test_fit_is_the_estimate_s_peak():
    """The planner decides fits with `fit()`, which skips building the per-phase result."""
    for model, training in _grid():
        for update in ({}, {"micro_batch": 3, "grad_accum": 2}, {"device": Device.CPU}):
            case = training.model_copy(update=update)
            full, decided = estimate(model, case), fit(model, case)
            assert (decided.peak_bytes, decided.per_node) == (full.peak_bytes, full.per_node), (model.name, case)
            assert decided.estimate() == full


# beyond the grid: adapters (their storage and activations), activations offloaded to the host, a CPU run, the paper
_FIT_MODEL_EXTRAS = [
    ("llama-3-8b", dict(gpus=8, zero_stage=3, engine="fsdp2", lora={"rank": 16, "targets": ["q_proj", "v_proj"]},
                        quant={"base_precision": "nf4", "quant_storage": "bf16"})),
    ("llama-3-8b", dict(gpus=8, zero_stage=3, engine="deepspeed", checkpointing="full",
                        lora={"rank": 16, "targets": ["q_proj", "v_proj"]})),
    ("llama-3-8b", dict(gpus=1, zero_stage=0, engine="torch", lora={"rank": 8, "targets": ["all-linear"]},
                        quant={"base_precision": "nf4"})),
    ("llama-3-8b", dict(gpus=8, zero_stage=2, engine="fsdp2", recipe="torchtune", activation_offload="cpu",
                        checkpointing="full")),
    ("gpt2", dict(gpus=2, zero_stage=3, engine="fsdp2", device="cpu", attention="eager")),
    ("llama-2-7b", dict(gpus=64, zero_stage=3, engine="paper")),
]


def test_fit_model_gives_the_estimate_s_peak_at_every_micro_batch():
    """The planner probes one choice's micro-batches through `FitModel`, which keeps what they do not change (the
    set-up per accumulation on or off): each probe must be the full estimate's peak and host bytes, in any order,
    accumulation turning on and off."""
    cases = list(_grid()) + [(resolve_model(name), TrainingSpec(**fields)) for name, fields in _FIT_MODEL_EXTRAS]
    for model, training in cases:
        probes = FitModel(model, training)
        for micro, accum in ((2, 1), (5, 3), (1, 1), (3, 2)):
            full = estimate(model, training.model_copy(update={"micro_batch": micro, "grad_accum": accum}))
            decided = probes.at(micro, accum)
            assert (decided.peak_bytes, decided.per_node) == (full.peak_bytes, full.per_node), (model.name, training, micro)
    with pytest.raises(ValueError, match="a mesh is checked rank by rank"):
        FitModel(resolve_model("llama-3-8b"), TrainingSpec(gpus=8, zero_stage=3, engine="fsdp2", mesh={"tp": 2}))


def test_selective_shares_the_estimate_of_no_checkpointing_only_under_fused_attention():
    """The planner shares estimates between a choice and its memory twin (plan.Planner.memory_twin):
    that is sound only if the two full estimates are equal. Under eager attention selective
    checkpointing drops the s x s softmax output, and under autocast (the torch engine's 16-bit
    runs) it keeps fp32 inputs wider than the kernel's casts: there they must differ."""
    twins = 0
    for model, training in _grid():
        if training.checkpointing != Checkpointing.SELECTIVE:
            continue
        none = training.model_copy(update={"checkpointing": Checkpointing.NONE})
        autocast = training.engine == Engine.TORCH and training.precision != "fp32"
        assert memory_checkpointing(training) == (Checkpointing.SELECTIVE if autocast else Checkpointing.NONE)
        if autocast:  # rotary models keep fp32 q and k; not shared (GPT-2's learned positions would be equal)
            if model.position_embedding == "rotary":
                assert estimate(model, training) != estimate(model, none), (model.name, training)
        else:
            twins += 1
            twin, plain = estimate(model, training), estimate(model, none)
            assert (twin.phases, twin.per_node) == (plain.phases, plain.per_node), (model.name, training)
            assert any("selective keeps what none keeps" in note for note in twin.notes)  # issue 11: said, not silent
        eager = training.model_copy(update={"attention": Attention.EAGER})
        assert memory_checkpointing(eager) == Checkpointing.SELECTIVE
        assert estimate(model, eager) != estimate(model, none.model_copy(update={"attention": Attention.EAGER}))
    assert twins > 10


@pytest.mark.parametrize("attention", [Attention.FUSED, Attention.EAGER])
@pytest.mark.parametrize("micro_batches,max_micro", [("pow2", 256), ("all", 48)])
@pytest.mark.parametrize("budget_gib", [6, 20, 40, 76])
def test_every_verdict_equals_a_full_estimate(micro_batches, max_micro, budget_gib, attention):
    model = resolve_model("llama-2-7b")
    base = TrainingSpec(gpus=8, seq_len=1024, attention=attention)
    space = SearchSpace(gpu_counts=(8, 16), micro_batches=micro_batches, max_micro_batch=max_micro)
    limits = Limits(gpu_memory_bytes=budget_gib * GIB, headroom=0.0)
    planner = Planner(model, base, ASSUMPTIONS)
    evaluated, fitting, _, _ = planner.search(space, limits)
    found = {(hit.choice, hit.micro_batch) for hit in fitting}

    brute, total = set(), 0
    for choice in planner.choices(space, limits)[0]:
        for micro, accum in planner.micro_batches(space, choice.gpus):
            total += 1
            if estimate(model, planner.training(choice, micro, accum)).peak_bytes <= limits.budget_bytes:
                brute.add((choice, micro))
    assert evaluated == total
    assert found == brute
    assert planner.estimate_calls < total / 2  # the shortcut: far fewer full estimates than configurations


def test_host_memory_limit_is_applied():
    model = resolve_model("llama-2-7b")
    planner = Planner(model, TrainingSpec(gpus=8), ASSUMPTIONS)
    space = SearchSpace(gpu_counts=(8,), max_micro_batch=16)
    limits = Limits(gpu_memory_bytes=H100.memory_bytes, cpu_memory_bytes=50 * GIB)
    _, fitting, _, _ = planner.search(space, limits)
    assert fitting
    for hit in fitting:
        node = estimate(model, planner.training(hit.choice, hit.micro_batch, hit.grad_accum)).per_node
        assert node.cpu_bytes <= 50 * GIB
    # llama-2-7b's optimizer states alone are 7e9 x 12 bytes = 78 GiB per node: CPU offload cannot fit in 50 GiB
    assert all(hit.choice.offload_optimizer == Offload.NONE for hit in fitting)


def test_plan_ranks_cheapest_first_each_choice_once_and_reports_the_largest_micro_batch():
    model = resolve_model("llama-2-7b")
    result = plan(model, TrainingSpec(gpus=8), SearchSpace(gpu_counts=(8,)), Limits(H100.memory_bytes), ASSUMPTIONS, top=5)
    costs = [config.step.gpu_seconds_per_token for config in result.top]
    assert costs == sorted(costs)
    assert len({config.choice for config in result.top}) == len(result.top)  # each at its cheapest micro-batch
    assert result.top[0].reason.startswith("cheapest")
    assert all(config.reason.startswith(("+", "same cost")) for config in result.top[1:])
    for config in result.top:
        assert config.worst == estimate(model, config.training)
        assert config.worst.peak_bytes <= result.limits.budget_bytes
    # the largest micro-batch, checked by brute force over powers of two for every valid choice
    planner = Planner(model, TrainingSpec(gpus=8), ASSUMPTIONS)
    largest = max(
        micro
        for choice in planner.choices(SearchSpace(gpu_counts=(8,)), result.limits)[0]
        for micro in (2**p for p in range(11))
        if estimate(model, planner.training(choice, micro, 1)).peak_bytes <= result.limits.budget_bytes
    )
    assert result.largest_micro_batch.micro_batch == largest


@pytest.mark.parametrize("attention", [Attention.FUSED, Attention.EAGER])
def test_selective_checkpointing_is_ranked_only_where_it_saves_memory(attention):
    model = resolve_model("llama-2-7b")
    space = SearchSpace(gpu_counts=(8,), checkpointing=(NONE, SELECTIVE))
    result = plan(model, TrainingSpec(gpus=8, attention=attention), space, Limits(H100.memory_bytes), ASSUMPTIONS, top=50)
    ranked = {config.choice.checkpointing for config in result.top}
    unranked = [note for note in result.notes if "are not ranked" in note]
    if attention == Attention.FUSED:  # the same memory as no checkpointing, more recomputation
        assert ranked == {Checkpointing.NONE} and len(unranked) == 1
        counted = int(unranked[0].split()[0])
        assert result.fitting == 2 * counted  # counted as fitting all the same: as many as without checkpointing
    else:  # eager keeps the s x s scores, which selective drops
        assert Checkpointing.SELECTIVE in ranked and not unranked


def test_global_batch_sets_accumulation():
    model = resolve_model("gpt2")
    result = plan(model, TrainingSpec(gpus=8, seq_len=1024), SearchSpace(gpu_counts=(8,), global_batch=256),
                  Limits(24 * GIB), ASSUMPTIONS)
    for config in result.top:
        assert config.micro_batch * config.grad_accum * config.choice.gpus == 256
    with pytest.raises(SpecError, match="^global_batch: 100 is not divisible by the GPU count"):
        plan(model, TrainingSpec(gpus=8), SearchSpace(gpu_counts=(8,), global_batch=100), Limits(24 * GIB), ASSUMPTIONS)


def test_nothing_fits_suggests_changes_that_fit():
    """llama-2-7b on 4 x 24 GiB without offload or checkpointing does not fit; each suggestion is
    checked by planning with that change, and the GPU count is the smallest doubling that fits."""
    model = resolve_model("llama-2-7b")
    base = TrainingSpec(gpus=4)
    space = SearchSpace(gpu_counts=(4,), offload_targets=(Offload.NONE,), checkpointing=(NONE,))
    limits = Limits(24 * GIB)
    result = plan(model, base, space, limits, ASSUMPTIONS)
    assert result.fitting == 0 and not result.top

    def fits(space=space, limits=limits) -> bool:
        return plan(model, base, space, limits, ASSUMPTIONS).fitting > 0

    assert any(s.startswith("allow CPU offload (--offload cpu)") for s in result.suggestions)
    assert fits(space=replace(space, offload_targets=(Offload.NONE, Offload.CPU)))
    count = int(next(s for s in result.suggestions if s.startswith("use ")).split()[1])
    assert fits(space=replace(space, gpu_counts=(count,)))
    assert not fits(space=replace(space, gpu_counts=(count // 2,)))
    name = next(s for s in result.suggestions if s.startswith("a GPU with more memory")).split("--gpu ")[1].split(",")[0]
    assert fits(limits=replace(limits, gpu_memory_bytes=get_gpu(name).memory_bytes))


def test_parse_gpu_counts():
    assert parse_gpu_counts("8") == (8,)
    assert parse_gpu_counts("8,16,64") == (8, 16, 64)
    assert parse_gpu_counts("8-64") == (8, 16, 32, 64)
    with pytest.raises(SpecError, match="^gpu_counts: cannot read 'eight'"):
        parse_gpu_counts("eight")
    with pytest.raises(SpecError, match="^gpu_counts: cannot read '64-8'"):
        parse_gpu_counts("64-8")


def test_emitted_deepspeed_config_reads_back_to_the_same_estimate(tmp_path):
    path = tmp_path / "ds_config.json"
    runner = CliRunner()
    result = runner.invoke(_cli(), ["plan", "llama-2-7b", "--gpu", "a100-40gb", "--gpus", "8", "--seq-len", "4096",
                                    "--global-batch", "256", "--format", "json", "--emit", "deepspeed", str(path)])
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)["top"][0]
    config = json.loads(path.read_text())
    assert config["zero_optimization"]["stage"] == planned["zero_stage"]
    assert config["train_micro_batch_size_per_gpu"] == planned["micro_batch"]
    assert config["gradient_accumulation_steps"] == planned["grad_accum"]
    # what a DeepSpeed config does not hold (sequence length, checkpointing) comes from the command line
    options = {"gpus": 8, "seq_len": 4096, "checkpointing": planned["checkpointing"], "gpu": "a100-40gb"}
    training = training_spec_from_options(options, path)
    again = estimate(resolve_model("llama-2-7b"), training)
    assert again.peak_bytes == planned["per_gpu"]["peak"]
    # and through the estimate command, as a user would check it
    checked = runner.invoke(_cli(), ["estimate", "llama-2-7b", "--config", str(path), "--gpus", "8", "--seq-len", "4096",
                                     "--checkpointing", planned["checkpointing"], "--gpu-memory", "a100-40gb",
                                     "--format", "json"])
    assert checked.exit_code == 0, checked.output
    checked = json.loads(checked.stdout)
    tensors = {key: checked["per_gpu"][key] for key in planned["per_gpu"]}  # estimate adds the figures on the GPU
    assert (tensors, checked["per_node"]) == (planned["per_gpu"], planned["per_node"])  # one JSON shape


def test_cli_plan_errors_are_one_line():
    runner = CliRunner()
    result = runner.invoke(_cli(), ["plan", "llama-2-7b", "--gpus", "8"])
    assert result.exit_code == 2
    assert "give the GPU: --gpu NAME (e.g. h100-80gb) or --gpu-memory SIZE" in result.output
    result = runner.invoke(_cli(), ["plan", "llama-2-7b", "--gpu", "h100-80g"])
    assert result.exit_code == 2
    assert "Error: --gpu: unknown GPU 'h100-80g'; did you mean h100-80gb" in result.output
    result = runner.invoke(_cli(), ["plan", "llama-2-7b", "--gpu", "h100-80gb", "--global-batch", "64", "--grad-accum", "2"])
    assert result.exit_code == 2
    assert "--global-batch sets the gradient accumulation; do not give --grad-accum too" in result.output
    result = runner.invoke(_cli(), ["plan", "llama-2-7b", "--gpu", "h100-80gb", "--emit", "fsdp", "x.py"])
    assert result.exit_code == 2
    assert "--emit fsdp: plan with --engine fsdp2" in result.output


def test_cli_plan_table_states_assumptions():
    result = CliRunner().invoke(_cli(), ["plan", "gpt2", "--gpu", "l4-24gb", "--gpus", "2", "--network-bandwidth", "25"])
    assert result.exit_code == 0, result.output
    assert "largest micro-batch that fits:" in result.output
    assert "121 TFLOP/s dense bf16" in result.output  # the L4 datasheet's dense BF16 figure
    assert "25 GB/s between nodes" in result.output  # the override


def _concave_standin(model, training):
    """A stand-in estimator whose peak grows with the micro-batch but is not convex (a square root
    and a staircase): the search must stay exact when its convexity-guided probes are wrong."""
    from zeroplan.estimate.result import CategoryBytes, Estimate, ModelSummary, NodeBytes, Phase, PhaseBytes, Step

    shard = {0: 1, 1: 2, 2: 3, 3: 4}[training.zero_stage]
    activations = int(3 * GIB * training.micro_batch**0.5) + GIB * (training.micro_batch // 7)
    phases = (
        PhaseBytes(Step.STEADY, Phase.FORWARD, CategoryBytes(params=40 * GIB // shard, activations=activations)),
        PhaseBytes(Step.STEADY, Phase.OPTIMIZER_STEP, CategoryBytes(params=40 * GIB // shard, optimizer_states=8 * GIB)),
    )
    return Estimate(ModelSummary("standin", 10**9, 10**9, "standin"), "deepspeed", phases, NodeBytes())


@pytest.mark.parametrize("budget_gib", [15, 25, 47, 60])
def test_search_is_exact_without_convexity(budget_gib):
    base = TrainingSpec(gpus=8)
    space = SearchSpace(gpu_counts=(8,), micro_batches="all", max_micro_batch=200, checkpointing=(NONE,))
    limits = Limits(gpu_memory_bytes=budget_gib * GIB, headroom=0.0)
    planner = Planner(ParamCountSpec(params=10**9), base, ASSUMPTIONS, estimator=_concave_standin)
    _, fitting, _, _ = planner.search(space, limits)
    found = {(hit.choice, hit.micro_batch) for hit in fitting}
    brute = {
        (choice, micro)
        for choice in planner.choices(space, limits)[0]
        for micro, accum in planner.micro_batches(space, 8)
        if _concave_standin(None, planner.training(choice, micro, accum)).peak_bytes <= limits.budget_bytes
    }
    assert found == brute


def test_every_policy_is_searched_and_checkpoint_every_turns_full_into_every_nth_block():
    runner = CliRunner()
    common = ["plan", "llama-3.1-8b", "--gpu", "h100-80gb", "--gpus", "8", "--engine", "fsdp2", "--recipe", "torchtitan",
              "--seq-len", "8192", "--format", "json", "--top", "60"]
    rows = json.loads(runner.invoke(_cli(), common).stdout)["top"]
    policies = {(row["checkpointing"], row["checkpoint_every"]) for row in rows}
    assert {("op", None), ("full", 2), ("full", None), ("none", None)} <= policies  # op and every-2 by default
    every = runner.invoke(_cli(), [*common, "--checkpointing", "full", "--checkpoint-every", "4"])
    assert every.exit_code == 0, every.output
    assert {(row["checkpointing"], row["checkpoint_every"]) for row in json.loads(every.stdout)["top"]} == {("full", 4)}
    refused = runner.invoke(_cli(), [*common, "--checkpointing", "none,op", "--checkpoint-every", "4"])
    assert refused.exit_code == 2
    assert "--checkpoint-every chooses which blocks full checkpointing recomputes: put full in --checkpointing" in refused.output


def test_a_gpu_count_that_is_no_multiple_of_a_node_is_searched():
    result = CliRunner().invoke(_cli(), ["plan", "llama-3.1-8b", "--gpu", "h100-80gb", "--gpus", "24,12", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert {row["gpus"] for row in json.loads(result.stdout)["top"]} <= {24, 12}
