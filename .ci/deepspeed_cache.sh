#!/usr/bin/env bash
# Build DeepSpeed's JIT ops once into a kept folder, so that measure tests and benchmarks do not
# compile them on every run (docs/engines/deepspeed.md, "JIT-built ops").
#
#   .ci/deepspeed_cache.sh            # shm comm op only (every deepspeed.initialize needs it, ~35 s)
#   .ci/deepspeed_cache.sh cpu_adam   # also cpu_adam (optimizer offload, ~60 s, 2 GB of RAM)
#
# The folder is $ZEROPLAN_TORCH_EXTENSIONS_DIR, else $TORCH_EXTENSIONS_DIR, else
# ~/.cache/zeroplan/torch_extensions: the one zeroplan.measure.engines.deepspeed_engine uses.
# In CI, cache that folder keyed on the deepspeed and torch versions and the compiler, e.g.
#   key: ds-ext-${{ runner.os }}-$(python -c 'import deepspeed,torch;print(deepspeed.__version__,torch.__version__)')
# Without a GPU DeepSpeed uses its CPU accelerator (DS_ACCELERATOR=cpu).
set -euo pipefail

dir="${ZEROPLAN_TORCH_EXTENSIONS_DIR:-${TORCH_EXTENSIONS_DIR:-$HOME/.cache/zeroplan/torch_extensions}}"
mkdir -p "$dir"
export TORCH_EXTENSIONS_DIR="$dir"
if ! python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi

builders=(ShareMemCommBuilder)
if [[ "${1:-}" == "cpu_adam" ]]; then
    builders+=(CPUAdamBuilder)
fi

for name in "${builders[@]}"; do
    start=$SECONDS
    python - "$name" <<'PY'
import sys
from deepspeed.accelerator import get_accelerator

builder = get_accelerator().create_op_builder(sys.argv[1])
if builder is None:
    print(f"{sys.argv[1]}: not used by this accelerator, nothing to build")
else:
    builder.load(verbose=False)
PY
    echo "$name ready in $dir ($((SECONDS - start)) s)"
done
