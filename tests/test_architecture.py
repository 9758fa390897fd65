"""The rules of the house, read from the imports (the standard library's `ast`, no tool to install).

Each folder of `zeroplan/` is a part; a part may import only the parts listed for it in
`MAY_IMPORT` (the README's Development section says the same in words). Imports inside functions
count (a lazy import is still a dependency); imports under `if TYPE_CHECKING:` do not (they never
run). The heavy optional packages belong to `measure` alone, and no set of modules imports each
other in a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zeroplan"

# part -> the parts it may import (besides itself). `errors` is the one shared module at the root.
# The report layer formats results: it may read the estimate's result types, not the estimator.
MAY_IMPORT = {
    "spec": {"errors"},
    "importers": {"spec", "errors"},
    "estimate": {"spec", "errors"},
    "plan": {"estimate", "importers", "spec", "errors"},
    # the tracker in a user's program (measure/live) prints the table of `zeroplan measure` itself
    "measure": {"estimate", "importers", "spec", "errors", "report.common", "report.measure"},
    "report": {"estimate.result", "estimate.serialize", "spec", "errors"},
    # the Python API reads keyword arguments by the command line's option declarations (not its commands,
    # which print the API's results); cli.plan until the planner's command line prints plan_from_options
    "api": {"spec", "importers", "estimate", "plan", "measure", "report", "errors", "", "cli.common",
            "cli.grid_options", "cli.mesh_options", "cli.lora_options", "cli.measure_options", "cli.plan"},
    "cli": {"api", "spec", "importers", "estimate", "plan", "measure", "report", "errors", ""},
    "errors": set(),
    "__main__": {"cli"},
    # zeroplan/__init__.py: the API's names, loaded on first use (estimate, plan and measure: the
    # subpackages of those names, made callable when imported)
    "": {"api", "estimate", "plan", "measure"},
}
HEAVY = {"torch", "transformers", "deepspeed", "accelerate", "peft", "bitsandbytes", "torchtitan", "torchtune", "torchao"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> set[str]:
    """Absolute names imported anywhere in the file but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(inner) for inner in ast.walk(node))
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}: relative import; the house uses absolute imports")
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: {dep for dep in imported_names(path) if dep in MODULES and dep != name} for name, path in MODULES.items()}


def part_of(module: str) -> str:
    """`zeroplan.estimate.engines.fsdp2` -> `estimate`; `zeroplan` -> ``."""
    return module.split(".")[1] if "." in module else ""


def allowed(importer: str, imported: str) -> bool:
    own, target = part_of(importer), part_of(imported)
    if own == target or imported == "zeroplan":  # the package itself holds only __version__
        return True
    rules = MAY_IMPORT[own]
    return target in rules or any(imported == f"zeroplan.{rule}" or imported.startswith(f"zeroplan.{rule}.")
                                  for rule in rules if "." in rule)


def test_every_part_has_a_rule():
    assert {part_of(name) for name in MODULES} <= set(MAY_IMPORT)


def test_parts_import_only_what_they_may():
    broken = sorted(f"{a} imports {b}" for a, deps in GRAPH.items() for b in deps if not allowed(a, b))
    assert not broken, "\n".join(broken)


def test_heavy_packages_only_in_measure():
    broken = sorted(f"{name} imports {heavy}" for name, path in MODULES.items() if part_of(name) != "measure"
                    for heavy in {n.split(".")[0] for n in imported_names(path)} & HEAVY)
    assert not broken, "\n".join(broken)


def test_no_import_cycles():
    # Tarjan's strongly connected components: any component of two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in GRAPH[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in GRAPH:
        if name not in index:
            visit(name)
    assert not cycles, f"modules that import each other: {cycles}"


@pytest.mark.parametrize("rule", ["estimate imports measure", "report imports the estimator", "spec imports importers"])
def test_the_rules_catch_what_they_forbid(rule):
    importer, imported = {
        "estimate imports measure": ("zeroplan.estimate.facts", "zeroplan.measure.worker"),
        "report imports the estimator": ("zeroplan.report.estimate", "zeroplan.estimate.activations"),
        "spec imports importers": ("zeroplan.spec.training", "zeroplan.importers.catalog"),
    }[rule]
    assert not allowed(importer, imported)
