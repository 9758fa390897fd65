"""float8 training (torchao) and async tensor parallelism (issue 23): derived from the source, as neither runs
on CPU; these check the terms against the definitions they come from (docs/engines/programs.md) and the bad
input they refuse."""

from __future__ import annotations

import pytest

from zeroplan.estimate import estimate, estimate_mesh
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.training import TrainingSpec


def _training(**fields) -> TrainingSpec:
    base = dict(engine="fsdp2", zero_stage=3, gpus=8, micro_batch=1, seq_len=2048, recipe="torchtitan", loss="standard")
    return TrainingSpec(**{**base, **fields})


def _term(found, name: str) -> int:
    """The largest bytes of term `name` over the estimate's moments."""
    return max((term.bytes for moment in found.ledger for term in moment.terms if term.name == name), default=0)


def _wide_model():
    """Four wide blocks and a small vocabulary: the blocks' all-gathers, not the embeddings', hold the buffers."""
    from zeroplan.importers.catalog import spec_from_data

    return spec_from_data({"kind": "transformer", "name": "wide", "hf_model_type": "llama", "vocab_size": 512,
                           "hidden_size": 4096, "num_layers": 4, "num_heads": 32, "num_kv_heads": 8,
                           "intermediate_size": 14336, "max_position_embeddings": 4096, "position_embedding": "rotary",
                           "norm": "rmsnorm", "mlp": "gated", "tie_word_embeddings": False}, "wide")


def test_float8_all_gather_gathers_the_linears_in_one_byte():
    model = _wide_model()
    # torchao fsdp_utils.py: the seven linears of a block (q, k, v, o, gate, up, down) gathered in float8
    h, inner, kv = 4096, 14336, 1024
    linears = 2 * h * h + 2 * h * kv + 3 * h * inner
    bf16 = estimate(model, _training(float8={}))
    f8 = estimate(model, _training(float8={"fsdp_all_gather": True}))
    saved = max(p.categories.buffers for p in bf16.phases) - max(p.categories.buffers for p in f8.phases)
    # each gathered copy of a block (all-gather output, unsharded parameters) is 1 byte lighter per linear weight
    assert saved > 0 and saved % linears == 0


def test_float8_casts_are_the_largest_linears():
    from zeroplan.estimate.activations.transformer import activation_bytes

    model = resolve_model("llama-3-8b")
    tokens, h, inner = 2048, 4096, 14336
    plain = activation_bytes(model, _training(), 2)
    cast = activation_bytes(model, _training(float8={}), 2)
    # forward: down_proj's input (T x inner) and weight (h x inner) cast to 1 byte
    assert cast.block_forward_transient - plain.block_forward_transient == tokens * inner + h * inner
    # backward: the output gradient twice, the weight and the input of the largest: gate/up (h -> inner) here
    assert cast.block_backward_transient - plain.block_backward_transient == max(
        2 * tokens * inner + h * inner + tokens * h, 2 * tokens * h + h * inner + tokens * inner)
    gathered = activation_bytes(model, _training(float8={"fsdp_all_gather": True}), 2)  # weights arrive in float8
    assert gathered.block_forward_transient - plain.block_forward_transient == tokens * inner


def test_float8_saved_in_float8_keeps_each_linears_own_copy():
    from zeroplan.estimate.activations.transformer import activation_bytes

    model = resolve_model("llama-3-8b")
    tokens, h, inner, q = 2048, 4096, 14336, 4096
    hp = activation_bytes(model, _training(float8={}), 2)
    f8 = activation_bytes(model, _training(float8={"saved": "float8"}), 2)
    copies = tokens * (3 * h + q + 2 * h + inner)  # q, k, v, o, gate, up and down read their own 1-byte copies
    dropped = tokens * 2 * (2 * h + q + inner)  # the 2-byte tensors only the linears kept
    assert f8.saved_per_block - hp.saved_per_block == copies - dropped


def test_async_tp_workspace_is_two_output_chunks():
    model = resolve_model("llama-3-70b")
    training = _training(gpus=64, mesh={"tp": 8, "async_tp": True}, compile=("model",), micro_batch=2, seq_len=8192)
    found = estimate_mesh(model, training).worst.estimate
    # get_symm_mem_workspace: 2 x (tokens / tp) x h x 2 bytes, kept once made
    assert _term(found, "async TP symmetric-memory workspace") == 2 * (2 * 8192 // 8) * 8192 * 2


@pytest.mark.parametrize("fields,message", [
    (dict(float8={"recipe": "rowwise", "fsdp_all_gather": True}), "float8 with tensorwise scaling only"),
    (dict(float8={"precompute_scale": True}), "precompute_scale applies to float8 all-gather"),
    (dict(float8={}, device="cpu"), r"float8 matmuls \(torch._scaled_mm\) do not run on CPU"),
    (dict(float8={"fsdp_all_gather": True}, engine="torch", zero_stage=0, gpus=1), "float8 all-gather is FSDP2's"),
    (dict(mesh={"tp": 8, "async_tp": True}), "async tensor parallelism is an inductor pass: set compile"),
    (dict(mesh={"async_tp": True}, compile=("model",)), "async tensor parallelism needs tp above 1"),
])
def test_bad_input(fields, message):
    with pytest.raises(ValueError, match=message):
        _training(**fields)


def test_cli_float8_options():
    from click.testing import CliRunner

    from zeroplan.cli import cli

    result = CliRunner().invoke(cli, ["estimate", "llama-3-8b", "--gpus", "8", "--engine", "fsdp2", "--zero", "3",
                                      "--float8-all-gather"])
    assert result.exit_code == 2
    assert "--float8-fsdp-all-gather sets a knob of float8 training; give --float8 RECIPE" in result.output
