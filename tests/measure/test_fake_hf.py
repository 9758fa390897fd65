"""Simulated ranks run transformers' model as a real run computes it (zeroplan/measure/fake_hf.py)."""

from __future__ import annotations

import pytest

from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.training import TrainingSpec


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gpt2"])
def test_a_fake_run_gives_sdpa_no_mask_as_a_real_run(model_name, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import masking_utils

    from zeroplan.measure.fake_hf import fake_tensor_mode
    from zeroplan.measure.workload import build_workload, make_batch

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    spec, training = resolve_model(model_name), TrainingSpec(engine="fsdp2", zero_stage=3, gpus=8, recipe="plain",
                                                                    micro_batch=2, seq_len=64)
    original = masking_utils.find_packed_sequence_indices
    for fake in (False, True):
        calls.clear()
        with fake_tensor_mode() if fake else torch.device("cpu"):
            model = build_workload(spec, training, torch.device("cpu"), implementation="hf").model
            model(*make_batch(spec, training, torch.device("cpu"))).backward()
        # one call per layer, no mask: SDPA's own causal masking (integrations/sdpa_attention.py)
        assert calls == [(None, True)] * spec.num_layers
    assert masking_utils.find_packed_sequence_indices is original
