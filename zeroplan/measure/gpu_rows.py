"""Rows that only a GPU can check (issue 23), for `zeroplan validate --backend nccl` to pick up with the grid's:
float8 training (torch._scaled_mm needs an sm_89+ GPU: measure/float8.py converts the blocks' linears with
torchao, which must be installed) and torch.compile on several ranks (on CPU a compiled run is counted from the
allocator's records, which miss the frees on gloo's threads: one rank only; on a GPU CUDA's own statistics
count it). Each row says what it checks of docs/engines/programs.md. Not checked here: async TP (symmetric
memory needs CUDA, and the mesh runner does not compile its stages yet) and float8 saved in float8 (torchao
of 2024)."""

from __future__ import annotations

from zeroplan.measure.grid import Row

GPU_ROWS: tuple[Row, ...] = (
    # Float8Linear's casts around the matmuls: forward and backward transients of the largest linear
    Row("tiny-llama", "fsdp2", 3, "bf16", float8=(("recipe", "tensorwise"),)),
    # float8 all-gather: the blocks' linear weights gathered and held unsharded in 1 byte
    Row("tiny-llama", "fsdp2", 3, "bf16", float8=(("recipe", "tensorwise"), ("fsdp_all_gather", True))),
    # axiswise scaling: the same casts, per-row scales
    Row("tiny-llama", "fsdp2", 2, "bf16", float8=(("recipe", "rowwise"),)),
    # compiled blocks and loss under FSDP2 on two ranks (the CPU rows run one rank without DDP)
    Row("tiny-llama", "fsdp2", 3, "bf16", compile=("model", "loss")),
    Row("tiny-llama", "fsdp2", 3, "bf16", compile=("model", "loss"), float8=(("recipe", "tensorwise"), ("fsdp_all_gather", True))),
)
