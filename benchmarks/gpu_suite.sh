#!/usr/bin/env bash
# dsv3lite's GPU suite, for the H200 benchmark machine (python 3.12, torch 2.11, triton 3.6, numpy 2.5; no network,
# no bitsandbytes, no gradio). It installs nothing and never uses Triton's interpreter (which numpy >= 2.4 breaks
# under Triton 3.6): the checkout is imported through a folder of links (dsv3lite/ with kernels/, quant/ and app/
# inside, as an install lays them out) on PYTHONPATH.
#
#   bash benchmarks/gpu_suite.sh OUT               # at most 5 min 57 s on one H200
#   bash benchmarks/gpu_suite.sh --dry-run OUT     # any machine, no GPU: every stage's script started in its
#                                                  # dry-run form, the file count and the time budget checked
#
# OUT receives at most MAX_FILES files, no folders (the machine hands back 8 files at most):
#   SUMMARY.md    the results: environment, one line per stage, then every table measured; rewritten after each
#                 stage, so a run killed at its limit still returns what it measured
#   suite.log     every stage's output, as it runs
#   tests.log     the kernel tests, each by name with its outcome
#   tuning.json   the sweep's launch configurations (DSV3LITE_TUNING=tuning.json uses them; the later stages do)
#   raw.tar.gz    the stages' own files (tables, JSON), rewritten after each stage
# The stages run in order of value, each under its own limit, within SUITE_BUDGET_S in all. Adding a stage: a
# function stage_<name> (it runs in its own bash, from the link folder, with ROOT, WORK (its folder: $WORK/<name>),
# PYTHON and DRY_RUN exported) and "<name> <limit_s>" in STAGES.
set -u -o pipefail

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
if [ $# -ne 1 ]; then
    echo "usage: bash benchmarks/gpu_suite.sh [--dry-run] OUT" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
PYTHON="${PYTHON:-python}"
SUITE_BUDGET_S="${SUITE_BUDGET_S:-350}"   # the whole run, setup included (the machine allows 6 minutes; a stage
                                          # stopped at its limit gets 5 s more to end, the summary 2)
MAX_FILES=8
STAGES=(
    "setup 15"
    "compile 30"
    "kernels 65"
    "sweep 35"
    "prefill 25"
    "v4 35"
    "kernel_tests 65"
    "graphs 40"
    "offload 40"
)
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/dsv3lite-gpu-suite.XXXXXX")"
SITE="$SCRATCH/site"                   # the link folder on PYTHONPATH
WORK_ROOT="$SCRATCH/work"
mkdir -p "$SITE" "$WORK_ROOT"
export ROOT PYTHON DRY_RUN SITE
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
trap 'rm -rf "$SCRATCH"' EXIT
cd "$SITE"                             # (python -m puts the working folder first on sys.path: not the checkout)

log() { echo "[gpu_suite $(date +%H:%M:%S)] $*" >&2; }

# ---- stage: setup -----------------------------------------------------------------------------------------------
# The environment and an import check through the link folder (the other stages need it: if it fails, they do not
# run).
stage_setup() {
    {
        echo '```'
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
        "$PYTHON" -c 'import platform, torch, numpy; print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda, "| numpy", numpy.__version__, "| gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)' 2>&1
        "$PYTHON" -c 'import triton; print("triton", triton.__version__)' 2>&1
        git -C "$ROOT" log -1 --format='commit %H %s' 2>/dev/null || true
        git -C "$ROOT" status --short 2>/dev/null | head -20 || true
        echo '```'
    } > "$WORK/env.md"
    "$PYTHON" -c 'import dsv3lite, dsv3lite.kernels.fused_moe, dsv3lite.kernels.mla_decode, dsv3lite.kernels.quant_matmul, dsv3lite.kernels.tuning
assert dsv3lite.__file__.startswith(__import__("os").environ["SITE"]), dsv3lite.__file__
print("imports from", dsv3lite.__file__)'
}

# ---- stage: compile ---------------------------------------------------------------------------------------------
# Every launcher of this GPU's architecture run once at DeepSeek-V3 sizes, in parallel processes
# (dsv3lite/testing_gpu.py --warm): Triton compiles on all cores now, not one kernel at a time in the timed stages.
# A launch that fails here is reported with its error; the stages still run.
stage_compile() {
    if [ "$DRY_RUN" = 1 ]; then
        "$PYTHON" -m dsv3lite.testing_gpu --list
        return
    fi
    local shards=$(( $(nproc) > 4 ? $(nproc) - 2 : 2 )) i pids=() rc=0
    for (( i = 0; i < shards; i++ )); do
        "$PYTHON" -m dsv3lite.testing_gpu --warm "$i" "$shards" > "$WORK/warm$i.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || { rc=1; echo "compile shard $i:"; tail -20 "$WORK/warm$i.log"; }
    done
    {
        echo "### compile: this GPU's launchers at V3 sizes, $shards processes"
        echo
        cat "$WORK"/warm*.log | grep -E '^(warmed|failed)' | sort | uniq -c | sed 's/^/- /'
    } > "$WORK/compile.md"
    return $rc
}

dry() { [ "$DRY_RUN" = 1 ] && echo --dry-run; }

# ---- stage: kernels ---------------------------------------------------------------------------------------------
# Triton kernels (fused MoE, MLA decode, W4A16/W8A16) at DeepSeek-V3 sizes against the copy and matmul peaks and
# their twins, each checked against its twin first.
stage_kernels() {
    "$PYTHON" "$ROOT/benchmarks/gpu_kernels.py" "$WORK" --sections peaks,moe,mla,gemv --budget-s 55 $(dry)
}

# ---- stage: sweep -----------------------------------------------------------------------------------------------
# The batch-1 kernels' candidate configurations (kernels/tuning.py) against the defaults; the winners go to
# OUT/tuning.json, which the later stages use.
stage_sweep() {
    "$PYTHON" "$ROOT/benchmarks/gpu_kernels.py" "$WORK" --sections peaks,sweep --budget-s 30 \
        --tuning-out "$WORK/tuning.json" $(dry)
}

# ---- stage: prefill ---------------------------------------------------------------------------------------------
# The grouped fused-MoE kernels (prompts) against the dequantizing path they replace.
stage_prefill() {
    "$PYTHON" "$ROOT/benchmarks/gpu_kernels.py" "$WORK" --sections peaks,prefill --budget-s 22 $(dry)
}

# ---- stage: v4 --------------------------------------------------------------------------------------------------
# DeepSeek-V4-Flash's kernels at its widths, each checked against its twin first: the mxfp4 experts with their SwiGLU
# clamp (decode M = 1 and 2, the grouped prefill over 512 tokens) and the decode attention (CSA top-512 at 64K, HCA at
# 64K and 1M, sliding, an MTP verify pass; batch 1 / 8 / 32) with the indexer's scan at 64K and 1M, against the bytes
# they read at the copy peak.
stage_v4() {
    "$PYTHON" "$ROOT/benchmarks/gpu_kernels.py" "$WORK" --sections peaks,v4moe,v4attn --budget-s 29 $(dry)
}

# ---- stage: kernel_tests ----------------------------------------------------------------------------------------
# The kernel-vs-twin unit tests on the GPU (CI runs them in Triton's interpreter), in parallel shards, every test
# named with its outcome.
stage_kernel_tests() {
    "$PYTHON" "$ROOT/benchmarks/gpu_tests.py" "$WORK" --budget-s 57 $(dry)
}

# ---- stage: graphs ----------------------------------------------------------------------------------------------
# The decode step replayed from CUDA graphs against the eager step at V3's and then V4-Flash's routing geometry
# (tiny widths; the table is rewritten after each engine, so a stage cut at its limit keeps what it measured).
stage_graphs() {
    "$PYTHON" "$ROOT/benchmarks/gpu_graphs.py" "$WORK" --tokens 32 --rounds 2 $(dry)
}

# ---- stage: offload ---------------------------------------------------------------------------------------------
# Expert offloading on synthetic V3-shaped layers (int4 experts in memory): copy peak, decode tok/s resident vs
# offloaded with prefetch vs on demand, the MTP verify cost, then HF accelerate's offload (last: the most likely cut).
stage_offload() {
    "$PYTHON" "$ROOT/benchmarks/gpu_offload.py" "$WORK" --layers 2 --tokens 24 --stages copy,decode,mtp,accelerate \
        $(dry)
}

# ---- runner -----------------------------------------------------------------------------------------------------
STATUS_ROWS=()

summary() {
    # OUT/SUMMARY.md from what the stages have written so far; OUT's other files beside it
    local tmp="$OUT/.SUMMARY.md.partial" entry name
    {
        echo "# dsv3lite GPU suite$([ "$DRY_RUN" = 1 ] && echo ' (dry run)'), $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
        echo
        [ -f "$WORK_ROOT/setup/env.md" ] && cat "$WORK_ROOT/setup/env.md" && echo
        echo "| stage | status | time | limit |"
        echo "|---|---|---|---|"
        for entry in "${STATUS_ROWS[@]}"; do echo "$entry"; done
        echo
        for entry in "${STAGES[@]}"; do
            name=${entry%% *}
            [ "$name" = setup ] || [ ! -d "$WORK_ROOT/$name" ] && continue
            echo "## $name"
            echo
            # (the sweep and prefill stages measure the peaks again for their own tables: shown once, by kernels)
            find "$WORK_ROOT/$name" -maxdepth 1 -name '*.md' -printf '%T@ %p\n' | sort -n | cut -d' ' -f2- |
                while read -r f; do
                    case "$name:$(basename "$f")" in kernels:*) ;; *:kernels_env.md|*:kernels_peaks.md) continue ;; esac
                    cat "$f"; echo
                done
            if [ -f "$WORK_ROOT/$name.failed" ]; then
                echo "Last lines of its output (all of it: suite.log):"
                echo
                echo '```'
                tail -25 "$WORK_ROOT/$name.log"
                echo '```'
                echo
            fi
        done
    } > "$tmp"
    mv "$tmp" "$OUT/SUMMARY.md"
    [ -f "$WORK_ROOT/kernel_tests/tests.log" ] && cp "$WORK_ROOT/kernel_tests/tests.log" "$OUT/tests.log"
    [ -f "$WORK_ROOT/sweep/tuning.json" ] && cp "$WORK_ROOT/sweep/tuning.json" "$OUT/tuning.json"
    tar -czf "$OUT/.raw.tar.gz.partial" -C "$WORK_ROOT" . 2>/dev/null && mv "$OUT/.raw.tar.gz.partial" "$OUT/raw.tar.gz"
}

