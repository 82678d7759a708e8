#!/usr/bin/env bash
# Every piece of GPU evidence for kvtide's specialised decode paths, in one run, under one
# output folder. Made for one H100/H200 (sm_90a; the shipped cubins) or a B200/GB200/GB300
# host with vLLM's GPU build (which brings nvidia-cutlass-dsl: it compiles here). Needs a
# CUDA driver, PyTorch with CUDA, cuda-bindings or CuPy; no network. Bounded at 8 minutes.
#
#   bash benchmarks/kernels_evidence.sh [OUT]          # OUT defaults to evidence-<time>/
#   PYTHON=/path/to/python bash benchmarks/kernels_evidence.sh OUT
#   KIMI_K3_MODEL=/models/kimi-k3 KIMI_K3_TP=8 KIMI_K3_DCP=8 bash ...   # the real A/B
#
# Writes, under OUT:
#   host.txt                     nvidia-smi (GPU, driver, clocks) and the Python packages
#   kernels-<arch>.{json,md}     kvtide kernels validate: every case, exact-error steps,
#                                timings under CUDA graphs against vLLM's op,
#                                torch.compile and the eager reference
#   timings.txt                  benchmarks/kernels.py at decode shapes
#   ab-*.{json,md}               kvtide kernels ab of vLLM's Kimi K3 path when
#                                KIMI_K3_MODEL is set (an SM100/SM103 host with TP GPUs),
#                                else ab-self-check-*: stock vs stock on kvtide's tiny
#                                model, a check of the A/B machinery that covers nothing
#   show.txt                     kvtide kernels show over OUT
#
# Exit code: 0 when everything passed, 1 when a check failed, 2 when the host cannot run it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${1:-evidence-$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
deadline=$((SECONDS + 470))
left() { echo $((deadline - SECONDS)); }
status=0

echo "== host" | tee "$OUT/host.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv >> "$OUT/host.txt" || {
    echo "nvidia-smi failed: no usable NVIDIA GPU here" >&2; exit 2; }
"$PY" - >> "$OUT/host.txt" <<'PY' || { cat "$OUT/host.txt"; exit 2; }
import importlib.util, sys
import torch
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA GPU")
have = [m for m in ("cuda", "cupy", "cutlass", "vllm") if importlib.util.find_spec(m)]
print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPU", torch.cuda.get_device_name(0))
print("available:", ", ".join(have) or "nothing")
if not {"cuda", "cupy"} & set(have):
    sys.exit("neither cuda-bindings nor CuPy is importable: pip install cuda-bindings")
PY
cat "$OUT/host.txt"
ARCH="$("$PY" -c 'import torch; from kernels.scope import arch_from_capability as a; print(a(*torch.cuda.get_device_capability()))')"

echo "== validate ($ARCH; every case in scope)"
timeout "$(left)" "$PY" -m kernels validate --out "$OUT/kernels-$ARCH" || status=1

echo "== timings at decode shapes"
timeout "$(( $(left) > 90 ? 90 : $(left) ))" "$PY" benchmarks/kernels.py --repeats 50 --arch "$ARCH" > "$OUT/timings.txt" 2>&1 || echo "timings incomplete (see timings.txt)"
tail -25 "$OUT/timings.txt"

echo "== engine A/B"
if [ -n "${KIMI_K3_MODEL:-}" ]; then
    timeout "$(left)" "$PY" -m kernels ab --model "$KIMI_K3_MODEL" --tp "${KIMI_K3_TP:-8}" \
        --dcp "${KIMI_K3_DCP:-1}" --out "$OUT/ab-$ARCH-tp${KIMI_K3_TP:-8}-dcp${KIMI_K3_DCP:-1}" || status=1
else
    TINY="$OUT/tiny-model"
    "$PY" -c "from engines.tiny_model import generate_tiny_model as g; g('$TINY')" &&
    timeout "$(left)" "$PY" -m kernels ab --model "$TINY" --tp 1 --self-check \
        --batch 1 --batch 16 --batch 64 --max-tokens 32 --out "$OUT/ab-self-check-$ARCH" || status=1
    rm -rf "$TINY"
fi

echo "== evidence"
"$PY" -m kernels show --evidence-dir "$OUT" | tee "$OUT/show.txt"
ls -l "$OUT"
cat <<MSG

Next: copy $OUT/kernels-*.json/.md and ab-*.json/.md (not self-checks) into
kernels/evidence/, commit them, then add to kernels.gate.VALIDATED a ValidatedScope per
file, no wider than what it passed (kernels: source_sha256 = the file's binding; vLLM's
path: arch, (TP, DCP), batch range and vLLM version of the A/B). The unit tests check
that each file is current and covers its scope. See docs/kernels.md.
MSG
exit "$status"
