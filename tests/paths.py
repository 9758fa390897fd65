"""Where the tests find the checkout and their data, whatever folder of tests/ a test module sits in."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
"""tests/ itself (the helpers beside conftest.py, e.g. live_program.py)."""
DATA = TESTS / "data"
"""tests/data: the published configs, spec files and recorded measurements the tests read."""
REPO = TESTS.parent
"""The checkout: README.md, docs/, bench/, model_specs/, zeroplan/."""
