"""Rendering only: tables, markdown, CSV, JSON documents and plots of results computed elsewhere.

`common` holds what every renderer shares (formats, category labels, amounts in a unit, tables);
one module per command's output: `estimate` (and `models`), `compare`, `plan`, `plot`, `measure`,
`accuracy` (`zeroplan validate`); `html/` draws each command's JSON document as one self-contained page
(`--format html`). Results come in as plain data or as result objects; nothing
here imports the planner, the estimator's internals or measure at run time.
"""
