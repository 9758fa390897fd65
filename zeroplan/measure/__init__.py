"""zeroplan measure: real distributed training steps on real engines, memory per rank, phase and category.

The only part of zeroplan that imports torch, and it does so lazily (inside functions), so that
`import zeroplan.measure` stays cheap and works without torch. Modules, one job each:

- `context`: which device, backend and memory probe a rank uses (the only CPU/GPU seam);
- `accounting`: live-tensor accounting by storage, per phase, with the categories at each peak;
- `workload`: the model of a spec, built for real (Hugging Face or `reference_model`), and its batches;
- `reference_model`: a compact GPT-2 / Llama implementation for when transformers is missing;
- `engines`: one runner per engine (torch, fsdp2, deepspeed) behind the `EngineRunner` interface;
- `worker`: one rank (`python -m zeroplan.measure.worker`, also under torchrun);
- `launcher`: `run_measurement`, which spawns local workers and collects their results (and
  `write_job` / `load_outputs` / `assemble_result` for torchrun launches);
- `nodes`: a run across nodes, each node's launcher meeting at node 0's c10d store (`run_nodes`);
- `live`: the estimate and the measurement inside a user's own program (`track`, `ZeroplanCallback`);
- `result`: the result dataclasses and their JSON;
- `comparison`: the estimate beside the measurement, error per category and peak, and the
  accuracy targets; `zeroplan measure` and the accuracy grid both use it (no torch);
- `grid`: the accuracy grid as data (one `Row` per configuration); `validate`: running its rows,
  the measurement cache, and the report's data (no torch; rendering is zeroplan.report.accuracy).
"""
