"""ColossalAI-style Python config (legacy `zero = dict(type='ZeroRedundancyOptimizer_Level_3', ...)`)
-> zeroplan training settings. The file is parsed with `ast` and never executed.

Allowed: module-level `NAME = value` where value is a literal (number, string, True/False/None), a
`dict(key=value, ...)` call, a dict/list/tuple literal, unary minus on a number, or a name assigned
above (constants, and also earlier dicts, as ColossalAI's own test configs do). Docstrings are allowed.
Everything else (imports, other calls, attribute access, operators, comprehensions, f-strings,
lambdas, definitions, control flow) is an error naming the file, the line and what was found.

The `zero` options are the keyword arguments of ColossalAI's ZeRO wrappers, which were DeepSpeed copies:
hpcaitech/ColossalAI colossalai/nn/optimizer/zero_redundancy_optimizer_level_{1,2,3}.py,
ZeroRedundancyOptimizer_Level_N.__init__ (commits 404ecbd / eb20ef4). The docs' `zero = dict(level=3, ...)`
form is colossalai/zero/__init__.py convert_to_zero (levels 2 and 3). fp16 is implied: "fp16 is
automatically enabled when using ZeRO" (ColossalAI docs, Zero Redundancy optimizer and zero offload).
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

from zeroplan.importers.files import MAX_NESTING, read_text
from zeroplan.importers.values import (
    as_bool,
    as_int,
    as_section,
    check_keys,
    check_nvme_path,
    fail,
    merge_pin_memory,
    read_offload,
)
from zeroplan.errors import SpecError, ZeroplanWarning
from zeroplan.spec.training import Precision

ENGINE = "ColossalAI ZeRO"
_ALLOWED = "only constants and dict(...) are allowed"

_COMMON = {"static_loss_scale", "dynamic_loss_scale", "dynamic_loss_args", "verbose", "contiguous_gradients",
           "reduce_bucket_size", "reduce_scatter", "overlap_comm", "clip_grad", "allreduce_always_fp32",
           "postscale_gradients", "gradient_predivide_factor", "gradient_accumulation_steps"}
# Keyword arguments of each level's __init__ (model, optimizer and the process-group enum excluded).
_LEVEL_KEYS = {
    1: {"max_elements_per_comm", "verbose"},
    2: _COMMON | {"allgather_bucket_size", "cpu_offload", "ignore_unused_parameters", "round_robin_gradients",
                  "fp16_master_weights_and_gradients"},
    3: _COMMON | {"prefetch_bucket_size", "max_reuse_distance", "max_live_parameters",
                  "param_persistence_threshold", "offload_optimizer_config", "offload_param_config",
                  "sub_group_size", "aio_config"},
}
# zero key -> DeepSpeedKnobs field (same meaning as DeepSpeed's, the code being a copy).
_INT_KNOBS = {
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "sub_group_size": "sub_group_size",
}
# ColossalAI defaults that differ from DeepSpeed's (and so from DeepSpeedKnobs'): overlap_comm=False and
# sub_group_size=1000000000000 at level 3 (DeepSpeed: True, 1e9); allgather_bucket_size=5000000000 at
# level 2 (DeepSpeed: 5e8).
_LEVEL_DEFAULTS: dict[int, dict[str, object]] = {
    2: {"allgather_bucket_size": 5_000_000_000},
    3: {"overlap_comm": False, "sub_group_size": 1_000_000_000_000},
}
# Module-level names this reader maps; a config with none of them has nothing to estimate from.
_READ_NAMES = ("zero", "optimizer", "gradient_accumulation")
# optimizer.type of ColossalAI's registry (colossalai/nn/optimizer), lower-cased; all Adam variants keep
# the same two states per parameter.
_OPTIMIZERS = {"adam": "adam", "fusedadam": "adam", "cpuadam": "adam", "hybridadam": "adam", "adamw": "adamw",
               "sgd": "sgd", "fusedsgd": "sgd"}
_TYPE = re.compile(r"ZeroRedundancyOptimizer_Level_(\d+)")


class _Source:
    """Where each value came from, for messages like "zero.py:7: zero.type ..."."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: dict[str, int] = {}

    def __call__(self, field: str) -> str:
        parts = field.split(".")
        for end in range(len(parts), 0, -1):
            line = self.lines.get(".".join(parts[:end]))
            if line is not None:
                return f"{self.path}:{line}"
        return str(self.path)


