#!/usr/bin/env bash
# The lab's CUDA path checked in one go on a machine with one GPU, within 8 minutes (16 cores, torch preinstalled,
# no network):
#
#     bash gpu_check.sh                  # on the GPU machine: GPU steps, then the CPU test suite
#     bash gpu_check.sh --skip-suite     # the GPU steps only
#     bash gpu_check.sh --cpu-only       # the same steps on CPU, the CUDA-only ones skipped: checks the script itself
#
#  1. Python: this machine's own torch, torchvision and Pillow when it has them (no install, no network needed;
#     pytest only for step 9), else requirements-dev.txt into .venv. The versions are printed.
#  2. The GPU: name, memory, torch's CUDA and NCCL versions, the precision `auto` takes.
#  3. Synthetic data in the image-folder layout.
#  4. Both modes, 2 epochs, one rank on CUDA with NCCL (--expected-world-size 1), precision auto, deterministic
#     mode, 2 windows of epoch 1 profiled (CPU and CUDA activity); torch.cuda.set_sync_debug_mode warns in
#     epoch 1 (DDP rebuilds its buckets there, the profiler synchronizes at its edges) and fails the run on any
#     host synchronization in the training loop from epoch 2 (tests/inject/sitecustomize.py).
#  5. verify.py --expect-from-config on the two runs, the profiler's witness included; the timeline picture.
#  5b. Both modes, 2 epochs, two ranks on the one device: on CUDA over gloo (--gpu-backend gloo; NCCL refuses two
#     ranks on one GPU, and gloo's copies through host memory are host syncs, so no sync-debug mode here): the
#     ranks' fingerprints, buffer broadcasts and 2-rank counts on CUDA. verify.py must then refuse exactly the
#     checklist's item 1 (two ranks shared one GPU), which it checks after every other item of epoch 1; on
#     CPU it passes.
#  6. `every` again, unprofiled: its weights must equal the first run's bit for bit.
#  7. Both modes, 1 epoch, --activation-checkpointing: verify.py passes, with the peak memory per epoch.
#  8. benchmarks/bench_speed.py (one process: floor, each loader) and benchmarks/bench_checkpointing.py
#     (saved activations, time and CUDA peak memory per micro-batch size).
#  9. The test suite (the CPU suite, which must pass on a GPU machine too; with pytest-xdist when present), last
#     and only within what is left of the 8 minutes; skipped with --skip-suite or --cpu-only (`make test` runs it).
# At most 8 files land in $OUT when it is set, else in artifacts/gpu_check/: summary.txt (every step's verdict and
# the benchmark tables), verify.txt, train.log (every run's stderr), speed.json, checkpointing.json,
# timeline.png, profile.json (every's profiled windows), tests.log.
set -euo pipefail
cd "$(dirname "$0")"
# The checkout on the path, first: tools/ and benchmarks/ import the lab's package, model.py and train.py (the
# Makefile installs the package editable instead; a GPU machine's own Python has no network to install it).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

BUDGET_SECONDS=480
DEVICE=cuda
RUN_SUITE=1
for option in "$@"; do
    case $option in
        --cpu-only) DEVICE=cpu; RUN_SUITE=0 ;;
        --skip-suite) RUN_SUITE=0 ;;
        *) echo "gpu_check.sh: unknown option $option (the options are --skip-suite and --cpu-only)" >&2; exit 2 ;;
    esac
done
RESULTS=${OUT:-artifacts/gpu_check}
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.txt"
TRAIN_LOG="$RESULTS/train.log"
: >"$SUMMARY"
: >"$TRAIN_LOG"
export PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo  # one machine: loopback only
START=$SECONDS

step() { echo; echo "== $* ($((SECONDS - START)) s)"; }
passed() { echo "PASSED  $*" | tee -a "$SUMMARY"; }
failed() { echo "FAILED  $*" | tee -a "$SUMMARY"; FAILURES=$((FAILURES + 1)); }
FAILURES=0

step "1. Python"
if [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
elif python3 -c "import torch, torchvision, PIL" 2>/dev/null; then
    PY=python3
else
    python3 -m venv .venv
    .venv/bin/pip install --quiet -r requirements-dev.txt
    PY=.venv/bin/python
fi
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nnodes=1)
"$PY" -c "import sys, torch, torchvision, PIL; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, torchvision {torchvision.__version__}, Pillow {PIL.__version__}')" | tee -a "$SUMMARY"

