"""Before/after check of a refactor of the estimator: the JSON estimates of a few thousand
configurations, byte for byte.

The configurations are drawn, with a fixed seed, from models x engines x ZeRO stages x offload x
checkpointing x attention x precision x optimizer x micro-batch x accumulation x device x GPU
count x engine knobs x frozen groups; the invalid ones are dropped. All run in one process, in
one order (the estimator's caches see every configuration after others, as in a plan); a second
pass in the reverse order records `zeroplan.estimate.fit`'s peak, from other cache states.

    python bench/estimate_grid_check.py --write /tmp/grid-before.json      # on the old commit
    python bench/estimate_grid_check.py --against /tmp/grid-before.json    # on the new one: exit 1 on a change

With `--recipe plain` every configuration names that recipe and only the bytes are compared (not
the echoed config): the plain recipe must reproduce the estimates from before the program knobs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pydantic import ValidationError

from json_subset import restricted
from zeroplan.estimate import fit
from zeroplan.estimate import estimate_mesh
from zeroplan.estimate.serialize import estimate_to_dict
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.model import ParamCountSpec
from zeroplan.spec.training import TrainingSpec

MODELS = ["tiny-llama", "tiny-gpt2", "llama-100m", "llama-2-7b", "mixtral-8x7b", "phi-3-mini", "pythia-1b", "gemma-7b",
          "gpt2", "count-7b"]
OFFLOADS = [("none", "none"), ("cpu", "none"), ("nvme", "none"), ("cpu", "cpu"), ("nvme", "nvme"), ("none", "cpu")]
DEEPSPEED_KNOBS = [
    {},
    {"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000},
    {"reduce_bucket_size": 100_000, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 20_000,
     "stage3_max_live_parameters": 30_000, "stage3_max_reuse_distance": 30_000},
    {"overlap_comm": True, "reduce_bucket_size": 2_000_000},
    {"zero_init": True, "offload_pin_memory": False, "reduce_bucket_size": 400_000_000},
]
# A knob DeepSpeedKnobs no longer has (now `model_init zero-init`, the stage 3 default of every recipe):
# kept in the drawn configurations so that they and their keys stay those of older baselines.
RETIRED_DEEPSPEED_KNOBS = ("zero_init",)
FSDP2_KNOBS = [{}, {"reshard_root_after_forward": True}, {"reshard_root_after_forward": False}]
DIMENSIONS = {
    "engine": ["deepspeed", "deepspeed", "fsdp2", "torch", "paper"],
    "zero_stage": [0, 1, 2, 3],
    "checkpointing": ["none", "selective", "full"],
    "attention": ["fused", "eager"],
    "precision": ["fp32", "bf16", "fp16", "pure-bf16"],
    "optimizer": ["adamw", "adamw", "sgd", "adam8bit"],
    "micro_batch": [1, 2, 8],
    "grad_accum": [1, 1, 4],
    "device": ["cuda", "cpu"],
    "gpus": [1, 2, 8, 64, 512],
    "freeze": [(), (), ("embeddings",), ("blocks",)],
}
SAMPLES = 16000  # drawn; about a third are valid combinations
SEED = 9


def _model(name: str):
    if name == "count-7b":
        return ParamCountSpec(name=name, params=6_738_415_616, largest_layer_params=202_383_360)
    return resolve_model(name)


def configurations(recipe: str | None = None) -> list[tuple[str, str, dict]]:
    """(key, model name, TrainingSpec fields) of every valid configuration checked, in evaluation order."""
    rng = random.Random(SEED)
    seen, points = set(), []
    for _ in range(SAMPLES):
        model = rng.choice(MODELS)
        fields = {name: rng.choice(values) for name, values in DIMENSIONS.items()}
        fields["offload_optimizer"], fields["offload_params"] = rng.choice(OFFLOADS)
        fields["seq_len"] = rng.choice([128, 512] if model.startswith("tiny") else [512, 4096])
        fields["deepspeed"] = rng.choice(DEEPSPEED_KNOBS)
        fields["fsdp2"] = rng.choice(FSDP2_KNOBS)
        fields["freeze"] = list(fields["freeze"])
        key = json.dumps([model, fields], sort_keys=True)
        fields["deepspeed"] = {k: v for k, v in fields["deepspeed"].items() if k not in RETIRED_DEEPSPEED_KNOBS}
        if recipe is not None:
            fields["recipe"] = recipe
        if key in seen:
            continue
        seen.add(key)
        try:
            TrainingSpec(**fields)
        except ValidationError:
            continue
        points.append((key, model, fields))
    return points


def run_all(recipe: str | None = None) -> dict[str, dict]:
    points = configurations(recipe)
    models = {name: _model(name) for name in MODELS}
    results: dict[str, dict] = {}
    specs = [TrainingSpec(**fields) for _, _, fields in points]
    keys = [key for key, _, _ in points]
    for (_, model, _), training, key in zip(points, specs, keys):
        results[key] = estimate_to_dict(estimate_mesh(models[model], training), training)
        if recipe is not None:  # the bytes only
            results[key] = {k: v for k, v in results[key].items() if k not in ("config", "program")}
    for (_, model, _), training, key in reversed(list(zip(points, specs, keys))):
        found = fit(models[model], training)
        results[key]["fit"] = {"peak": found.peak_bytes, "per_node": found.per_node._asdict()}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, help="write this checkout's estimates to a JSON file")
    group.add_argument("--against", type=Path, help="compare this checkout's estimates with a file from --write")
    parser.add_argument("--recipe", help="give every configuration this recipe and compare the bytes only")
    args = parser.parse_args()
    results = run_all(args.recipe)
    if args.write:
        args.write.write_text(json.dumps(results, sort_keys=True))
        print(f"{len(results)} configurations written to {args.write}")
        return 0
    before = json.loads(args.against.read_text())
    # keys a newer estimate adds (terms, ranks) are not compared: every figure the baseline has is
    changed = sorted(key for key in set(before) | set(results)
                     if key not in before or key not in results or before[key] != restricted(results[key], before[key]))
    for key in changed[:20]:
        print(f"changed: {key}")
    print(f"{len(changed)} of {len(results)} configurations changed" if changed
          else f"{len(results)} configurations: identical estimates")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
