#!/usr/bin/env bash
# dsv3lite's GPU benchmark suite, for the H200 benchmark machine (no internet, no bitsandbytes, no gradio).
#
#   bash benchmarks/gpu_suite.sh [RESULTS_DIR]        # default: runs/gpu-<date>-<time> (git-ignored)
#
# Installs the project offline (pip install --no-deps --no-build-isolation -e .), then runs the stages in
# order of value, each under its own timeout, each writing markdown tables into RESULTS_DIR as it goes, so a
# run cut short keeps what it measured. RESULTS_DIR/SUMMARY.md lists every stage with its status and time.
# The whole suite stays within about 5 minutes.
#
# Adding a stage: write a function stage_<name> (it runs in its own bash, with ROOT, RESULTS_DIR and PYTHON
# exported, from the repository root) and add "<name> <timeout_s>" to STAGES in the order of value.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS_DIR="${1:-$ROOT/runs/gpu-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$RESULTS_DIR"
RESULTS_DIR="$(cd "$RESULTS_DIR" && pwd)"
PYTHON="${PYTHON:-python}"
export ROOT RESULTS_DIR PYTHON
cd "$ROOT"

log() { echo "[gpu_suite $(date +%H:%M:%S)] $*" | tee -a "$RESULTS_DIR/suite.log" >&2; }

# ---- setup: environment record and offline install ------------------------------------------------------
setup() {
    {
        echo "# Environment"
        echo
        echo '```'
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
        "$PYTHON" -c 'import platform, torch; print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda, "| gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)' 2>&1
        "$PYTHON" -c 'import triton; print("triton", triton.__version__)' 2>&1
        git -C "$ROOT" log -1 --format='commit %H %s' 2>/dev/null || true
        git -C "$ROOT" status --short 2>/dev/null | head -50 || true
        echo '```'
    } > "$RESULTS_DIR/env.md"
    "$PYTHON" -m pip install --no-deps --no-build-isolation -e "$ROOT" > "$RESULTS_DIR/install.log" 2>&1 \
        || { log "pip install -e . failed (see install.log)"; return 1; }
    "$PYTHON" -c 'import dsv3lite.kernels.mla_decode, dsv3lite.kernels.fused_moe, dsv3lite.kernels.quant_matmul' \
        >> "$RESULTS_DIR/install.log" 2>&1 || { log "import check failed (see install.log)"; return 1; }
}

# ---- stage: kernels -------------------------------------------------------------------------------------
# Triton kernels (fused MoE, MLA decode, W4A16/W8A16) vs the copy/matmul peaks and their twins, each checked
# against its twin first. Writes kernels_*.md and kernels.json. About 60-90 s, most of it Triton compiling.
stage_kernels() {
    "$PYTHON" benchmarks/gpu_kernels.py "$RESULTS_DIR" --budget-s 75
}

# ---- stage: graphs --------------------------------------------------------------------------------------
# The decode step replayed from CUDA graphs against the eager step, resident and offloaded at 25%, at V3's routing
# geometry (tiny widths: host time): tok/s, graphs per step, tokens equal, and why graphs turned off if they did.
# Writes graphs.md. About 30-60 s.
stage_graphs() {
    "$PYTHON" benchmarks/gpu_graphs.py "$RESULTS_DIR" --tokens 64 --rounds 3
}

# ---- stage: offload -------------------------------------------------------------------------------------
# Expert offloading on synthetic DeepSeek-V3-shaped layers (4 MoE layers x 256 int4 experts, built in
# memory): pinned copy peak; decode tok/s all-resident vs offloaded with prefetch vs on demand at 25% and 50%
# of experts resident, hit rate, H2D GB/s vs peak, peak GPU memory vs --gpu-mem; the MTP verify cost; time per
# MoE layer vs HF accelerate device_map offload (one layer, bf16). Writes offload_*.md. About 60-90 s.
stage_offload() {
    "$PYTHON" benchmarks/gpu_offload.py "$RESULTS_DIR" --layers 4 --tokens 32
}

# ---- stage: kernel_tests --------------------------------------------------------------------------------
# The kernel-vs-twin unit tests on the real GPU (CI runs them only in Triton's interpreter). Last: it costs
# a compile per tested shape; cut short, it still leaves the tests that ran.
stage_kernel_tests() {
    local out="$RESULTS_DIR/kernel_tests.md"
    {
        echo "# Kernel tests on the GPU"
        echo
        echo '```'
    } > "$out"
    "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/test_kernels_moe.py tests/test_kernels_quant.py \
        tests/test_kernels_mla.py tests/test_dense_cuda.py 2>&1 | tee -a "$out" | tail -5
    local rc=${PIPESTATUS[0]}
    echo '```' >> "$out"
    return "$rc"
}

# ---- runner ---------------------------------------------------------------------------------------------
STAGES=(
    "kernels 110"
    "graphs 90"
    "offload 120"
    "kernel_tests 45"
)

run_stage() {
    local name=$1 limit=$2 start rc status
    start=$(date +%s)
    log "stage $name (timeout ${limit}s)"
    export -f "stage_$name"
    timeout --kill-after=10 "$limit" bash -c "stage_$name" > "$RESULTS_DIR/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status="ok" ;;
        124|137) status="timed out after ${limit}s (partial results kept)" ;;
        *) status="failed (exit $rc)" ;;
    esac
    echo "| $name | $status | $(( $(date +%s) - start )) s | $name.log |" >> "$RESULTS_DIR/SUMMARY.md"
    log "stage $name: $status"
}

{
    echo "# dsv3lite GPU suite, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo
    echo "| stage | status | time | log |"
    echo "|---|---|---|---|"
} > "$RESULTS_DIR/SUMMARY.md"

suite_start=$(date +%s)
if setup; then
    echo "| setup | ok | $(( $(date +%s) - suite_start )) s | install.log |" >> "$RESULTS_DIR/SUMMARY.md"
    for entry in "${STAGES[@]}"; do
        run_stage $entry
    done
else
    echo "| setup | failed | $(( $(date +%s) - suite_start )) s | install.log |" >> "$RESULTS_DIR/SUMMARY.md"
fi
log "done in $(( $(date +%s) - suite_start )) s; results in $RESULTS_DIR"
cat "$RESULTS_DIR/SUMMARY.md"
