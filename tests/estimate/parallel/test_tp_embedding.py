"""The rowwise embedding's whole gradient under tensor parallelism (estimate/parallel/tp_embedding.py) against the
2-rank gloo run of torch 2.13.0 (grid row mesh-tp2/tests/data/tiny-llama-16k.toml/...; docs/measure.md
"Embedding gradient under TP")."""

from __future__ import annotations


from zeroplan.estimate import estimate_mesh
from zeroplan.estimate.model.facts import model_facts
from zeroplan.estimate.parallel.tp_embedding import with_replicated_embedding_grad
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.mesh import MeshSpec
from zeroplan.spec.training import TrainingSpec
from tests.paths import DATA

_TINY_LLAMA_16K = str(DATA / "tiny-llama-16k.toml")


def _training(tp: int = 2) -> TrainingSpec:
    return TrainingSpec(engine="fsdp2", zero_stage=3, gpus=2, precision="fp32", micro_batch=2, seq_len=128,
                        device="cpu", recipe="torchtitan", loss="standard", mesh={"tp": tp} if tp > 1 else {})


def test_the_whole_gradient_adds_the_other_ranks_vocabulary_rows():
    model = resolve_model(_TINY_LLAMA_16K)
    facts = model_facts(model, _training(1))

    def extra(spec, mesh):
        return with_replicated_embedding_grad(facts, spec, mesh).replicated_grad_params

    assert extra(model, MeshSpec(tp=2)) == 8192 * 128
    assert extra(model, MeshSpec()) == 0
    tied = model.model_copy(update={"tie_word_embeddings": True})
    assert extra(tied, MeshSpec(tp=2)) == 0


def test_the_whole_gradient_is_a_term_of_the_layout_not_a_guess_from_totals():
    """The replicated gradient is in the rank's layout (its gradient elements beyond its parameters'), so the
    engine counts it wherever every gradient is present, and the ledger names it."""
    estimate = estimate_mesh(resolve_model(_TINY_LLAMA_16K), _training(2)).worst.estimate
    step = next(i for i, p in enumerate(estimate.phases) if p.step.value == "first" and p.phase.value == "optimizer_step")
    names = {term.name: term.bytes for term in estimate.ledger[step].terms}
    assert names["gradients whole beyond their parameter shards"] == 8192 * 128 * 4


def test_the_optimizer_step_holds_the_measured_gradients():
    # measured on both ranks: 13,322,752 bytes of gradients at the optimizer step (the embedding's (16384, 128)
    # Replicate gradient whole beside the rank's other shards); the first step's peak is that moment
    phases = estimate_mesh(resolve_model(_TINY_LLAMA_16K), _training(2)).worst.estimate.phases
    step = next(p for p in phases if p.step.value == "first" and p.phase.value == "optimizer_step")
    assert step.categories.grads == 13_322_752
    assert sum(step.categories[:6]) == 40_708_096  # measured 40,708,252 (+156 bytes of buffers and state scalars)


def test_the_catalogue_tiny_llama_holds_the_measured_gradients_too():
    # tiny-llama (vocabulary 512), tp 2: 1,133,056 bytes of gradients at the optimizer step on both ranks (131,072 of them
    # the other rank's 256 embedding rows), as row mesh-tp2/tiny-llama/fsdp2-3/fp32/... measured
    phases = estimate_mesh(resolve_model("tiny-llama"), _training()).worst.estimate.phases
    assert {p.categories.grads for p in phases if p.phase.value == "optimizer_step"} == {1_133_056}