def load_python_config(path: Path) -> tuple[dict[str, object], _Source]:
    """The module's names and values, evaluated from the syntax tree only."""
    text = read_text(path, "config")
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as error:
        hint = " (the docs' '...' stands for the rest of the options: remove it)" if "..." in text else ""
        raise SpecError(f"{path}:{error.lineno}:{error.offset}: invalid Python: {error.msg}{hint}") from None
    except (MemoryError, RecursionError):  # CPython's parser on thousands of nested unary operators
        raise SpecError(f"{path}: nested too deeply for a config file") from None
    if _depth(tree) > 2 * MAX_NESTING:
        raise SpecError(f"{path}: nested deeper than {MAX_NESTING} levels; not a config file")
    source = _Source(path)
    names: dict[str, object] = {}
    for statement in tree.body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) \
                and isinstance(statement.value.value, str):
            continue  # a docstring
        if not isinstance(statement, ast.Assign):
            raise SpecError(f"{path}:{statement.lineno}: {_ALLOWED}, found {_describe(statement)}")
        for target in statement.targets:
            if not isinstance(target, ast.Name):
                raise SpecError(f"{path}:{statement.lineno}: {_ALLOWED}, found an assignment to "
                                f"{ast.unparse(target)!r}; assign plain names")
        value = _evaluate(statement.value, names, path, source, [])
        for target in statement.targets:
            names[target.id] = value
            source.lines[target.id] = statement.lineno
            _record_lines(statement.value, target.id, source)
    return names, source