step "2. The device"
if [[ $DEVICE == cuda ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$SUMMARY" || true
    "$PY" -c "import torch; print(f'{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}, NCCL {\".\".join(map(str, torch.cuda.nccl.version()))}')" | tee -a "$SUMMARY"
fi
"$PY" -c "import torch; from ddp_no_sync_lab.precision import choose_precision; print('precision auto:', choose_precision('auto', torch.device('$DEVICE', 0 if '$DEVICE' == 'cuda' else None)).reason)" | tee -a "$SUMMARY"

step "3. Synthetic data"
"$PY" tools/synthetic_data.py --out "$WORK/data" --train-source 4000 --test 1000

run_mode() {  # mode, output folder, more train.py options (RANKS=2: two ranks); its stderr is appended to train.log
    local environment=() ranks=${RANKS:-1}
    [[ $DEVICE == cuda && $ranks == 1 ]] && environment=(env "PYTHONPATH=tests/inject${PYTHONPATH:+:$PYTHONPATH}" LAB_TEST_SYNC_DEBUG=1)
    [[ $DEVICE == cuda && $ranks == 2 ]] && environment=(env CUDA_VISIBLE_DEVICES=0)  # one GPU, however many there are
    echo "== train.py --mode $1 --output $2 ${*:3} ($ranks rank(s))" >>"$TRAIN_LOG"
    "${environment[@]}" "${TORCHRUN[@]}" --nproc-per-node="$ranks" train.py --mode "$1" --output "$2" --data-dir "$WORK/data" \
        --expected-world-size "$ranks" --device "$DEVICE" --progress-every 10 "${@:3}" >"$2.out" 2>"$2.err"
    local status=$?
    cat "$2.err" >>"$TRAIN_LOG"
    return $status
}
first_error() { grep -m1 -E "Error|error" "$1" || tail -1 "$1"; }

step "4. Both modes on $DEVICE, one rank, 2 epochs, profiled"
mkdir -p "$WORK/runs" "$WORK/rerun" "$WORK/checkpointed"
for mode in every no_sync; do
    if run_mode "$mode" "$WORK/runs/$mode" --epochs 2 --profile-windows 2; then
        sync_note=""
        if [[ $DEVICE == cuda ]]; then
            warnings=$(grep -c "called a synchronizing CUDA operation" "$WORK/runs/$mode.err" || true)
            sync_note="; host syncs in epoch 1 (warned): $warnings; from epoch 2: none (an error)"
        fi
        passed "$mode on $DEVICE: 2 epochs$sync_note"
    else
        failed "$mode on $DEVICE: $(first_error "$WORK/runs/$mode.err")"
    fi
done

step "5. verify.py --expect-from-config"
if "$PY" verify.py --artifacts "$WORK/runs" --expect-from-config >"$RESULTS/verify.txt" 2>&1; then
    cp "$WORK/runs/timeline.png" "$WORK/runs/every/profile.json" "$RESULTS/" 2>/dev/null || true
    passed "verify: $(tail -1 "$RESULTS/verify.txt")"
else
    failed "verify: $(tail -1 "$RESULTS/verify.txt")"
fi

step "5b. Two ranks on one $DEVICE device, both modes, 2 epochs"
mkdir -p "$WORK/shared"
shared_ok=1
for mode in every no_sync; do
    RANKS=2 run_mode "$mode" "$WORK/shared/$mode" --epochs 2 --gpu-backend gloo || shared_ok=0
done
"$PY" verify.py --artifacts "$WORK/shared" --expect-from-config >"$WORK/shared.txt" 2>&1 && shared_status=0 || shared_status=$?
refusal=$(grep -m1 "checklist item 1" "$WORK/shared.txt" || true)
if [[ $shared_ok == 0 ]]; then
    failed "two ranks on one device: $(first_error "$WORK/shared/every.err") $(first_error "$WORK/shared/no_sync.err")"
elif [[ $DEVICE == cpu && $shared_status == 0 ]]; then
    passed "two ranks on one CPU: $(tail -1 "$WORK/shared.txt")"
elif [[ $DEVICE == cuda && $shared_status == 1 && $refusal == *"2 ranks shared 1 GPUs"* ]]; then
    passed "two ranks on one GPU over gloo: every check of epoch 1 held, then item 1 refused as it must be: $refusal"
else
    failed "two ranks on one device: verify exit $shared_status: $(tail -1 "$WORK/shared.txt")"
fi

step "6. A rerun of every, bit for bit"
if run_mode every "$WORK/rerun/every" --epochs 2 && "$PY" - "$WORK/runs/every/model.pt" "$WORK/rerun/every/model.pt" <<'EOF'
import sys, torch
first, second = (torch.load(path, weights_only=True)["model"] for path in sys.argv[1:])
differing = [name for name in first if not torch.equal(first[name], second[name])]
print(f"tensors differing between the two runs: {len(differing)} of {len(first)} {differing[:3]}")
sys.exit(1 if differing else 0)
EOF
then
    passed "rerun of every: identical weights"
else
    failed "rerun of every: weights differ, or the rerun failed ($(first_error "$WORK/rerun/every.err"))"
fi

step "7. Activation checkpointing, both modes, 1 epoch"
checkpointed_ok=1
for mode in every no_sync; do
    run_mode "$mode" "$WORK/checkpointed/$mode" --epochs 1 --activation-checkpointing || checkpointed_ok=0
done
if [[ $checkpointed_ok == 1 ]] && "$PY" verify.py --artifacts "$WORK/checkpointed" --expect-from-config >"$WORK/checkpointed.txt" 2>&1; then
    passed "activation checkpointing: $(grep -E '^\| no_sync \| on \|' "$WORK/checkpointed.txt" || true) $(tail -1 "$WORK/checkpointed.txt")"
else
    failed "activation checkpointing: $(tail -1 "$WORK/checkpointed.txt" 2>/dev/null || first_error "$WORK/checkpointed/no_sync.err")"
fi

step "8. Benchmarks: speed (floor and each loader) and activation checkpointing, one process"
if "$PY" benchmarks/bench_speed.py --data-dir "$WORK/data" --nproc-per-node 1 --device "$DEVICE" --output "$RESULTS/speed.json" \
    >"$WORK/speed.txt" 2>&1; then
    passed "bench_speed:"
    cat "$WORK/speed.txt" >>"$SUMMARY"
else
    failed "bench_speed: $(tail -1 "$WORK/speed.txt")"
fi
if "$PY" benchmarks/bench_checkpointing.py --device "$DEVICE" --output "$RESULTS/checkpointing.json" >"$WORK/checkpointing.txt" 2>&1; then
    passed "bench_checkpointing:"
    cat "$WORK/checkpointing.txt" >>"$SUMMARY"
else
    failed "bench_checkpointing: $(tail -1 "$WORK/checkpointing.txt")"
fi

if [[ $RUN_SUITE == 1 ]]; then
    left=$((BUDGET_SECONDS - (SECONDS - START) - 15))
    step "9. The test suite, within the $left s left"
    if ! "$PY" -c "import pytest" 2>/dev/null; then
        echo "SKIPPED test suite: pytest is not installed here" | tee -a "$SUMMARY"
    elif [[ $left -lt 60 ]]; then
        echo "SKIPPED test suite: $left s left of the budget" | tee -a "$SUMMARY"
    else
        parallel=()  # 16 cores: several test files at once when pytest-xdist is there
        "$PY" -c "import xdist" 2>/dev/null && parallel=(-n 6 --dist loadfile)
        if timeout "$left" "$PY" -m pytest -q "${parallel[@]}" tests >"$RESULTS/tests.log" 2>&1; then
            passed "test suite: $(tail -1 "$RESULTS/tests.log")"
        elif [[ $? == 124 ]]; then
            echo "UNFINISHED test suite: stopped at the budget after $left s (tests.log)" | tee -a "$SUMMARY"
        else
            failed "test suite: $(tail -1 "$RESULTS/tests.log") (tests.log)"
        fi
    fi
fi

echo
echo "== Summary ($DEVICE, $((SECONDS - START)) s)" | tee -a "$SUMMARY"
cat "$SUMMARY"
if [[ $FAILURES -eq 0 ]]; then echo "GPU CHECK PASSED" | tee -a "$SUMMARY"; else echo "GPU CHECK FAILED: $FAILURES step(s)" | tee -a "$SUMMARY"; fi
exit $((FAILURES > 0))
