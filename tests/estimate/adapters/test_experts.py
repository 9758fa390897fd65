"""LoRA on fused expert stacks: the merged weight W + s*BA that peft 0.21.2's `ParamWrapper` builds
in every forward (tuners/lora/layer.py `_activate_lora`, `_LoraFactorsProxy`) and the experts'
matmuls save for backward (estimate/adapters/experts.py). Checked against its definition (E x out x in
per adapted stack, out x in per router) and against the tensors autograd saves in one Mixtral MoE
block built with transformers and peft on CPU."""

from __future__ import annotations

import pytest

from zeroplan.estimate.adapters.lora import lora_layout
from zeroplan.estimate.adapters.experts import merged_weight_elements
from zeroplan.importers.hf_config import spec_from_hf_config
from zeroplan.spec.lora import LoraSpec

HIDDEN, INNER, EXPERTS, TOP_K = 64, 96, 4, 2
CONFIG = {"model_type": "mixtral", "hidden_size": HIDDEN, "intermediate_size": INNER, "num_local_experts": EXPERTS,
          "num_experts_per_tok": TOP_K, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 128, "max_position_embeddings": 256}
ALL = LoraSpec(rank=4, targets=("all-linear",))


def test_a_block_saves_each_adapted_stack_and_the_router_whole():
    spec = spec_from_hf_config(CONFIG, "mixtral-tiny")
    stacks = EXPERTS * (2 * INNER * HIDDEN + HIDDEN * INNER)  # gate_up_proj (E, 2i, h), down_proj (E, h, i)
    assert merged_weight_elements(lora_layout(spec, ALL).adapted) == stacks + EXPERTS * HIDDEN  # router (E, h)


def test_attention_targets_merge_nothing():
    spec = spec_from_hf_config(CONFIG, "mixtral-tiny")
    assert merged_weight_elements(lora_layout(spec, LoraSpec(rank=4, targets=("q_proj", "v_proj"))).adapted) == 0


def _saved_bytes(block, x) -> int:
    """Bytes of the tensors autograd saves in `block`'s forward that are not parameters (distinct storages)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


def test_the_term_is_what_one_peft_moe_block_saves_beyond_its_tokens():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.MixtralConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    config._experts_implementation = "eager"

    def saved(adapted: bool, tokens: int) -> int:
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(config)
        if adapted:
            model = peft.get_peft_model(model, peft.LoraConfig(r=ALL.rank, target_modules="all-linear")).base_model.model
        else:
            model.requires_grad_(False)
        x = torch.randn(1, tokens, HIDDEN, requires_grad=True)
        return _saved_bytes(model.model.layers[0].mlp, x)

    # what LoRA adds, at two token counts (every expert is hit at both): the part independent of the tokens
    extra = {t: saved(True, t) - saved(False, t) for t in (64, 128)}
    fixed = 2 * extra[64] - extra[128]
    spec = spec_from_hf_config(CONFIG, "mixtral-tiny")
    assert fixed == 4 * merged_weight_elements(lora_layout(spec, ALL).adapted)  # fp32 model, no autocast


def test_a_sparse_block_with_adapted_experts_keeps_its_experts_product():
    # Qwen3-MoE (MoE spec): W' = W + s*BA trains, so the experts' grouped matmuls keep their inputs as full
    # training does; the dense rule that a frozen down_proj drops the MLP's product must not apply, and
    # ParamWrapper runs no per-token A and B. Measured: `zeroplan validate --rows
    # 'lora-r4-all-linear/qwen3moe-tiny/*'` on 1 gloo rank, steady peak 10,772,684 B (backward, activations
    # 6,582,484 B); before this rule the estimate was 5.25% under.
    from zeroplan.estimate import estimate
    from zeroplan.importers.catalog import resolve_model
    from zeroplan.spec.training import TrainingSpec

    training = TrainingSpec(engine="torch", zero_stage=0, gpus=1, precision="fp32", micro_batch=2, seq_len=128,
                            recipe="plain", device="cpu", ddp=False, lora=LoraSpec(rank=4, targets=("all-linear",)))
    peak = estimate(resolve_model("qwen3moe-tiny"), training).peak_bytes
    assert 0 <= peak / 10_772_684 - 1 < 0.03
