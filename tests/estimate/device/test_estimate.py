"""An estimate's ledger as the allocation stream its device figures replay (estimate/device/estimate.py): the side
streams FSDP2 allocates on, the loss's logits-sized tensors, the GPU's memory as the replay's capacity, and what the
device held when the replay ran out. The rules are checked against the installed torch's own source where they
come from it."""

from __future__ import annotations

import inspect
import json

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.estimate import estimate_mesh
from zeroplan.estimate.device.estimate import (FSDP2_ALL_GATHER_STREAM, FSDP2_REDUCE_SCATTER_STREAM, TERM_STREAMS,
                                               ledger_events)
from zeroplan.estimate.device.events import DEFAULT_STREAM, Alloc
from zeroplan.importers.catalog import resolve_model
from zeroplan.measure.grid import GRID, row_specs
from zeroplan.measure.replay_check import replay_pair
from zeroplan.spec.training import TrainingSpec
from tests.paths import REPO

GIB = 2**30


def _events(model: str, **training):
    result = estimate_mesh(resolve_model(model), TrainingSpec(**training))
    rank = result.worst
    return rank.estimate, ledger_events(rank.estimate.ledger, rank.estimate.piece_sizes)


def _source(function) -> str:
    return "".join(line.strip() for line in inspect.getsource(function).splitlines())


def test_fsdp2_allocates_its_collectives_outputs_on_its_side_streams():
    # torch 2.13 _fsdp_collectives.py: the all-gather output under all_gather_copy_in_stream, the reduce-scatter
    # output under reduce_scatter_stream, and the sharded gradients as strided views of that output
    collectives = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    gather = _source(collectives.foreach_all_gather)
    assert gather.index("with device_handle.stream(all_gather_copy_in_stream):") < gather.index("all_gather_output = ")
    reduce = _source(collectives.foreach_reduce)
    opened = reduce.index("with device_handle.stream(reduce_scatter_stream):")
    assert opened < reduce.index("reduce_output = reduce_scatter_comm.allocate(")
    assert "new_sharded_grad = torch.as_strided(reduce_output," in reduce

    _, events = _events("llama-3.1-8b", engine="fsdp2", zero_stage=3, gpus=8, precision="bf16", micro_batch=1,
                        seq_len=2048)
    streams = {}
    for event in events:
        if type(event) is Alloc:
            streams.setdefault(event.key[0], set()).add(event.stream)
    assert streams["all-gather output"] == {FSDP2_ALL_GATHER_STREAM}
    assert streams["sharded gradients"] == {FSDP2_REDUCE_SCATTER_STREAM}
    assert all(found == {DEFAULT_STREAM} for name, found in streams.items() if name not in TERM_STREAMS)


