"""Upper bounds of every count a user gives, in an option, a config file or a model file.

Past them a value can only be a typo (10^30 GPUs, a 400-digit micro-batch): carried on, it gave peaks
of 10^31 GiB, or overflowed a float in the report. Each bound is far beyond any real run and says why;
the specs enforce them (`Field(le=...)`), the command-line options show the same bounds, and the
planner searches within them.
"""

MAX_GPUS = 2**20
"""1,048,576 GPUs (and any mesh degree): ten times the largest training clusters reported."""

MAX_MICRO_BATCH = 65_536
"""Sequences per GPU per forward pass; the planner searches every micro-batch up to it."""

MAX_SEQ_LEN = 2**24
"""16,777,216 tokens per sequence: past the longest context a released model states (10,485,760, Llama 4 Scout)."""

MAX_GRAD_ACCUM = 2**20
"""Micro-batches accumulated per optimizer step."""

MAX_CHUNKS = 65_536
"""Chunks of a chunked loss: torchtune and torchtitan use 8; more than one per token of a 64k sequence is no use."""

MAX_LAYERS = 65_536
"""Transformer blocks of a model (and `checkpoint_every`): the deepest released models have about 100."""

MAX_WIDTH = 2**24
"""A model dimension (hidden size, MLP width, vocabulary, heads, context length is MAX_SEQ_LEN's): 16,777,216,
a hundred times the widest released (Gemma's 262,144-token vocabulary)."""

MAX_COUNT = 10**15
"""A quadrillion: parameters of a model, elements of a DeepSpeed bucket or buffer; 1,000x the largest model trained."""

MAX_SMALL_COUNT = 65_536
"""Counts of things a run has a handful of: DeepSpeed's NVMe swap buffers (default 5), LoRA's rank (at most the
layer width; 8 to 256 in practice)."""


def field_bounds(model: type, field: str) -> tuple[int | None, int | None]:
    """(ge, le) of a spec's integer field, so that a command-line option states the spec's own bounds."""
    low = high = None
    for constraint in model.model_fields[field].metadata:  # annotated_types.Ge / Le, as pydantic keeps them
        low = getattr(constraint, "ge", low)
        high = getattr(constraint, "le", high)
    return low, high
