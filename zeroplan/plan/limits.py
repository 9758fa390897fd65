"""Bounds of a search: past them a value can only be a typo, and searching it would only burn time.
They are the specs' own bounds (zeroplan/spec/limits.py), so that the planner never searches what a spec refuses."""

from zeroplan.spec.limits import MAX_GPUS, MAX_MICRO_BATCH  # noqa: F401  (re-exported: plan/search.py, cli/plan.py)