def test_the_sharded_gradients_cache_stays_with_the_reduce_scatter_stream():
    # zero_grad frees the sharded gradients back to the reduce-scatter stream's pool, which the next forward's
    # activations (default stream) cannot use (CUDACachingAllocator.cpp: free blocks are per stream), so reserved
    # sits at least the gradients' bytes above allocated once the steady forward has begun
    result = CliRunner().invoke(cli, ["estimate", "llama-3.1-8b", "--engine", "fsdp2", "--zero", "3", "--gpus", "8",
                                      "--precision", "bf16", "--micro-batch", "1", "--seq-len", "2048",
                                      "--gpu-memory", "h100-80gb", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    optimizer_step = next(p for p in data["phases"] if (p["step"], p["phase"]) == ("steady", "optimizer_step"))
    assert data["per_gpu"]["peak_step"] == "steady"
    assert data["per_gpu"]["reserved"] - data["per_gpu"]["allocated"] >= optimizer_step["grads"]


# DeepSpeed stages 1-3 in bf16 with the default reduce bucket, whose real streams were recorded by `zeroplan validate`
_DEEPSPEED_BF16_ROWS = ("tiny-gpt2/deepspeed-2/bf16/ckpt/2x128/w2", "tiny-llama/deepspeed-2/bf16/selective/2x128/w2/eager",
                        "lora-r64-all-linear/tiny-llama/deepspeed-2/bf16/ckpt/2x128/w2",
                        "tiny-llama/deepspeed-1/bf16/ckpt/2x128/w2", "olmo2-tiny/deepspeed-2/bf16/ckpt/2x128/w2/eager")


def test_the_basic_optimizers_states_are_one_tensor_per_state_of_the_flat_partition():
    # stage_1_and_2.py hands the basic optimizer one flat fp32 partition per param group, and torch's Adam creates
    # each state as its own tensor of that size: two allocations, not one of twice the size
    stage12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    adam = pytest.importorskip("torch.optim.adam")
    assert "param_group['params'] = [self.single_partition_of_fp32_groups[i]]" in inspect.getsource(stage12)
    init = _source(adam.Adam._init_group)
    assert 'state["exp_avg"] = torch.zeros_like(' in init and 'state["exp_avg_sq"] = torch.zeros_like(' in init

    _, events = _events("llama-2-7b", engine="deepspeed", zero_stage=2, gpus=8, precision="bf16")
    states = [e.size_bytes for e in events if type(e) is Alloc and e.key[0] == "optimizer states (basic optimizer)"]
    partition = next(e.size_bytes for e in events if type(e) is Alloc
                     and e.key[0] == "fp32 master partition (single_partition_of_fp32_groups)")
    assert states == [partition, partition]


@pytest.mark.parametrize("row_id", _DEEPSPEED_BF16_ROWS)
def test_deepspeed_bf16_reserved_replay_matches_the_real_stream(row_id):
    # the real run's allocation stream replayed through the same allocator (docs/accuracy.json, the row's recorded
    # `allocator_replay`): about 962 MiB, one reduce bucket reused step after step. A states tensor of twice the
    # partition in the large pool took a piece of the freed bucket and the next backward reserved a second bucket
    record = next(r for r in json.loads((REPO / "docs" / "accuracy.json").read_text())["rows"] if r["id"] == row_id)
    row = next(r for r in GRID if r.id == row_id)
    pair = replay_pair(estimate_mesh(*row_specs(row)), record["record"]["measurement"])
    assert pair.replayed_reserved_bytes is not None
    assert abs(pair.error) <= 0.02, (pair.estimated_reserved_bytes, pair.replayed_reserved_bytes)


_FSDP2_ROOT_REDUCE_ROWS = ("llama-1b/fsdp2-3/bf16/nockpt/2x128/fake64", "llama-1b/fsdp2-2/bf16/ckpt/2x128/fake64",
                           "llama-1b/fsdp2-3/fp32/nockpt/2x128/fake64")


@pytest.mark.parametrize("row_id", _FSDP2_ROOT_REDUCE_ROWS)
def test_fsdp2_root_reduce_scatter_is_in_the_replay(row_id):
    # the real run's stream replayed (docs/accuracy.json, the row's recorded `allocator_replay`): reserved steps up
    # at the end of each backward, where the root's post-backward asks for its reduce-scatter input (embeddings and
    # head, fp32: about 500 MiB, no cached block that large), after backward's peak. The estimate's replay asks for it
    # too (engines/fsdp2.py `_backward`, EngineEstimate.passing); without it the replay was 9-21% low.
    record = next(r for r in json.loads((REPO / "docs" / "accuracy.json").read_text())["rows"] if r["id"] == row_id)
    row = next(r for r in GRID if r.id == row_id)
    estimate = estimate_mesh(*row_specs(row))
    pair = replay_pair(estimate, record["record"]["measurement"])
    assert pair.replayed_reserved_bytes is not None
    assert abs(pair.error) <= 0.06, (pair.estimated_reserved_bytes, pair.replayed_reserved_bytes)
    # the moment is the replay's alone: the backward phase's figures are its peak's
    backward = [m for m in estimate.ranks[0].estimate.ledger if m.phase.value == "backward"]
    assert all(any(term.name == "reduce-scatter input" for term in m.passing[-1]) for m in backward)


def test_loss_parallel_backward_is_three_logits_shards():
    # torch/distributed/tensor/parallel/loss.py `_nll_loss_and_log_softmax_backward`: grad_input (zeros_like the
    # fp32 logits shard), exp(x) and their sum are alive together: three tensors of the shard's shape
    loss = pytest.importorskip("torch.distributed.tensor.parallel.loss")
    body = _source(loss._nll_loss_and_log_softmax_backward)
    assert "grad_input = torch.zeros_like(x)" in body and "(grad_input + torch.exp(x)) * grad_output" in body

    model = resolve_model("llama-3.1-8b")
    estimate, events = _events("llama-3.1-8b", engine="fsdp2", zero_stage=3, gpus=8, precision="bf16", micro_batch=2,
                               seq_len=4096, recipe="torchtitan", loss="standard", mesh={"tp": 8})
    shard = 2 * 4096 * -(-model.vocab_size // 8) * 4
    assert estimate.piece_sizes.logits == shard
    backward = [event.size_bytes for event in events
                if type(event) is Alloc and event.key[0] == "loss parallel: nll_loss and log_softmax backward (fp32)"]
    assert backward[:3] == [shard] * 3


def test_a_gpu_known_by_its_memory_is_the_replays_capacity():
    result = CliRunner().invoke(cli, ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "2", "--gpu-memory", "24GiB",
                                      "--format", "json"])
    assert result.exit_code == 0, result.output
    device = json.loads(result.output)["device_memory"]
    assert device["capacity"] == 24 * GIB - sum(term["bytes"] for term in device["outside"])


def test_what_the_device_held_when_the_replay_ran_out():
    # what torch's OutOfMemoryError reports as in use: no more than the GPU's memory, and only when it ran out
    runner = CliRunner()
    short = json.loads(runner.invoke(cli, ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "2", "--gpu-memory",
                                           "24GiB", "--format", "json"]).output)
    assert short["fits"] is False and short["device_memory"]["ran_out_of_memory"]
    assert 0 < short["device_memory"]["device_at_oom"] <= 24 * GIB < short["per_gpu"]["device"]
    roomy = json.loads(runner.invoke(cli, ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "2", "--gpu-memory",
                                           "h100-80gb", "--format", "json"]).output)
    assert roomy["fits"] is True and roomy["device_memory"]["device_at_oom"] is None


