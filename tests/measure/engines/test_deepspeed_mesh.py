"""DeepSpeed AutoTP in `zeroplan measure` on 2 real gloo ranks (measure/engines/deepspeed_mesh.py): the run gets past
AutoTP's check that a TP group was fed one batch, and each rank holds the layout of Llama's tp_plan."""

from __future__ import annotations

import pytest

from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec

TINY = TransformerSpec(
    name="tiny-llama", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    intermediate_size=128, max_position_embeddings=64, position_embedding="rotary", norm="rmsnorm",
    mlp="gated", tie_word_embeddings=False, hf_model_type="llama",
)


@pytest.mark.distributed
def test_autotp_rank_holds_the_whole_embedding_and_half_of_each_linear(deepspeed_ops):
    deepspeed_ops("deepspeed_shm_comm")
    pytest.importorskip("deepspeed")
    from zeroplan.measure.launcher import run_measurement

    training = TrainingSpec(engine="deepspeed", zero_stage=1, gpus=2, micro_batch=2, seq_len=32, device="cpu",
                            precision="fp32", recipe="plain", model_init="device", mesh={"tp": 2},
                            deepspeed={"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000})
    result = run_measurement(TINY, training, nproc=2, backend="gloo", steps=2, timeout_s=400)
    h, v, kv, ffn = 64, 512, 2 * 16, 128
    # Llama's tp_plan (LlamaConfig.base_model_tp_plan, LlamaForCausalLM._tp_plan): q/k/v, gate/up, lm_head colwise,
    # o/down rowwise, each halved over tp 2; the embedding and the norms are in no plan and stay whole
    linears = h * h + 2 * kv * h + h * h + 3 * h * ffn
    local = v * h + 2 * (linears // 2 + 2 * h) + h + v * h // 2
    for rank in result.ranks:
        forward = next(p for p in rank.phases if p.step == 2 and p.phase == "forward")
        assert forward.categories["params"] == 4 * local
