#!/usr/bin/env bash
# The lab's CUDA path checked in one go, on a machine with one GPU (sized to fit 10 minutes with 16 cores):
#
#     bash gpu_check.sh              # on the GPU machine
#     bash gpu_check.sh --cpu-only   # the same steps on CPU, the CUDA-only ones skipped: checks the script itself
#
#  1. Python: the requirements are installed into .venv unless this Python has torch, torchvision, Pillow and
#     pytest already (a machine without network keeps its own; the versions are printed).
#  2. The GPU: name, memory, torch's CUDA and NCCL versions.
#  3. The test suite (the CPU suite, which must pass on a GPU machine too; skipped with --cpu-only, where
#     `make test` is the way to run it).
#  4. Synthetic data in the image-folder layout (no network needed).
#  5. Both modes, 2 epochs, one rank on CUDA with NCCL (--expected-world-size 1), BF16 autocast, deterministic
#     mode, 2 windows of epoch 1 profiled (CPU and CUDA activity); torch.cuda.set_sync_debug_mode warns in
#     epoch 1 (DDP rebuilds its buckets there, the profiler synchronizes at its edges) and fails the run on any
#     host synchronization in the training loop from epoch 2 (tests/inject/sitecustomize.py).
#  6. verify.py --expect-from-config on the two runs, the profiler's witness included; the timeline picture.
#  7. `every` again, unprofiled: its weights must equal the first run's bit for bit (deterministic mode on
#     this device, and profiling changes nothing).
#  8. benchmarks/bench_speed.py with one process: the compute floor, each loader's training and evaluation
#     speed (images per second), the whole process per loader.
#  9. benchmarks/bench_checkpointing.py: saved-activation bytes, time and CUDA peak memory per micro-batch
#     size, plain and with activation checkpointing.
# Everything lands in $OUT when it is set, else in artifacts/gpu_check/; the last lines sum it up.
set -euo pipefail
cd "$(dirname "$0")"

DEVICE=cuda
if [[ "${1:-}" == "--cpu-only" ]]; then
    DEVICE=cpu