def test_compare_decides_as_estimate_does():
    # issue 22: compare's fit column follows the device figure, as estimate's fits: one decision, two commands
    runner = CliRunner()
    grid = json.loads(runner.invoke(cli, ["compare", "llama-2-7b", "--zero", "1,2,3", "--gpus", "8", "--offload",
                                          "none,cpu", "--gpu", "a100-40gb", "--format", "json"]).output)
    assert grid["fits_on"] == "device"
    for row in grid["rows"]:
        options = ["estimate", "llama-2-7b", "--zero", str(row["zero_stage"]), "--gpus", "8", "--gpu", "a100-40gb",
                   "--offload-optimizer", row["offload_optimizer"], "--offload-params", row["offload_params"],
                   "--format", "json"]
        single = json.loads(runner.invoke(cli, options).output)
        assert (row["fits"], row["device"]) == (single["fits"], single["per_gpu"]["device"]), row["config"]


def test_plan_says_it_decides_on_the_peak():
    # plan keeps the peak (a replay per fit check would halve its speed: bench/results/published_gpu_memory.md)
    result = CliRunner().invoke(cli, ["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8", "--format", "json"])
    data = json.loads(result.output)
    assert data["fits_on"] == "peak"
    assert all(config["per_gpu"]["peak"] <= data["budget"] for config in data["top"])
    text = CliRunner().invoke(cli, ["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8"]).output
    assert "fits = peak <= budget" in text.splitlines()[0]


def _tensors(value, torch) -> list:
    """The tensors in `value`, a tensor or nested lists, tuples and dicts of them (an aten op's arguments or outputs)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item, torch)]
    return []


def _step_temporaries_of_torch(impl: str, numel: int) -> tuple[list[int], int]:
    """The installed torch's AdamW stepping one flat fp32 tensor of `numel` elements (its second step: the states
    exist): the bytes of each tensor of that size its step allocates, and how many of them were alive at once."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    import weakref

    flat = torch.nn.Parameter(torch.randn(numel))
    flat.grad = torch.randn(numel)
    optimizer = torch.optim.AdamW([flat], foreach=impl == "foreach")
    optimizer.step()  # the first step creates exp_avg and exp_avg_sq (states, not temporaries)
    sizes: list[int] = []
    alive = [0, 0]  # now, most at once

    def gone() -> None:
        alive[0] -= 1

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs), torch)}
            for t in _tensors(out, torch):
                if isinstance(t, torch.Tensor) and t.numel() == numel and t.untyped_storage().data_ptr() not in inputs:
                    sizes.append(t.untyped_storage().nbytes())
                    alive[0] += 1
                    alive[1] = max(alive)
                    weakref.finalize(t, gone)
            return out

    flat.grad = torch.randn(numel)
    with Allocations():
        optimizer.step()
    return sizes, alive[1]


@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_deepspeed_step_temporaries_are_the_kernels_tensors_of_the_flat_partition(impl):
    # stage_1_and_2.py `_optimizer_step` hands torch's AdamW one param group whose params are
    # [single_partition_of_fp32_groups[i]]: a list of one flat tensor, so the step's temporaries are tensors the size
    # of the whole partition (foreach: exp_avg_sq_sqrt; for-loop: the sqrt and the quotient), not one per parameter
    stage12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    optimizer_step = _source(stage12.DeepSpeedZeroOptimizer._optimizer_step)
    assert "self.optimizer.param_groups = [original_param_groups[group_no]]" in optimizer_step

    torch_sizes, at_once = _step_temporaries_of_torch(impl, 4096)
    assert torch_sizes and set(torch_sizes) == {4096 * 4}

    # no optimizer in the DeepSpeed JSON: the Trainer's torch AdamW steps, its decay group first (two param groups)
    training = TrainingSpec(engine="deepspeed", zero_stage=2, gpus=8, precision="bf16", optimizer="adamw",
                            optimizer_impl=impl, deepspeed={"client_optimizer": True})
    _, events = _events("llama-2-7b", **training.model_dump())
    # the group being stepped: its fp32 gradient partition is the .grad of its flat fp32 partition
    group = next(e.size_bytes for e in events if type(e) is Alloc
                 and e.key[0] == "fp32 gradient partition (single_partition_of_fp32_groups .grad)")
    # each step the ledger holds allocates the kernel's tensors, alive at once, each the group's partition
    steps: list[list[int] | None] = []
    for event in (e for e in events if "step temporaries" in e.key[0]):
        if type(event) is Alloc:
            if not steps or steps[-1] is None:
                steps.append([])
            steps[-1].append(event.size_bytes)
        elif steps and steps[-1] is not None:
            steps.append(None)
    steps = [step for step in steps if step is not None]
    assert steps and all(step == [group] * at_once for step in steps), (steps, group, at_once)
