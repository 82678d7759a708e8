#!/usr/bin/env bash
# GPU evidence for kvtide's specialised decode paths, in two parts run separately:
#
#   bash benchmarks/kernels_evidence.sh [OUT]            # the kernel part
#   bash benchmarks/kernels_evidence.sh --ab [OUT]       # the engine A/B
#   bash benchmarks/kernels_evidence.sh --dry-run [OUT]  # both parts on CPU (CI runs this)
#   PYTHON=/path/to/python bash benchmarks/kernels_evidence.sh OUT
#
# The kernel part needs what a bare GPU host has: a CUDA driver, PyTorch with CUDA,
# cuda-bindings or CuPy, and the cubins shipped in kernels/cubins/ (every arch in scope;
# no nvidia-cutlass-dsl, no vLLM, no network). Bounded by KERNELS_BUDGET_S (default 470).
# Writes, under OUT (default evidence-<time>/):
#   host.txt                  nvidia-smi (GPU, driver, clocks) and the Python packages
#   kernels-<arch>.{json,md}  kvtide kernels validate: every case, exact-error steps,
#                             timings under CUDA graphs against every baseline; rewritten
#                             after each case, so a run cut short keeps what it finished
#   timings.txt               benchmarks/kernels.py at decode shapes
#   show.txt                  kvtide kernels show over OUT
# Exit 0 when every kernel case passed (timings.txt is informative), 1 when a case
# failed or did not run, 2 when the host cannot run it.
#
# The engine A/B (--ab) needs vLLM's GPU build; bounded by AB_BUDGET_S (default 1800: a
# Kimi K3 checkpoint takes minutes per engine start, and the A/B starts two):
#   KIMI_K3_MODEL=/models/kimi-k3 KIMI_K3_TP=8 KIMI_K3_DCP=8 bash ... --ab   # the real A/B
#   without KIMI_K3_MODEL: ab-self-check-*, stock vs stock on kvtide's tiny model, a check
#   of the A/B machinery that covers nothing.
# Exit 0 when every batch size passed and the specialised backend ran.
#
# --dry-run runs both parts on CPU: validate with the kernels' emulation at small
# batches, and the A/B's engine plans (nothing starts); tests/unit/test_kernels_script.py.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

part=kernels
dry=0
while [ $# -gt 0 ]; do
    case "$1" in
        --ab) part=ab; shift ;;
        --dry-run) dry=1; shift ;;
        -*) echo "unknown option $1 (--ab, --dry-run)" >&2; exit 2 ;;
        *) break ;;
    esac
done
OUT="${1:-evidence-$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"

# A budget is whole seconds, at least 1: `timeout 0` would mean no limit at all.
budget_of() {
    case "$2" in
        ''|*[!0-9]*) echo "$1 must be a whole number of seconds, got '$2'" >&2; exit 2 ;;
    esac
    if [ "$2" -lt 1 ]; then echo "$1 must be at least 1 second, got $2" >&2; exit 2; fi
    echo "$2"
}
KERNELS_BUDGET="$(budget_of KERNELS_BUDGET_S "${KERNELS_BUDGET_S:-470}")" || exit 2
AB_BUDGET="$(budget_of AB_BUDGET_S "${AB_BUDGET_S:-1800}")" || exit 2
deadline=0
start_budget() { deadline=$((SECONDS + $1)); }
# Seconds left, never under 1 (a stage past the deadline is killed at once, not unbounded).
left() { local l=$((deadline - SECONDS)); [ "$l" -lt 1 ] && l=1; echo "$l"; }
bounded() { timeout -k 10 "$(left)" "$@"; }