elif [[ $# -gt 0 ]]; then
    echo "gpu_check.sh: unknown option $1 (the only one is --cpu-only)" >&2
    exit 2
fi
RESULTS=${OUT:-artifacts/gpu_check}
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo  # one machine: loopback only

step() { echo; echo "== $* ($(date +%T))"; }
passed() { echo "PASSED  $*" | tee -a "$SUMMARY"; }
failed() { echo "FAILED  $*" | tee -a "$SUMMARY"; FAILURES=$((FAILURES + 1)); }
FAILURES=0

step "1. Python"
if [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
elif python3 -c "import torch, torchvision, PIL, pytest" 2>/dev/null; then
    PY=python3
else
    python3 -m venv .venv
    .venv/bin/pip install --quiet -r requirements-dev.txt
    PY=.venv/bin/python
fi
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=1)
"$PY" -c "import sys, torch, torchvision, PIL; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, torchvision {torchvision.__version__}, Pillow {PIL.__version__}')" | tee -a "$SUMMARY"

if [[ $DEVICE == cuda ]]; then
    step "2. The GPU"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$SUMMARY" || true
    "$PY" -c "import torch; print(f'{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}, NCCL {\".\".join(map(str, torch.cuda.nccl.version()))}, BF16 supported: {torch.cuda.is_bf16_supported()}')" | tee -a "$SUMMARY"

    step "3. The test suite"
    parallel=()  # 16 cores: four test files at once when pytest-xdist is there (the suite takes 12 min on 2)
    "$PY" -c "import xdist" 2>/dev/null && parallel=(-n 4 --dist loadfile)
    if "$PY" -m pytest -q -x "${parallel[@]}" tests 2>&1 | tee "$RESULTS/tests.log" | tail -5; [[ ${PIPESTATUS[0]} -eq 0 ]]; then
        passed "test suite: $(tail -1 "$RESULTS/tests.log")"
    else
        failed "test suite: $(tail -1 "$RESULTS/tests.log") (tests.log)"
    fi
fi

step "4. Synthetic data"
"$PY" synthetic_data.py --out "$WORK/data" --train-source 4000 --test 1000

step "5. Both modes on $DEVICE, one rank, 2 epochs"
mkdir -p "$WORK/runs" "$WORK/rerun"
run_mode() {  # mode, output folder, more train.py options
    local sync_debug=()
    [[ $DEVICE == cuda ]] && sync_debug=(env "PYTHONPATH=tests/inject${PYTHONPATH:+:$PYTHONPATH}" LAB_TEST_SYNC_DEBUG=1)
    "${sync_debug[@]}" "${TORCHRUN[@]}" train.py --mode "$1" --output "$2" --data-dir "$WORK/data" --epochs 2 \
        --expected-world-size 1 --device "$DEVICE" --progress-every 10 "${@:3}" >"$2.out" 2>"$2.err"
}
for mode in every no_sync; do
    if run_mode "$mode" "$WORK/runs/$mode" --profile-windows 2; then
        warnings=$(grep -c "called a synchronizing CUDA operation" "$WORK/runs/$mode.err" || true)
        sync_note=""
        [[ $DEVICE == cuda ]] && sync_note="; host syncs in epoch 1 (warned): $warnings; from epoch 2: none (an error)"
        passed "$mode on $DEVICE: 2 epochs$sync_note"
    else
        failed "$mode on $DEVICE: $(grep -m1 -E "Error|error" "$WORK/runs/$mode.err" || tail -1 "$WORK/runs/$mode.err")"
    fi
    cp "$WORK/runs/$mode.err" "$RESULTS/$mode.stderr.txt" || true
done

step "6. verify.py --expect-from-config"
if "$PY" verify.py --artifacts "$WORK/runs" --expect-from-config | tee "$RESULTS/verify.txt"; then
    cp "$WORK/runs/timeline.png" "$WORK/runs/every/profile.json" "$RESULTS/" 2>/dev/null || true
    passed "verify: $(tail -1 "$RESULTS/verify.txt")"
else
    failed "verify: $(tail -1 "$RESULTS/verify.txt")"
fi

step "7. A rerun of every, bit for bit"
if run_mode every "$WORK/rerun/every" && "$PY" - "$WORK/runs/every/model.pt" "$WORK/rerun/every/model.pt" <<'EOF'
import sys, torch
first, second = (torch.load(path, weights_only=True)["model"] for path in sys.argv[1:])
differing = [name for name in first if not torch.equal(first[name], second[name])]
print(f"tensors differing between the two runs: {len(differing)} of {len(first)} {differing[:3]}")
sys.exit(1 if differing else 0)
EOF
then
    passed "rerun of every: identical weights"
else
    failed "rerun of every: weights differ (or the rerun failed: $WORK/rerun/every.err)"
fi

step "8. Speed: floor and each loader, one process"
if "$PY" benchmarks/bench_speed.py --data-dir "$WORK/data" --nproc-per-node 1 --device "$DEVICE" --output "$RESULTS/speed.json" \
    | tee "$RESULTS/speed.txt"; then
    passed "bench_speed: table in speed.txt"
else
    failed "bench_speed (speed.txt)"
fi

step "9. Activation checkpointing: memory and time per micro-batch size, one process"
if "$PY" benchmarks/bench_checkpointing.py --device "$DEVICE" --output "$RESULTS/checkpointing.json" \
    | tee "$RESULTS/checkpointing.txt"; then
    passed "bench_checkpointing: table in checkpointing.txt"
else
    failed "bench_checkpointing (checkpointing.txt)"
fi

echo
echo "== Summary ($DEVICE)"
cat "$SUMMARY"
[[ $FAILURES -eq 0 ]] && echo "GPU CHECK PASSED" || echo "GPU CHECK FAILED: $FAILURES step(s)"
exit $((FAILURES > 0))
