#!/usr/bin/env bash
# Single-GPU smoke check (no slime, no network): losses in bf16 on CUDA vs the fp32 CPU
# reference, and the teacher server's hf backend on the GPU. Needs a CUDA torch in
# $PYTHON's environment with this package installed (pip install -e .); not run by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible to torch")'
# the hybrid step's gated-delta kernel: pure-Python + Triton wheels carried beside the tree
# (made where PyPI answers: pip download --no-deps -d .wheels fla-core==0.6.0 einops)
if compgen -G ".wheels/*.whl" >/dev/null; then
    "$PYTHON" -m pip install --quiet --no-deps .wheels/*.whl
fi
exec "$PYTHON" bench/gpu_check.py "$@"
