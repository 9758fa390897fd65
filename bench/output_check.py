"""Before/after check of a restructuring: a fixed set of commands whose output must not change.

Runs each command as a fresh `python -m zeroplan` process in this checkout and writes its exit
status, standard output and standard error (and any file it emits) to one JSON document, so that
two checkouts can be compared:

    python bench/output_check.py --write /tmp/before.json       # on the old commit
    python bench/output_check.py --against /tmp/before.json     # on the new one: exit 1 on a change
    python bench/output_check.py --terms                        # every estimate's terms add up (issue 20)

The set: `estimate` of every catalogue model in table and JSON (and an offload and a --params
run), `compare`, `plan` with `--emit deepspeed` and `--emit fsdp`, `models`, a few bad inputs, and
`validate --measure none` (re-estimates every accuracy row against the committed measurements,
written to a temporary directory).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_subset import restricted  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def catalogue_models() -> list[str]:
    return sorted(p.stem for p in (REPO / "model_specs").glob("*.toml"))


def commands(out_dir: str) -> list[list[str]]:
    """The fixed set; `{out}` is replaced by a scratch directory whose files are compared too."""
    runs = []
    for model in catalogue_models():
        runs.append(["estimate", model, "--gpus", "8", "--zero", "3"])
        runs.append(["estimate", model, "--gpus", "8", "--zero", "2", "--format", "json"])
    runs += [
        ["estimate", "llama-2-7b", "--gpus", "16", "--zero", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu",
         "--checkpointing", "full", "--format", "json"],
        ["estimate", "llama-2-7b", "--engine", "fsdp2", "--zero", "3", "--gpus", "8", "--units", "GB"],
        ["estimate", "llama-2-7b", "--engine", "torch", "--zero", "1", "--gpus", "4", "--precision", "fp32", "--format", "csv"],
        ["estimate", "--params", "7.5e9", "--largest-layer", "1e8", "--gpus", "64", "--zero", "3", "--engine", "paper"],
        ["estimate", "mixtral-8x7b", "--engine", "fsdp2", "--zero", "3", "--gpus", "64"],
        ["compare", "llama-2-7b", "--zero", "0,1,2,3", "--gpus", "8", "--offload", "none,cpu", "--gpu", "a100-40gb"],
        ["compare", "llama-3-8b", "--zero", "1,3", "--gpus", "8,64", "--engine", "fsdp2", "--format", "json"],
        ["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8", "--emit", "deepspeed", f"{out_dir}/ds.json"],
        ["plan", "llama-2-13b", "--gpu", "a100-40gb", "--gpus", "8", "--engine", "fsdp2", "--emit", "fsdp", f"{out_dir}/fsdp.py"],
        ["plan", "llama-3-70b", "--gpu", "h100-80gb", "--gpus", "8-256", "--global-batch", "1024", "--format", "json"],
        ["plan", "llama-3-70b", "--gpu", "rtx4090-24gb", "--gpus", "1"],
        # meshes, adapters and recipes (added with the ledger, issue 20; their baseline is 65b353f's too)
        ["estimate", "llama-3-70b", "--gpus", "64", "--tp", "8", "--zero", "3", "--engine", "fsdp2", "--seq-len", "8192"],
        ["estimate", "llama-3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--grad-accum", "8", "--zero", "3", "--engine",
         "fsdp2", "--recipe", "torchtitan", "--format", "json"],
        ["estimate", "llama-3-8b", "--gpus", "16", "--cp", "2", "--zero", "3", "--engine", "fsdp2", "--seq-len", "16384",
         "--format", "json"],
        ["estimate", "llama-3-8b", "--gpus", "32", "--pp", "4", "--pp-schedule", "interleaved-1f1b", "--pp-virtual-stages", "2",
         "--grad-accum", "8", "--zero", "3", "--engine", "fsdp2", "--recipe", "torchtitan", "--format", "json"],
        ["estimate", "llama-3-8b", "--gpus", "16", "--dp-replicate", "2", "--zero", "3", "--engine", "fsdp2", "--format", "json"],
        ["estimate", "mixtral-8x7b", "--gpus", "64", "--ep", "8", "--zero", "3", "--engine", "fsdp2", "--recipe", "torchtitan",
         "--format", "json"],
        ["estimate", "llama-3-8b", "--gpus", "8", "--tp", "2", "--zero", "2", "--engine", "deepspeed", "--format", "json"],
        ["estimate", "llama-3-8b", "--gpus", "8", "--cp", "2", "--zero", "3", "--engine", "deepspeed", "--seq-len", "8192"],
        ["estimate", "llama-3-8b", "--gpus", "8", "--tp", "2", "--checkpointing", "full", "--zero", "3", "--engine", "fsdp2",
         "--format", "json"],
        ["estimate", "llama-2-7b", "--gpus", "1", "--engine", "torch", "--zero", "0", "--lora-rank", "16", "--base-precision",
         "nf4", "--format", "json"],
        ["estimate", "llama-3-8b", "--gpus", "8", "--engine", "fsdp2", "--zero", "3", "--lora-rank", "16", "--base-precision",
         "nf4", "--quant-storage", "bf16", "--format", "json"],
        ["estimate", "llama-3-8b", "--gpus", "8", "--engine", "deepspeed", "--zero", "3", "--lora-rank", "16", "--format", "json"],
        ["estimate", "llama-3-8b", "--gpus", "4", "--engine", "torch", "--zero", "0", "--lora-rank", "8",
         "--modules-to-save", "lm_head", "--base-precision", "bf16"],
        ["estimate", "llama-3-8b", "--gpus", "8", "--engine", "fsdp2", "--zero", "3", "--recipe", "torchtitan",
         "--checkpointing", "op", "--format", "json"],
        ["estimate", "llama-3-8b", "--gpus", "8", "--engine", "fsdp2", "--zero", "2", "--recipe", "torchtune",
         "--activation-offload", "cpu", "--checkpointing", "full", "--format", "json"],
        ["models"],
        ["estimate", "no-such-model"],
        ["estimate", "llama-2-7b", "--gpus", "0"],
        ["validate", "--measure", "none", "--output-md", f"{out_dir}/accuracy.md", "--output-json", f"{out_dir}/accuracy.json"],
    ]
    return runs


def run_all() -> dict[str, dict]:
    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for args in commands(out_dir):
            key = " ".join(args).replace(out_dir, "{out}")
            done = subprocess.run([sys.executable, "-m", "zeroplan", *args], cwd=REPO, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}, check=False)
            files = {}
            for path in sorted(Path(out_dir).iterdir()):
                text = path.read_text()
                if path.name == "accuracy.json":  # the run's date and wall time are not output of the code
                    document = json.loads(text)
                    document.pop("generated", None)
                    text = json.dumps(document, indent=1, sort_keys=True)
                text = re.sub(r" on \d{4}-\d\d-\d\d \d\d:\d\d UTC", " on DATE", text)
                files[path.name] = text
                path.unlink()
            results[key] = {"status": done.returncode, "stdout": done.stdout.replace(out_dir, "{out}"),
                            "stderr": done.stderr.replace(out_dir, "{out}"), "files": files}
    return results


def _json_subset(new: dict | None, old: dict | None) -> dict | None:
    """`new` with a JSON standard output cut to the keys the old one had (json_subset.py), re-dumped as the
    old one was, so that keys a newer estimate adds leave the comparison of the rest unchanged."""
    if not new or not old:
        return new
    try:
        old_doc, new_doc = json.loads(old["stdout"]), json.loads(new["stdout"])
    except (ValueError, TypeError):
        return new
    if old["stdout"] != json.dumps(old_doc, indent=2) + "\n":
        return new
    return {**new, "stdout": json.dumps(restricted(new_doc, old_doc), indent=2) + "\n"}


def differences(before: dict, after: dict) -> list[str]:
    lines = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), _json_subset(after.get(key), before.get(key))
        if old == new:
            continue
        lines.append(f"changed: zeroplan {key}")
        for part in ("status", "stdout", "stderr"):
            if (old or {}).get(part) != (new or {}).get(part):
                lines += difflib.unified_diff(str((old or {}).get(part)).splitlines(), str((new or {}).get(part)).splitlines(),
                                              f"before {part}", f"after {part}", lineterm="", n=1)
        for name in sorted(set((old or {}).get("files", {})) | set((new or {}).get("files", {}))):
            a, b = (old or {}).get("files", {}).get(name, ""), (new or {}).get("files", {}).get(name, "")
            if a != b:
                lines += difflib.unified_diff(a.splitlines(), b.splitlines(), f"before {name}", f"after {name}", lineterm="", n=1)
    return lines


CATEGORIES = ("params", "grads", "optimizer_states", "activations", "buffers", "temporaries", "overhead")


def terms_add_up() -> list[str]:
    """Each `estimate` of the set, as JSON: the terms of the worst rank and of every rank kind add up exactly to
    each category of their `per_gpu` and to its peak (issue 20); the problems found."""
    problems = []
    with tempfile.TemporaryDirectory() as out_dir:
        for args in commands(out_dir):
            if args[0] != "estimate":
                continue
            plain = list(args)
            if "--format" in plain:
                del plain[plain.index("--format"):plain.index("--format") + 2]
            done = subprocess.run([sys.executable, "-m", "zeroplan", *plain, "--format", "json"], cwd=REPO,
                                  capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
            if done.returncode != 0:
                continue  # the bad inputs of the set
            data = json.loads(done.stdout)
            for where, part in [("", data)] + [(f" rank {r['kind']}", r) for r in data.get("ranks", [])]:
                sums = {c: sum(t["bytes"] for t in part["terms"] if t["category"] == c) for c in CATEGORIES}
                wrong = [c for c in CATEGORIES if sums[c] != part["per_gpu"][c]]
                if sum(sums.values()) != part["per_gpu"]["peak"]:
                    wrong.append("peak")
                if wrong:
                    problems.append(f"zeroplan {' '.join(plain)}{where}: terms do not add up to {', '.join(wrong)}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, help="write this checkout's outputs to a JSON file")
    group.add_argument("--against", type=Path, help="compare this checkout's outputs with a file from --write")
    group.add_argument("--terms", action="store_true", help="check that every estimate's terms add up to its figures")
    args = parser.parse_args()
    if args.terms:
        problems = terms_add_up()
        print("\n".join(problems) if problems else "every estimate's terms add up to its per_gpu and peak")
        return 1 if problems else 0
    results = run_all()
    if args.write:
        args.write.write_text(json.dumps(results, indent=1, sort_keys=True))
        print(f"{len(results)} commands written to {args.write}")
        return 0
    diff = differences(json.loads(args.against.read_text()), results)
    print("\n".join(diff[:400]) if diff else f"{len(results)} commands: identical output")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