run_stage() {
    local name=$1 limit=$2 start rc status left
    start=$(date +%s)
    left=$(( SUITE_BUDGET_S - (start - SUITE_START) - 5 ))
    if [ "$left" -lt 10 ]; then
        STAGE_RC+=(124)
        STATUS_ROWS+=("| $name | **not run**: the suite's ${SUITE_BUDGET_S} s are spent | 0 s | ${limit} s |")
        summary
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    mkdir -p "$WORK_ROOT/$name"
    [ -f "$OUT/tuning.json" ] && export DSV3LITE_TUNING="$OUT/tuning.json"
    log "stage $name (limit ${limit} s)"
    echo "===== stage $name (limit ${limit} s) $(date -u +%H:%M:%S)" >> "$OUT/suite.log"
    export -f "stage_$name" dry
    WORK="$WORK_ROOT/$name" timeout --kill-after=5 "$limit" bash -c "stage_$name" 2>&1 |
        tee "$WORK_ROOT/$name.log" >> "$OUT/suite.log"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status="ok" ;;
        124|137) status="**stopped at its limit** (what it measured is kept)"; touch "$WORK_ROOT/$name.failed" ;;
        *) status="**failed** (exit $rc)"; touch "$WORK_ROOT/$name.failed" ;;
    esac
    STAGE_RC+=("$rc")
    STATUS_ROWS+=("| $name | $status | $(( $(date +%s) - start )) s | ${limit} s |")
    log "stage $name: $status"
    summary
}