def _depth(tree: ast.AST) -> int:
    """Depth of the syntax tree, walked without recursion (the evaluator and messages recurse)."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def _evaluate(node: ast.expr, names: Mapping[str, object], path: Path, source: _Source, at: list[str]) -> object:
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes) and node.value is not Ellipsis:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) in (int, float):
        return -node.operand.value
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise SpecError(f"{path}:{node.lineno}: name {node.id!r} is not assigned above")
        return names[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_evaluate(item, names, path, source, at) for item in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            if key is None:
                raise SpecError(f"{path}:{node.lineno}: {_ALLOWED}, found a ** unpacking")
            out[_evaluate(key, names, path, source, at)] = _evaluate(value, names, path, source, at)
        return out
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        if node.args:
            raise SpecError(f"{path}:{node.lineno}: {_ALLOWED}, found dict() with a positional argument; "
                            "use dict(key=value, ...)")
        out = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                raise SpecError(f"{path}:{keyword.value.lineno}: {_ALLOWED}, found a ** unpacking")
            out[keyword.arg] = _evaluate(keyword.value, names, path, source, at)
        return out
    raise SpecError(f"{path}:{node.lineno}: {_ALLOWED}, found {_describe(node)}")


def _record_lines(node: ast.expr, prefix: str, source: _Source) -> None:
    """Line of every key of nested dict(...) calls and dict literals, keyed "zero.offload_param_config"."""
    if isinstance(node, ast.Call):
        pairs = [(keyword.arg, keyword.value) for keyword in node.keywords if keyword.arg is not None]
    elif isinstance(node, ast.Dict):
        pairs = [(key.value, value) for key, value in zip(node.keys, node.values)
                 if isinstance(key, ast.Constant) and isinstance(key.value, str)]
    else:
        return
    for key, value in pairs:
        field = f"{prefix}.{key}"
        source.lines[field] = value.lineno
        _record_lines(value, field, source)


def _describe(node: ast.AST) -> str:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return "an import"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"a function definition ({node.name})"
    if isinstance(node, ast.ClassDef):
        return f"a class definition ({node.name})"
    if isinstance(node, ast.Call):
        return f"a call to {ast.unparse(node.func)}"
    if isinstance(node, ast.Attribute):
        return f"an attribute access ({ast.unparse(node)})"
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        return "a comprehension"
    if isinstance(node, ast.JoinedStr):
        return "an f-string"
    if isinstance(node, ast.Lambda):
        return "a lambda"
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return "'...' (the docs' placeholder for the rest of the options: remove it)"
    if isinstance(node, (ast.BinOp, ast.BoolOp, ast.Compare, ast.UnaryOp)):
        return f"an expression ({ast.unparse(node)}); write the number itself"
    if isinstance(node, ast.stmt):
        kind = type(node).__name__.lower()  # "annassign", "if", "for", ...
        return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} statement"
    return f"{type(node).__name__} ({ast.unparse(node)})"


def settings_from_colossalai(names: Mapping[str, object], where: _Source) -> dict[str, object]:
    """Partial TrainingSpec mapping for a ColossalAI-style config's module names."""
    if not any(name in names for name in _READ_NAMES):
        raise SpecError(f"{where.path}: sets none of {', '.join(_READ_NAMES)}: nothing to read "
                        "(ZeRO settings are written zero = dict(type='ZeroRedundancyOptimizer_Level_3', ...))")
    settings: dict[str, object] = {}
    accum = []
    if "gradient_accumulation" in names:  # colossalai.initialize reads gpc.config.gradient_accumulation
        accum.append(("gradient_accumulation", as_int(names["gradient_accumulation"], "gradient_accumulation",
                                                       where, minimum=1)))
    if "zero" in names:
        zero = as_section(names["zero"], "zero", where)
        settings.update(_zero(zero, where))
        if "gradient_accumulation_steps" in zero:
            accum.append(("zero.gradient_accumulation_steps",
                          as_int(zero["gradient_accumulation_steps"], "zero.gradient_accumulation_steps", where, 1)))
    if len({value for _field, value in accum}) > 1:
        raise fail(where, accum[1][0], f"is {accum[1][1]} but {accum[0][0]} is {accum[0][1]}; make them equal")
    if accum:
        settings["grad_accum"] = accum[0][1]
    if "optimizer" in names:
        optimizer = as_section(names["optimizer"], "optimizer", where)
        name = optimizer.get("type")
        if name is not None:
            if not isinstance(name, str) or name.lower() not in _OPTIMIZERS:
                raise fail(where, "optimizer.type", f"{name!r} is not modelled by zeroplan "
                           "(supported: Adam, AdamW, SGD and their Fused/CPU/Hybrid variants)")
            settings["optimizer"] = _OPTIMIZERS[name.lower()]
    return settings


