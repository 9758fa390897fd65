"""The tensors one block saves, one by one (estimate/activations/tensors.py), against the tensors a real
transformers Llama block saves, and the allocator replay's cut of a term into them (estimate/device/estimate.py).

The tiny Llama (GQA: 4 heads, 2 kv heads) is built through transformers as `zeroplan measure` builds it, and every
tensor autograd saves during its first block's forward is recorded with saved_tensors_hooks (one storage once,
in save order; parameters and the rotary tables, made before the blocks, left out).
"""

from __future__ import annotations

import pytest

from zeroplan.estimate.activations.transformer import TERMS, activation_bytes
from zeroplan.estimate.device.estimate import ledger_events
from zeroplan.estimate.device.events import Alloc
from zeroplan.estimate.ledger import Moment, Term
from zeroplan.estimate.result import PieceSizes, Phase, Step
from zeroplan.measure.grid import Row, row_specs

SAVED = TERMS["saved_per_block"]


def _first_block_saves(name: str, attention: str, precision: str, seq_len: int = 64) -> list[int]:
    """The bytes of each storage the first block's forward saves, in save order, for a micro-batch of 2."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zeroplan.measure.workload import hf_config_kwargs

    model, _ = row_specs(Row(name, "torch", 1, "fp32", attention=attention, seq_len=seq_len))
    model_type, kwargs = hf_config_kwargs(model)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **kwargs),
        attn_implementation="sdpa" if attention == "fused" else "eager", dtype=dtype)
    lm.train()
    skip = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    inside, sizes = [False], []

    def enter(module, args, kwargs):
        skip.update(t.untyped_storage().data_ptr() for t in kwargs["position_embeddings"])  # shared by every block
        inside[0] = True

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if inside[0] and pointer not in skip:
            skip.add(pointer)
            sizes.append(tensor.untyped_storage().nbytes())
        return tensor

    block = lm.model.layers[0]
    block.register_forward_pre_hook(enter, with_kwargs=True)
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        lm(input_ids=torch.randint(0, model.vocab_size, (2, seq_len)), use_cache=False)
    return sizes


def _acts(name: str, attention: str, precision: str, checkpointing: str = "none", seq_len: int = 64):
    engine = "torch" if precision == "fp32" else "deepspeed"  # deepspeed bf16: the model itself in bf16 (no autocast)
    model, training = row_specs(Row(name, engine, 2 if engine == "deepspeed" else 1, precision, attention=attention,
                                    seq_len=seq_len))
    training = training.model_copy(update={"checkpointing": checkpointing})
    return activation_bytes(model, training, 4 if precision == "fp32" else 2)


@pytest.mark.parametrize("attention", ["fused", "eager"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_llama_block_s_tensors_are_those_transformers_saves(attention, precision):
    measured = _first_block_saves("tiny-llama", attention, precision)
    acts = _acts("tiny-llama", attention, precision)
    assert list(acts.saved_tensors) == measured
    assert sum(acts.saved_tensors) == acts.saved_per_block
    assert acts.term_tensors() == ((SAVED, acts.saved_tensors),)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_checkpointed_block_keeps_its_input_and_rebuilds_the_rest(precision):
    # torch.utils.checkpoint: the block's input is saved; its backward rebuilds what the block saves, but for
    # the input itself where the first norm keeps that very tensor (RMSNorm's .float() of an fp32 input)
    measured = _first_block_saves("tiny-llama", "fused", precision)
    acts = _acts("tiny-llama", "fused", precision, checkpointing="full")
    tokens, h = 2 * 64, 128
    assert acts.saved_tensors == (tokens * h * (4 if precision == "fp32" else 2),)
    assert list(acts.recompute_tensors) == (measured[1:] if precision == "fp32" else measured)
    assert dict(acts.term_tensors()) == {SAVED: acts.saved_tensors, TERMS["recompute_block"]: acts.recompute_tensors}


def test_blocks_not_listed_keep_the_residual_pieces():
    # Qwen3's q/k norms, GPT-2's fused c_attn and LayerNorm: not listed one by one (the replay cuts residual pieces)
    assert _acts("qwen3-tiny", "fused", "bf16").term_tensors() == ()
    assert _acts("tiny-gpt2", "fused", "fp32").term_tensors() == ()


def _growth(sizes: PieceSizes, steps: list[int]) -> list[list[int]]:
    """The allocations the replay makes as the block term grows to each of `steps` bytes, moment by moment."""
    ledger = [Moment(Step.STEADY, Phase.FORWARD, (Term(SAVED, "activations", size, ""),)) for size in steps]
    moments: list[int] = []
    events = ledger_events(ledger, sizes, moments)
    bounds = moments + [len(events)]
    return [[e.size_bytes for e in events[a:b] if isinstance(e, Alloc)] for a, b in zip(bounds, bounds[1:])]


def test_the_replay_cuts_a_block_term_into_its_tensors_and_goes_on_where_it_stopped():
    period = (8, 4, 16)  # one block's tensors
    sizes = PieceSizes(tensors=1 << 20, activations=10, term_tensors=((SAVED, period),))
    # a block and a half, then to three blocks: the second moment continues the half block
    assert _growth(sizes, [42, 84]) == [[8, 4, 16, 8, 4, 2], [14, 8, 4, 16]]
    # without the list: residual-stream pieces
    assert _growth(sizes._replace(term_tensors=()), [42]) == [[10, 10, 10, 10, 2]]
