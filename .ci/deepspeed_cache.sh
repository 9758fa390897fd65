#!/usr/bin/env bash
# Build DeepSpeed's JIT ops once into a kept folder, so that measure tests and benchmarks do not
# compile them on every run (docs/engines/deepspeed.md, "JIT-built ops"). `zeroplan measure` does
# the same by itself, before its workers start, for the ops a run needs and finds missing.
#
#   .ci/deepspeed_cache.sh            # shm comm op only (every deepspeed.initialize on CPU, ~35 s)
#   .ci/deepspeed_cache.sh cpu_adam   # also cpu_adam (optimizer offload, ~60 s, 2 GB of RAM)
#
# The folder is $ZEROPLAN_TORCH_EXTENSIONS_DIR, else $TORCH_EXTENSIONS_DIR, else
# ~/.cache/zeroplan/torch_extensions, with one subfolder per Python, torch, DeepSpeed and virtual
# environment (zeroplan.measure.deepspeed_build.ops_dir).
# In CI, cache that folder keyed on the deepspeed and torch versions and the compiler, e.g.
#   key: ds-ext-${{ runner.os }}-$(python -c 'import deepspeed,torch;print(deepspeed.__version__,torch.__version__)')
# Without a GPU DeepSpeed uses its CPU accelerator (DS_ACCELERATOR=cpu). A lock left by a build
# that was killed is removed first; Ctrl-C here leaves no compiler running.
set -euo pipefail

ops=(deepspeed_shm_comm)
if [[ "${1:-}" == "cpu_adam" ]]; then
    ops+=(cpu_adam)
fi
python -m zeroplan.measure.deepspeed_build "${ops[@]}"