def _zero(zero: Mapping[str, object], where: _Source) -> dict[str, object]:
    level = _level(zero, where)
    options = {key: value for key, value in zero.items() if key not in ("type", "level")}
    check_keys(options, _LEVEL_KEYS[level], "zero", where, f"ZeroRedundancyOptimizer_Level_{level}")
    settings: dict[str, object] = {"engine": "deepspeed", "zero_stage": level, "precision": Precision.FP16.value}
    knobs: dict[str, object] = dict(_LEVEL_DEFAULTS.get(level, {}))
    for key, knob in _INT_KNOBS.items():
        if key in options:
            knobs[knob] = as_int(options[key], f"zero.{key}", where, minimum=1 if key == "reduce_bucket_size" else 0)
    for key in ("overlap_comm", "contiguous_gradients"):
        if key in options:
            knobs[key] = as_bool(options[key], f"zero.{key}", where)
    if options.get("fp16_master_weights_and_gradients") is True:
        raise fail(where, "zero.fp16_master_weights_and_gradients", "is true: fp16 master weights are not modelled")

    if level == 2 and "cpu_offload" in options and as_bool(options["cpu_offload"], "zero.cpu_offload", where):
        settings["offload_optimizer"] = "cpu"  # Level_2: self.device = 'cpu' if cpu_offload
    if level == 3:
        param_config = options.get("offload_param_config")
        if isinstance(param_config, Mapping) and "fast_init" in param_config:
            # The ColossalAI docs' third example has `fast_init=OFFLOAD_PARAM_MAX_IN_CPU` here: Level_3 reads
            # only its own keys of offload_param_config, so the run ignores it, and so does the estimate.
            field = "zero.offload_param_config.fast_init"
            warnings.warn(f"{where(field)}: {field} is ignored by ColossalAI (a parameter-offload config has no "
                          "fast_init; the ColossalAI docs' example has this typo): estimated without it; write "
                          "max_in_cpu=... if a limit on parameters kept in CPU memory was meant", ZeroplanWarning)
            param_config = {key: value for key, value in param_config.items() if key != "fast_init"}
        opt_device, opt_pin, _ = read_offload(options.get("offload_optimizer_config"), "zero.offload_optimizer_config",
                                              where, ENGINE, param=False)
        par_device, par_pin, par_knobs = read_offload(param_config, "zero.offload_param_config", where, ENGINE,
                                                      param=True)
        # Level_3 is DeepSpeed's stage3.py, with its NVMe swappers (importers/values.py check_nvme_path)
        check_nvme_path(options.get("offload_optimizer_config"), "zero.offload_optimizer_config", where)
        check_nvme_path(param_config, "zero.offload_param_config", where)
        if param_config is not None and options.get("offload_optimizer_config") is None:
            # Level_3.__init__: assert self.offload_optimizer, "parameter offload is only available with
            # optimizer state offload"
            raise fail(where, "zero.offload_param_config", "needs offload_optimizer_config too (ColossalAI "
                       "offloads parameters only with optimizer states)")
        # Level_3 turns offload on whenever a config dict is given (`if offload_optimizer_config is not
        # None: self.offload_optimizer = True`) and reads its device only to choose NVMe over CPU; so a dict
        # without a device means CPU. An explicit device='none' we read as "off", as DeepSpeed does.
        if options.get("offload_optimizer_config") is not None:
            settings["offload_optimizer"] = opt_device or "cpu"
        if param_config is not None:
            settings["offload_params"] = par_device or "cpu"
        knobs.update(par_knobs)
        pin = merge_pin_memory([("zero.offload_optimizer_config", settings.get("offload_optimizer"), opt_pin),
                                ("zero.offload_param_config", settings.get("offload_params"), par_pin)], where)
        if pin is not None:
            knobs["offload_pin_memory"] = pin
    if knobs:
        settings["deepspeed"] = knobs
    return settings


def _level(zero: Mapping[str, object], where: _Source) -> int:
    if "type" in zero:
        kind = zero["type"]
        match = _TYPE.fullmatch(kind) if isinstance(kind, str) else None
        if match is None or int(match.group(1)) not in (1, 2, 3):
            raise fail(where, "zero.type", f"must be ZeroRedundancyOptimizer_Level_1, _2 or _3, got {kind!r}")
        if "level" in zero:
            raise fail(where, "zero.level", "cannot be given with zero.type; keep one")
        return int(match.group(1))
    if "level" in zero:
        level = zero["level"]
        if isinstance(level, bool) or level not in (2, 3):  # convert_to_zero: 'Only ZERO Optimizer Level 2 and 3'
            raise fail(where, "zero.level", f"must be 2 or 3, got {level!r}")
        return int(level)
    raise fail(where, "zero.type", "is missing: say which level, e.g. type='ZeroRedundancyOptimizer_Level_3'")
