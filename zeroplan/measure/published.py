"""Published GPU runs that state their configuration, held against the estimate (issue 11, item 6).

Each run names the figure it publishes, because they are not the same quantity: torchtitan's
benchmark tables print the allocator's peak *reserved* bytes over a logging window (which sits
above the peak allocated by the allocator's caching and fragmentation), torchtune's optimisation
table prints peak *active* bytes (close to allocated), and papers and bug reports state only
whether a run fit. The estimate counts allocated tensor bytes plus the CUDA context. Nothing here is
fitted: the configurations are the published ones, and what the estimate does not model (torch.compile,
float8, packing) is said beside each run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeroplan.errors import SpecError

GIB = 2**30
V100_32GB_BYTES = int(31.75 * GIB)  # "31.75 GiB total capacity": what torch reports for a V100 32 GB (the OOM report's message)

# A 10B GPT-2-style model from DeepSpeed's ZeRO-Offload tutorial ("10B parameter GPT-2 on a single
# V100": 50 layers, hidden 4096, 32 heads; docs/_tutorials/zero-offload.md); the sequence length is
# not stated there: Megatron-LM's GPT-2 default, 1024, is assumed.
ZERO_OFFLOAD_10B = {
    "kind": "transformer", "name": "gpt2-10b (ZeRO-Offload tutorial)", "hf_model_type": "gpt2", "vocab_size": 50_257,
    "hidden_size": 4096, "num_layers": 50, "num_heads": 32, "intermediate_size": 16_384,
    "max_position_embeddings": 1024, "position_embedding": "learned", "norm": "layernorm", "mlp": "gelu",
    "attention_bias": True, "attention_out_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class PublishedRun:
    id: str
    source: str  # where the figure is published (file and commit, or paper section)
    figure: str  # "peak reserved", "peak active", "fits", "out of memory"
    model: str | dict[str, Any]  # a catalogue name, or the fields of a spec
    training: dict[str, Any]
    gpu_memory_bytes: int
    published_bytes: int | None = None  # None for a run that states only whether it fit
    not_modelled: str = ""  # what the published run has that the estimate leaves out
    settings: dict[str, str] = field(default_factory=dict)  # stated values the row relies on, for the report


RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "torchtitan-8b-fsdp8", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (runs at 9dec370)",
        "peak reserved", "llama-3-8b",  # Llama 3.1 8B: the shapes of Llama 3 8B (rope scaling changes no tensor)
        {"engine": "fsdp2", "zero_stage": 3, "gpus": 8, "micro_batch": 2, "seq_len": 8192, "precision": "bf16",
         "recipe": "torchtitan", "checkpointing": "op", "loss": "standard"},
        gpu_memory_bytes=96 * GIB, published_bytes=int(82.4 * GIB),
        not_modelled="the Dec-2024 policy kept the last block unsharded after forward; reserved includes the allocator's cache",
        settings={"seq_len": "8192, from its llama3_8b.toml", "loss": "standard: the Dec-2024 loss materialised full fp32 logits"}),
    PublishedRun(
        "torchtitan-8b-fsdp128", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 3 (runs at 9dec370)",
        "peak reserved", "llama-3-8b",
        {"engine": "fsdp2", "zero_stage": 3, "gpus": 128, "micro_batch": 2, "seq_len": 8192, "precision": "bf16",
         "recipe": "torchtitan", "checkpointing": "op", "loss": "standard"},
        gpu_memory_bytes=96 * GIB, published_bytes=int(67.0 * GIB),
        not_modelled="as above"),
    # Tables 4-6 (TP): the 2024 programs' float8 is torchao's tensorwise path of eab345c, which saved float8
    # casts (docs/engines/programs.md, float8), with float8 all-gather and precomputed scales (torchtitan's
    # float8 docs of that time); their blocks are compiled, their loss is not (9dec370 train.py).
    PublishedRun(
        "torchtitan-70b-fsdp32-tp8", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 4, 2D (runs at 9dec370)",
        "peak reserved", "llama-3-70b",
        {"engine": "fsdp2", "zero_stage": 3, "gpus": 256, "micro_batch": 16, "seq_len": 8192, "precision": "bf16",
         "recipe": "torchtitan", "checkpointing": "full", "loss": "standard", "mesh": {"tp": 8},
         "compile": ["model"], "float8": {"fsdp_all_gather": True, "precompute_scale": True, "saved": "float8"}},
        gpu_memory_bytes=96 * GIB, published_bytes=int(71.9 * GIB),
        not_modelled="reserved includes the allocator's cache: its four logits-sized fp32 loss tensors (7.8 GiB each) "
                     "come and go every step",
        settings={"seq_len": "8192, from its llama3_70b.toml", "float8": "tensorwise, float8 all-gather, saved in float8"}),
    PublishedRun(
        "torchtitan-70b-fsdp32-tp8-async", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 4, 2D + AsyncTP",
        "peak reserved", "llama-3-70b",
        {"engine": "fsdp2", "zero_stage": 3, "gpus": 256, "micro_batch": 16, "seq_len": 8192, "precision": "bf16",
         "recipe": "torchtitan", "checkpointing": "full", "loss": "standard", "mesh": {"tp": 8, "async_tp": True},
         "compile": ["model"], "float8": {"fsdp_all_gather": True, "precompute_scale": True, "saved": "float8"}},
        gpu_memory_bytes=96 * GIB, published_bytes=int(67.6 * GIB),
        not_modelled="as above; async TP's symmetric-memory workspace is outside the caching allocator, so outside "
                     "reserved, while the estimate counts it"),
    PublishedRun(
        "torchtitan-405b-fsdp8-tp8-pp8", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 5, 1F1B",
        "peak reserved", "llama-3.1-405b",
        {"engine": "fsdp2", "zero_stage": 2, "gpus": 512, "micro_batch": 4, "grad_accum": 8, "seq_len": 8192,
         "precision": "bf16", "recipe": "torchtitan", "checkpointing": "full", "loss": "standard",
         "mesh": {"tp": 8, "pp": 8, "pp_schedule": "1f1b", "async_tp": True},
         "compile": ["model"], "float8": {"fsdp_all_gather": True, "precompute_scale": True, "saved": "float8"}},
        gpu_memory_bytes=96 * GIB, published_bytes=int(82.5 * GIB),
        not_modelled="as above",
        settings={"grad_accum": "8: pipeline_parallel_microbatches left at the pp degree, local batch 32 in 8",
                  "zero_stage": "2: fsdp_reshard_after_forward default is no resharding under pipeline parallelism"}),
    PublishedRun(
        "torchtune-3b-packed", "torchtune README (v0.6.1), table \"Optimization flags\", row +Packed",
        "peak active", "llama-3.2-3b",
        {"engine": "torch", "zero_stage": 0, "gpus": 1, "micro_batch": 2, "seq_len": 4096, "precision": "pure-bf16",
         "recipe": "torchtune", "loss": "standard", "optimizer_in_backward": False, "checkpointing": "none"},
        gpu_memory_bytes=80 * GIB, published_bytes=int(60.0 * GIB),
        not_modelled="packing (one 4096-token sequence per sample, as counted here)"),
    PublishedRun(
        "zero-offload-10b-v100", "DeepSpeed ZeRO-Offload tutorial and paper (arXiv 2101.06840, abstract): a 10B GPT-2 trains on one 32 GB V100",
        "fits", ZERO_OFFLOAD_10B,
        {"engine": "deepspeed", "zero_stage": 2, "gpus": 1, "micro_batch": 10, "seq_len": 1024, "precision": "fp16",
         "offload_optimizer": "cpu", "checkpointing": "full", "recipe": "plain", "model_init": "host"},
        gpu_memory_bytes=V100_32GB_BYTES),
    PublishedRun(
        "llama-7b-zero2-v100-oom", "issue 11: LLaMA-7B, DeepSpeed ZeRO-2, fp16, 8 x V100 32 GB, Hugging Face Trainer without an optimizer section",
        "out of memory", "llama-2-7b",
        {"engine": "deepspeed", "zero_stage": 2, "gpus": 8, "micro_batch": 1, "seq_len": 512, "precision": "fp16",
         "recipe": "hf-trainer", "optimizer_impl": "for-loop", "deepspeed": {"client_optimizer": True}},
        gpu_memory_bytes=V100_32GB_BYTES,
        not_modelled="batch and sequence are not stated; the out-of-memory happened in the optimizer step, which neither changes",
        settings={"optimizer_impl": "for-loop: the traceback's `exp_avg_sq.sqrt()` line is torch's single-tensor AdamW"}),
)


@dataclass(frozen=True)
class PublishedCheck:
    run: PublishedRun
    estimate_bytes: int | None  # the estimate's peak; None when it could not be made
    problem: str = ""  # why no estimate (a knob this version does not have, ...)

    @property
    def error(self) -> float | None:
        if self.estimate_bytes is None or self.run.published_bytes is None:
            return None
        return self.estimate_bytes / self.run.published_bytes - 1

    @property
    def verdict(self) -> str:
        """For runs that state only fit or out-of-memory: does the estimate agree."""
        if self.estimate_bytes is None:
            return "not estimated"
        fits = self.estimate_bytes <= self.run.gpu_memory_bytes
        if self.run.figure == "fits":
            return "agrees: fits" if fits else "disagrees: estimate says it does not fit"
        if self.run.figure == "out of memory":
            return "agrees: does not fit" if not fits else "disagrees: estimate says it fits"
        return ""


def check_published(runs: tuple[PublishedRun, ...] = RUNS) -> list[PublishedCheck]:
    """The estimate of every run (an estimate that cannot be made is reported, not raised)."""
    from zeroplan.estimate import estimate
    from zeroplan.importers.catalog import resolve_model, spec_from_data
    from zeroplan.spec.training import TrainingSpec

    checks = []
    for run in runs:
        try:
            model = resolve_model(run.model) if isinstance(run.model, str) else spec_from_data(dict(run.model), run.id)
            checks.append(PublishedCheck(run, estimate(model, TrainingSpec(**run.training)).peak_bytes))
        except (SpecError, ValueError) as error:
            checks.append(PublishedCheck(run, None, str(error).splitlines()[0]))
    return checks