dry_run_checks() {
    # the checks a dry run exists for: the budget, every stage's script started, the files OUT would hold
    local total=0 entry problems=() files dirs
    for entry in "${STAGES[@]}"; do total=$(( total + ${entry##* } )); done
    [ "$total" -le "$SUITE_BUDGET_S" ] || problems+=("the stages' limits add up to ${total} s, over ${SUITE_BUDGET_S} s")
    [ "$SUITE_BUDGET_S" -le 360 ] || problems+=("SUITE_BUDGET_S ${SUITE_BUDGET_S} s is over the machine's 6 minutes")
    for i in "${!STAGE_RC[@]}"; do
        [ "${STAGE_RC[$i]}" = 0 ] || problems+=("stage ${STAGES[$i]%% *}: its script did not start (exit ${STAGE_RC[$i]})")
    done
    files=$(find "$OUT" -mindepth 1 -maxdepth 1 -type f | wc -l)
    dirs=$(find "$OUT" -mindepth 1 -type d | wc -l)
    [ "$files" -le "$MAX_FILES" ] || problems+=("OUT holds ${files} files, over ${MAX_FILES}")
    [ "$dirs" -eq 0 ] || problems+=("OUT holds ${dirs} folders")
    echo "dry run: ${#STAGES[@]} stages, limits ${total} s of ${SUITE_BUDGET_S} s; OUT: ${files} files (at most ${MAX_FILES}), ${dirs} folders: $(cd "$OUT" && ls | tr '\n' ' ')"
    for entry in "${STAGES[@]}"; do echo "  ${entry%% *}: limit ${entry##* } s"; done
    if [ "${#problems[@]}" -gt 0 ]; then
        printf 'dry run FAILED: %s\n' "${problems[@]}"
        return 1
    fi
    echo "dry run ok"
}

rm -f "$OUT/SUMMARY.md" "$OUT/suite.log" "$OUT/tests.log" "$OUT/tuning.json" "$OUT/raw.tar.gz"
mkdir -p "$WORK_ROOT"
mkdir -p "$SITE/dsv3lite"
for entry in "$ROOT"/dsv3lite/*; do ln -s "$entry" "$SITE/dsv3lite/"; done
for pkg in kernels quant app; do ln -s "$ROOT/$pkg" "$SITE/dsv3lite/$pkg"; done

SUITE_START=$(date +%s)
STAGE_RC=()
for entry in "${STAGES[@]}"; do
    run_stage $entry
    if [ "${entry%% *}" = setup ] && [ "${STAGE_RC[0]:-1}" != 0 ] && [ "$DRY_RUN" = 0 ]; then
        log "setup failed: the stages need its imports (see SUMMARY.md)"
        break
    fi
done
log "done in $(( $(date +%s) - SUITE_START )) s; results in $OUT"
if [ "$DRY_RUN" = 1 ]; then
    dry_run_checks
    exit $?
fi
for rc in "${STAGE_RC[@]}"; do [ "$rc" = 0 ] || exit 1; done