kernel_part() {
    start_budget "$KERNELS_BUDGET"
    if [ "$dry" = 1 ]; then
        echo "== host (dry run: CPU)" | tee "$OUT/host.txt"
        "$PY" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__)' >> "$OUT/host.txt" || return 2
        echo "== validate (dry run: the kernels' emulation, batches up to 3)"
        bounded "$PY" -m kernels validate --dry-run --max-batch 3 --out "$OUT/kernels-cpu"
        local status=$?
    else
        echo "== host" | tee "$OUT/host.txt"
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv >> "$OUT/host.txt" || {
            echo "nvidia-smi failed: no usable NVIDIA GPU here" >&2; return 2; }
        bounded "$PY" - >> "$OUT/host.txt" <<'PY' || { cat "$OUT/host.txt"; return 2; }
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
        local arch
        arch="$(bounded "$PY" -c 'import torch; from kernels.scope import arch_from_capability as a; print(a(*torch.cuda.get_device_capability()))')" || return 2
        echo "== validate ($arch; every case in scope, the shipped cubins)"
        bounded "$PY" -m kernels validate --out "$OUT/kernels-$arch"
        local status=$?
        echo "== timings at decode shapes"
        timeout -k 10 "$(( $(left) > 90 ? 90 : $(left) ))" "$PY" benchmarks/kernels.py --repeats 50 --arch "$arch" > "$OUT/timings.txt" 2>&1 || echo "timings incomplete (see timings.txt)"
        tail -25 "$OUT/timings.txt"
    fi
    echo "== evidence"
    bounded "$PY" -m kernels show --evidence-dir "$OUT" | tee "$OUT/show.txt"
    [ "$status" = 0 ] || echo "kernel part: a case failed or did not finish (status $status); see $OUT/kernels-*.md" >&2
    [ "$status" = 0 ] && return 0 || return 1
}

ab_part() {
    start_budget "$AB_BUDGET"
    local tp="${KIMI_K3_TP:-8}" dcp="${KIMI_K3_DCP:-1}"
    if [ "$dry" = 1 ]; then
        echo "== engine A/B (dry run: both sides' engine args, nothing starts)"
        bounded "$PY" -m kernels ab --model "${KIMI_K3_MODEL:-/models/kimi-k3}" --tp "$tp" --dcp "$dcp" --dry-run > "$OUT/ab-plan.json" || return 1
        bounded "$PY" -m kernels ab --model "$OUT/tiny-model" --tp 1 --self-check --batch 1 --batch 16 --batch 64 --dry-run > "$OUT/ab-self-check-plan.json" || return 1
        cat "$OUT/ab-plan.json"
        return 0
    fi
    bounded "$PY" -c 'import torch, vllm, sys; sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA GPU")' || {
        echo "the engine A/B needs vLLM's GPU build and a CUDA GPU here (the kernel part does not)" >&2; return 2; }
    local arch
    arch="$(bounded "$PY" -c 'import torch; from kernels.scope import arch_from_capability as a; print(a(*torch.cuda.get_device_capability()))')" || return 2
    echo "== engine A/B (budget ${AB_BUDGET}s)"
    if [ -n "${KIMI_K3_MODEL:-}" ]; then
        bounded "$PY" -m kernels ab --model "$KIMI_K3_MODEL" --tp "$tp" --dcp "$dcp" \
            --out "$OUT/ab-$arch-tp$tp-dcp$dcp" || return 1
    else
        local tiny="$OUT/tiny-model" status=0
        bounded "$PY" -c "from engines.tiny_model import generate_tiny_model as g; g('$tiny')" &&
        bounded "$PY" -m kernels ab --model "$tiny" --tp 1 --self-check \
            --batch 1 --batch 16 --batch 64 --max-tokens 32 --out "$OUT/ab-self-check-$arch" || status=1
        rm -rf "$tiny"
        return "$status"
    fi
}

if [ "$dry" = 1 ]; then
    kernel_part; k=$?
    ab_part; a=$?
    ls -l "$OUT"
    exit $(( k > a ? k : a ))
fi
if [ "$part" = ab ]; then
    ab_part; status=$?
else
    kernel_part; status=$?
fi
ls -l "$OUT"
[ "$status" = 0 ] || exit "$status"
cat <<MSG

Next: copy $OUT/kernels-*.json/.md and ab-*.json/.md (not self-checks) into
kernels/evidence/, commit them, then add to kernels.gate.VALIDATED a ValidatedScope per
file, no wider than what it passed (kernels: source_sha256 = the file's binding; vLLM's
path: arch, (TP, DCP), the batch range where it passed and was not slower, and the exact
vLLM version of the A/B). The gate checks each file on every decision. See docs/kernels.md.
MSG
exit "$status"
