"""What the GPU holds beyond the tensors: the caching allocator's reserved memory (allocator.py,
configured by alloc_conf.py) and the memory outside it (outside.py); figures.py joins them.
Standard library only, like the rest of the estimator."""
