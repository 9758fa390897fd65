"""torch.compile (issue 23): what inductor's compiled block and loss keep, against the graphs inductor runs on
this CPU (torch 2.13.0), the allocator's own count against the dispatch-mode accounting, and the estimate
against the grid's compiled rows (docs/engines/programs.md, "torch.compile")."""

from __future__ import annotations

import shutil

import pytest

from zeroplan.estimate import estimate
from zeroplan.estimate.activations.compiled import compiled_block_saved_per_token
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.training import TrainingSpec


def _saved_per_token(module, x, rope, params) -> int:
    """Bytes per token of the tensors `module`'s forward saves for backward, parameters left out."""
    import torch

    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x, rope)
    return sum(size for ptr, size in storages.items() if ptr not in params) // (x.shape[0] * x.shape[1])


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_a_compiled_llama_block_saves_what_the_estimate_says(tmp_path, monkeypatch, dtype_name):
    torch = pytest.importorskip("torch")
    from zeroplan.measure.reference_model import ReferenceCausalLM

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    spec = resolve_model("tiny-llama")
    dtype = getattr(torch, dtype_name)
    lm = ReferenceCausalLM(spec).to(dtype)
    block = lm.layers[0]
    x = torch.randn(2, 128, spec.hidden_size, dtype=dtype, requires_grad=True)
    rope = lm._rope(128, dtype)  # cos and sin: tables shared by the blocks (the estimate's embedding term)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    params |= {t.untyped_storage().data_ptr() for t in rope}
    compiled = torch.compile(block, fullgraph=True)
    eager = _saved_per_token(block, x, rope, params)
    # What the forward saves is fixed when AOTAutograd partitions the joint graph, before inductor writes its
    # kernels (torch/_inductor/compile_fx.py, `partition_fn`, then `fw_compiler_base`): scalar C++ loops save
    # what vectorised ones do. They spare the probe builds of every vector ISA (cpu_vec_isa.py
    # `valid_vec_isa_list`) and compile sooner, in this process rather than a pool started for them.
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    try:
        with torch._inductor.config.patch(compile_threads=1, **{"cpp.vec_isa_ok": False}):
            measured = _saved_per_token(compiled, x, rope, params)
    finally:
        valid_vec_isa_list.cache_clear()  # found empty under the patch: not the list of later compiles in this process
    size = dtype.itemsize
    assert measured == compiled_block_saved_per_token(spec, size, size)
    assert measured < eager  # the norms' upcasts and SiLU's output are recomputed, not kept


def _training(**fields) -> TrainingSpec:
    return TrainingSpec(engine="torch", zero_stage=0, gpus=1, ddp=False, micro_batch=2, seq_len=128, device="cpu",
                        recipe="plain", **fields)


@pytest.mark.parametrize("precision,components,measured", [
    ("fp32", ("model",), 12_017_376),
    ("fp32", ("model", "loss"), 11_498_232),
    ("bf16", ("model",), 10_952_416),  # autocast: fp32 block input, 16-bit matmul inputs and weight casts
    ("bf16", ("model", "loss"), 10_110_432),
], ids=["fp32-model", "fp32-model-loss", "autocast-model", "autocast-model-loss"])
def test_compiled_rows_are_within_half_a_percent(precision, components, measured):
    # grid rows tiny-llama/torch-0/<precision>/nockpt/2x128/w1/noddp/compile-* (docs/accuracy.md): steady peak
    found = estimate(resolve_model("tiny-llama"), _training(precision=precision, compile=components))
    steady = max(sum(p.categories[:6]) for p in found.phases if p.step.value == "steady")
    assert steady == pytest.approx(measured, rel=0.005)


def test_the_allocator_accounting_matches_the_dispatch_accounting_on_one_thread():
    torch = pytest.importorskip("torch")
    from zeroplan.measure.accounting import TensorAccounting
    from zeroplan.measure.allocations import AllocatorAccounting

    def run(accounting_type):
        torch.manual_seed(0)
        with accounting_type() as accounting:
            model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            accounting.begin_phase("forward", default_category="activations")
            loss = model(torch.randn(64, 256)).square().mean()
            forward = accounting.end_phase()
            accounting.begin_phase("backward", default_category="activations", born_as="temporaries")
            loss.backward()
            del loss
            backward = accounting.end_phase()
        if isinstance(accounting, AllocatorAccounting):
            forward, backward = accounting.finish()
        return forward.peak_bytes - forward.start_bytes, backward.peak_bytes - forward.start_bytes

    # (a few bytes apart: the allocator also sees what a kernel allocates without returning it)
    assert run(AllocatorAccounting) == pytest.approx(run(TensorAccounting), abs=64)


def test_compile_is_refused_where_it_is_not_modelled():
    with pytest.raises(ValueError, match="compile: torch.compile of the blocks and the loss is modelled for engines fsdp2"):
        TrainingSpec(engine="deepspeed", zero_stage=2, compile=("model",))
    with pytest.raises(ValueError, match="names a component twice"):
        TrainingSpec(engine="fsdp2", zero_stage=3, compile=("model", "model"))
    notes = estimate(resolve_model("tiny-gpt2"), _training(compile=("model",))).notes
    assert any("estimated as eager" in note for note in notes)
