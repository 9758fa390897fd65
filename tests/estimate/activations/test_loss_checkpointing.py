"""The loss and checkpointing knobs of the training program (issue 11): --loss chunked and
fused-linear, --checkpointing op (torchtitan's per-op policy), --checkpoint-every N.

The estimator's terms are checked against the definitions in the programs' sources (torchtune
CEWithChunkedOutputLoss, Liger's fused linear cross-entropy, torchtitan's SelectiveAC and
_apply_layer_sac); the measure loop's stand-ins against torch's own loss; and, on 2 gloo ranks,
the estimate against a measurement of the same program (steady peak 3%, first step 5%).
"""

import pytest

from tests.grid_rows import assert_peaks_within_targets, measure_row_comparison

from zeroplan.estimate import estimate
from zeroplan.estimate.activations.transformer import _op_saved_per_token, Widths, activation_bytes
from zeroplan.estimate.result import Step
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.training import Attention, TrainingSpec

LLAMA = resolve_model("tiny-llama")
GPT2 = resolve_model("tiny-gpt2")


def _training(**fields) -> TrainingSpec:
    base = dict(engine="fsdp2", zero_stage=3, gpus=2, device="cpu", precision="bf16", micro_batch=2, seq_len=128,
                recipe="plain")
    return TrainingSpec(**(base | fields))


def _acts(model=LLAMA, **fields):
    training = _training(**fields)
    return activation_bytes(model, training, 2 if training.precision.value == "bf16" else 4)


# -- the loss -----------------------------------------------------------------------------------


def test_chunked_loss_upcasts_one_chunk_at_a_time():
    """CEWithChunkedOutputLoss: the bf16 logits of every chunk exist together and each
    log_softmax output is kept, but only one chunk's fp32 copy at a time (8 chunks by default)."""
    standard, chunked = _acts(loss="standard"), _acts(loss="chunked")
    tokens, vocab = 2 * 128, LLAMA.vocab_size
    assert chunked.logits == standard.logits == tokens * vocab * 2
    assert chunked.loss_saved == standard.loss_saved == tokens * vocab * 4
    assert standard.loss_transient == tokens * vocab * 4
    assert chunked.loss_transient == tokens // 8 * vocab * 4
    assert _training(loss="chunked").program.loss_chunks == 8
    assert _acts(loss="chunked", loss_chunks=2).loss_transient == tokens // 2 * vocab * 4


def test_chunked_loss_changes_nothing_in_fp32_but_the_backward_of_the_loss():
    """In fp32 .float() is the logits themselves: nothing to upcast; backward holds one chunk's
    nll_loss and log_softmax gradients instead of the whole tensor's two."""
    standard, chunked = _acts(loss="standard", precision="fp32"), _acts(loss="chunked", precision="fp32")
    assert chunked.forward_peak == standard.forward_peak
    assert chunked.logits_grad == standard.logits_grad // 8


def test_torchtitan_chunked_loss_runs_each_chunk_s_backward_at_once():
    """torchtitan 0.3.0 ChunkedLossWrapper: no log_softmax output survives the forward; an fp32
    gradient accumulator of the hidden states does, and under FSDP2 mixed precision the head's
    gradient accumulates in fp32 while the chunks run."""
    tune, titan = _acts(recipe="torchtune", loss="chunked"), _acts(recipe="torchtitan", loss="chunked")
    tokens, hidden, vocab = 256, LLAMA.hidden_size, LLAMA.vocab_size
    assert tune.loss_saved == tokens * vocab * 4
    assert titan.loss_saved == tokens * hidden * 4 and titan.logits == 0 and titan.logits_grad == 0
    fp32 = _acts(recipe="torchtitan", loss="chunked", precision="fp32")
    assert titan.loss_transient - vocab * hidden * 4 < fp32.loss_transient  # the fp32 head gradient only under bf16


def test_fused_linear_loss_never_materialises_the_logits():
    """Liger: the gradients are computed in forward; backward keeps grad_input (tokens x hidden)
    and grad_weight (vocab x hidden), no logits and no log_softmax output."""
    acts = _acts(loss="fused-linear")
    tokens, hidden, vocab = 256, LLAMA.hidden_size, LLAMA.vocab_size
    assert acts.logits == 0 and acts.logits_grad == 0
    assert acts.loss_saved == (tokens + vocab) * hidden * 2
    assert acts.forward_peak < _acts(loss="chunked").forward_peak < _acts(loss="standard").forward_peak


def test_fused_linear_chunk_is_liger_s():
    """Liger's own example (ops/fused_linear_cross_entropy.py): BT = 4096 x 4, V = 32000,
    H = 4096 gives chunks of 2048 tokens; never more than BT."""
    pytest.importorskip("torch")
    from zeroplan.measure.losses import fused_chunk_tokens

    assert fused_chunk_tokens(4096 * 4, 4096, 32000) == 2048
    assert fused_chunk_tokens(100, 4096, 1000) == 100


def test_loss_chunks_without_a_chunked_loss_is_refused():
    with pytest.raises(ValueError, match="loss_chunks applies to a chunked loss, not loss fused-linear"):
        _training(loss="fused-linear", loss_chunks=4)


