"""`plan --emit fsdp` writes the FSDP2 wrapping its estimate assumed (`TrainingSpec.fsdp2_wrapping`).

The round trip: run the emitted `apply_plan` on a real model (one process, fake process group: only
the wrapping is built, no step runs), read back from torch which modules became FSDP units and
which reshard after forward, and estimate that wrapping given explicitly: the same estimate as the plan's.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.estimate import estimate
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.fsdp2_snippet import write_fsdp2_snippet
from zeroplan.spec.program import FSDP2Units, FSDP2Wrapping
from zeroplan.spec.training import TrainingSpec


def _wrapped(model_name: str, training: TrainingSpec, source: str) -> FSDP2Wrapping:
    """Apply the snippet `source` to the model and read its wrapping back from torch's FSDP state."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zeroplan.measure.engines.fsdp2_engine import outer_modules
    from zeroplan.measure.workload import build_workload

    namespace: dict[str, object] = {}
    exec(compile(source, "<fsdp2 plan>", "exec"), namespace)
    model = build_workload(resolve_model(model_name), training, torch.device("cpu"), implementation="hf").model
    blocks = model.transformer_blocks
    embeddings, head = outer_modules(model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=training.gpus)
    try:
        split = training.fsdp2_wrapping.units == FSDP2Units.SPLIT
        namespace["apply_plan"](model, blocks, embeddings, head) if split else namespace["apply_plan"](model, blocks)

        def reshards(module) -> bool | None:  # None: the unit holds no parameters
            assert isinstance(module, FSDPModule)
            group = module._get_fsdp_state()._fsdp_param_group
            return None if group is None else group.post_forward_mesh_info is not None

        assert {reshards(block) for block in blocks[:-1]} == {training.zero_stage == 3}
        root = reshards(model)
        return FSDP2Wrapping(units=FSDP2Units.SPLIT if root is None else FSDP2Units.ROOT,
                             reshard_root=training.zero_stage == 3 if root is None else root,
                             reshard_head=reshards(head[-1]) if root is None else False,
                             reshard_last_block=reshards(blocks[-1]))
    finally:
        dist.destroy_process_group()


def _explicit(training: TrainingSpec, wrapping: FSDP2Wrapping) -> TrainingSpec:
    """`training` with the read-back wrapping given as FSDP2 knobs (the recipe's wrapping defaults unused)."""
    knobs = {"units": wrapping.units.value, "reshard_last_block": wrapping.reshard_last_block}
    if wrapping.units == FSDP2Units.SPLIT:
        knobs["reshard_head_after_forward"] = wrapping.reshard_head
    else:
        knobs["reshard_root_after_forward"] = wrapping.reshard_root
    return training.varied(fsdp2=knobs)


@pytest.mark.parametrize("model_name, fields", [
    ("tiny-llama", {"zero_stage": 3}),  # hf-trainer: accelerate's split units
    ("tiny-llama", {"zero_stage": 2}),
    ("tiny-gpt2", {"zero_stage": 3}),  # tied: one [embeddings, final norm, head] unit
    ("tiny-llama", {"zero_stage": 3, "recipe": "torchtitan"}),
    ("tiny-llama", {"zero_stage": 3, "recipe": "plain", "fsdp2": {"reshard_last_block": False}}),
    ("tiny-llama", {"zero_stage": 3, "recipe": "torchtune", "fsdp2": {"reshard_root_after_forward": False}}),
])
def test_the_emitted_snippet_reads_back_to_the_same_estimate(model_name, fields):
    training = TrainingSpec(engine="fsdp2", gpus=4, device="cpu", micro_batch=2, seq_len=128, **fields)
    wrapping = _wrapped(model_name, training, write_fsdp2_snippet(training))
    assert wrapping == training.fsdp2_wrapping
    model = resolve_model(model_name)
    assert estimate(model, _explicit(training, wrapping)).peak == estimate(model, training).peak


def test_plan_emits_the_split_wrapping_of_the_hf_trainer_recipe(tmp_path):
    path = tmp_path / "plan.py"
    result = CliRunner().invoke(cli, ["plan", "tiny-llama", "--engine", "fsdp2", "--gpus", "4", "--gpu-memory", "1GiB",
                                      "--device", "cpu", "--emit", "fsdp", str(path)])
    assert result.exit_code == 0, result.output
    source = path.read_text()
    assert "def apply_plan(model, blocks, embeddings, head, lr=1e-4):" in source
    assert "fully_shard(head, reshard_after_forward=False" in source  # accelerate: the tail stays gathered
