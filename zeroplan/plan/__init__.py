"""Which configuration to run: the search over stages, offload, micro-batch and GPU counts, the compare grid, and the step-cost model that ranks them."""