# -- per-op checkpointing -------------------------------------------------------------------------


def test_op_policy_saves_every_other_mm_of_a_llama_block():
    """torchtitan SelectiveAC: q k v o gate up down are mm #1-7 (no biases); the odd ones, q, v,
    gate and down, are saved, with the attention kernel's output and log-sum-exp."""
    w = Widths(resid=2, comp=2, autocast=False)
    q, kv, h, inner = 128, 64, 128, 352
    assert _op_saved_per_token(LLAMA, Attention.FUSED, 128, w) == 2 * (q + kv + inner + h) + 2 * q + 4 * 4


def test_op_policy_saves_every_addmm_of_gpt2():
    """GPT-2's Conv1D runs addmm, which the save list holds and the mm counter does not count;
    eager attention's two bmm (scores and probs @ v) are saved too."""
    w = Widths(resid=4, comp=4, autocast=False)
    h, inner, heads, seq = 128, 512, 4, 256
    assert _op_saved_per_token(GPT2, Attention.EAGER, seq, w) == 4 * (3 * h + h + inner + h) + 4 * (heads * seq + h)


def test_op_keeps_less_than_none_and_more_than_full_under_fused_attention():
    none, op, full = (_acts(checkpointing=mode).blocks_saved for mode in ("none", "op", "full"))
    assert full < op < none


def test_selective_under_fused_attention_is_said_to_change_nothing():
    """Issue 11: `--checkpointing selective` under fused attention gave the number of `none`
    without a word; the estimate now says so, and op does save less."""
    selective = estimate(LLAMA, _training(checkpointing="selective", precision="fp32"))
    none = estimate(LLAMA, _training(checkpointing="none", precision="fp32"))
    assert selective.peak_of(Step.STEADY).total_bytes == none.peak_of(Step.STEADY).total_bytes
    assert any("selective keeps what none keeps" in note for note in selective.notes)
    assert not any("selective" in note for note in estimate(LLAMA, _training(checkpointing="op")).notes)


# -- every Nth block ------------------------------------------------------------------------------


def test_every_nth_block_is_fully_checkpointed():
    """torchtitan v0.2.2 _apply_layer_sac: with N, blocks N, 2N, ... (1-based) are checkpointed."""
    model = resolve_model("llama-100m")
    layers = model.num_layers
    plain, full = _acts(model), _acts(model, checkpointing="full")
    for every in (1, 2, 3):
        mixed = _acts(model, checkpointing="full", checkpoint_every=every)
        checkpointed = layers // every
        expected = full.embedding + (layers - checkpointed) * plain.saved_per_block + checkpointed * full.saved_per_block
        assert mixed.blocks_saved == expected
    assert _acts(model, checkpointing="full", checkpoint_every=1).blocks_saved == full.blocks_saved


def test_every_n_beyond_the_blocks_checkpoints_nothing_and_says_so():
    result = estimate(LLAMA, _training(checkpointing="full", checkpoint_every=5))
    none = estimate(LLAMA, _training())
    assert result.peak_of(Step.STEADY).total_bytes == none.peak_of(Step.STEADY).total_bytes
    assert any("checkpoint_every 5 exceeds the 2 blocks" in note for note in result.notes)


def test_checkpoint_every_needs_full_checkpointing():
    with pytest.raises(ValueError, match="checkpoint_every chooses which blocks full checkpointing recomputes"):
        _training(checkpointing="op", checkpoint_every=2)


# -- measure's stand-ins compute the same loss ------------------------------------------------------


def test_measure_losses_equal_torch_cross_entropy():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from zeroplan.measure import losses

    torch.manual_seed(0)
    hidden = torch.randn(2, 16, 8, requires_grad=True)
    head = torch.nn.Linear(8, 40, bias=False)
    labels = torch.randint(0, 40, (2, 16))
    shifted = losses.shifted_labels(labels)
    reference = F.cross_entropy(head(hidden).float().reshape(-1, 40), shifted.reshape(-1), ignore_index=-100)
    grads = torch.autograd.grad(reference, (hidden, head.weight))
    chunked = losses.chunked_cross_entropy(losses.chunked_logits(hidden, head, 4), shifted)
    fused = losses.fused_linear_cross_entropy(hidden, head, shifted)
    for loss in (chunked, fused):
        assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
        for got, want in zip(torch.autograd.grad(loss, (hidden, head.weight)), grads):
            assert torch.allclose(got, want, atol=1e-6)


# -- on 2 gloo ranks: the estimate against the measured program -------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("row_id", [
    "tiny-llama/fsdp2-3/bf16/nockpt/2x128/w2/chunked-loss",
    "tiny-llama/torch-0/bf16/nockpt/2x128/w2/fused-linear-loss",
    "tiny-llama/fsdp2-3/fp32/op/2x128/w2",
    "tiny-llama/torch-0/bf16/ckpt-every2/2x128/w2",
])
def test_estimate_within_targets_of_the_measured_program(row_id):
    pytest.importorskip("torch")
    comparison, record = measure_row_comparison(row_id)
    assert_peaks_within_targets(comparison)
