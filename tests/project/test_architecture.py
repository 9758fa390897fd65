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
from tests.paths import REPO

PACKAGE = REPO / "zeroplan"

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
    # which print the API's results; cli.plan is read for its parameters)
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


def dynamic_imports(path: Path) -> set[str]:
    """Modules a file imports by name at run time (`importlib.import_module`): every string constant that names
    a zeroplan module, and every module an f-string prefix (`f"zeroplan.estimate.engines.{name}"`) completes
    with one of the file's string constants. Only in files that call import_module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if not any(isinstance(node, ast.Attribute | ast.Name) and getattr(node, "attr", getattr(node, "id", None))
               == "import_module" for node in ast.walk(tree)):
        return set()
    constants = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    found = {name for name in constants if name in MODULES}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            prefix = node.values[0].value
            if prefix.startswith("zeroplan."):
                found |= {prefix + suffix for suffix in constants if prefix + suffix in MODULES}
    return found


GRAPH = {name: {dep for dep in imported_names(path) | dynamic_imports(path) if dep in MODULES and dep != name}
         for name, path in MODULES.items()}


def private_uses(path: Path) -> list[str]:
    """Another zeroplan module's private names this file uses: `from zeroplan.x import _name`, and `alias._name`
    where `alias` is an imported zeroplan module (dunders aside)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = module_name(path) if path.is_relative_to(PACKAGE) else path.stem
    aliases: dict[str, str] = {}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zeroplan") and node.module != own:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    uses.append(f"{own} imports {node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("zeroplan") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and aliases[node.value.id] != own and node.attr.startswith("_") and not node.attr.startswith("__")):
            uses.append(f"{own} uses {aliases[node.value.id]}.{node.attr}")
    return uses


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
        "estimate imports measure": ("zeroplan.estimate.model.facts", "zeroplan.measure.worker"),
        "report imports the estimator": ("zeroplan.report.estimate", "zeroplan.estimate.activations.transformer"),
        "spec imports importers": ("zeroplan.spec.training", "zeroplan.importers.catalog"),
    }[rule]
    assert not allowed(importer, imported)


def test_no_module_uses_another_s_private_names():
    """A private name imported from another module is an interface nobody designed: make it public on purpose,
    or move the code that needs it (../shared/STYLE.md)."""
    broken = sorted(use for path in MODULES.values() for use in private_uses(path))
    assert not broken, "\n".join(broken)


def test_dynamic_imports_are_edges_of_the_graph(tmp_path):
    """import_module("zeroplan...") and its f-string prefixes count as imports: a cycle behind importlib is seen."""
    engines = dynamic_imports(MODULES["zeroplan.estimate.pipeline"])
    assert {"zeroplan.estimate.engines.deepspeed", "zeroplan.estimate.engines.fsdp2"} <= engines
    source = tmp_path / "probe.py"
    source.write_text("from importlib import import_module\nimport_module('zeroplan.measure.worker')\n")
    assert dynamic_imports(source) == {"zeroplan.measure.worker"}


def test_private_uses_are_found(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("import zeroplan.estimate.activations.transformer as a\nfrom zeroplan.estimate.adapters.lora import _matches\n"
                      "w = a._private_name\n")
    assert len(private_uses(source)) == 2
