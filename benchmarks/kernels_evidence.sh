#!/usr/bin/env bash
# Produce GPU evidence for kvtide's decode kernels on one GPU (made for one H200; a few
# minutes, bounded at 9). Needs: a CUDA driver, PyTorch with CUDA, and cuda-bindings or
# CuPy. Without nvidia-cutlass-dsl it compiles nothing and launches the cubins shipped in
# kernels/cubins/ (sm_90a); with it, it compiles for this GPU first.
#
#   bash benchmarks/kernels_evidence.sh            # writes kernels/evidence/<arch>-<gpu>-<time>.{json,md}
#   PYTHON=/path/to/python bash benchmarks/kernels_evidence.sh
#
# Exit code: 0 when every case passed, 1 when some failed, 2 when the host cannot run it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== host"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || {
    echo "nvidia-smi failed: no usable NVIDIA GPU here" >&2; exit 2; }
"$PY" - <<'PY' || exit 2
import importlib.util, sys
import torch
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA GPU")
have = [m for m in ("cuda.bindings", "cupy", "cutlass") if importlib.util.find_spec(m.split(".")[0])]
print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPU", torch.cuda.get_device_name(0))
print("available:", ", ".join(have) or "nothing")
if not {"cuda.bindings", "cupy"} & set(have):
    sys.exit("neither cuda-bindings nor CuPy is importable: pip install cuda-bindings")
PY

echo "== validate (every case in scope; correctness and timing vs the torch path)"
timeout 420 "$PY" -m kernels validate
status=$?
if [ "$status" -ge 124 ]; then echo "validate timed out" >&2; exit 1; fi

echo "== timings at decode shapes"
timeout 120 "$PY" benchmarks/kernels.py --repeats 100 --arch "$("$PY" -c 'import torch; from kernels.scope import arch_from_capability as a; print(a(*torch.cuda.get_device_capability()))')" || true

echo "== evidence"
"$PY" -m kernels show
cat <<'MSG'

Next: commit the new kernels/evidence/*.json and *.md, then add a ValidatedScope naming
the evidence file (and no wider than what it passed) to kernels.gate.VALIDATED; the unit
tests check that the file exists and covers that scope. See docs/kernels.md.
MSG
exit "$status"
