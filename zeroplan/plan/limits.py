"""Bounds of a search: past them a value can only be a typo, and searching it would only burn time."""

MAX_GPUS = 2**20  # a million GPUs: beyond any cluster
MAX_MICRO_BATCH = 65_536  # sequences per GPU per forward; every micro-batch up to it is searched in well under a second
