"""The watcher's cost: a user's no_sync epoch of the lab's CNN, plain and under `-m ddp_no_sync_lab.watch`, in a
hand-written loop and in Lightning's.

    .venv/bin/python benchmarks/bench_watch.py                  # 2 ranks on CPU (gloo), 100 windows of 4 x 50
    .venv/bin/python benchmarks/bench_watch.py --windows 25 --repeats 5 --loops plain

benchmarks/watch_loop.py (the document's loop, nothing of the lab's machinery: CifarCNN, AdamW, batch 50, windows
of 4) and benchmarks/watch_loop_lightning.py (the same in Lightning, accumulate_grad_batches=4) under torchrun with
2 ranks, each plain and watched, in turns (the order alternating per repeat), each start timing its own training
loop after a warm-up window (not the imports or the rendezvous). Overhead = the watched run's median over the
plain run's, minus one, per loop. The table is printed and written with every measured time to
artifacts/bench/watch.json.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_speed import machine
from ddp_no_sync_lab import cli, files

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "bench_watch.py"
VARIANTS = {"plain": [], "watched": ["-m", "ddp_no_sync_lab.watch"]}
LOOPS = {"plain": "watch_loop.py", "lightning": "watch_loop_lightning.py"}  # the loop's style: its script


def parse_args():
    parser = cli.ArgumentParser(prog=SCRIPT, description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=cli.positive_int, default=100, help="timed windows per rank (100: an epoch)")
    parser.add_argument("--batch-size", type=cli.positive_int, default=50)
    parser.add_argument("--repeats", type=cli.positive_int, default=3, help="timed starts per variant")
    parser.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS), help="the loops timed")
    parser.add_argument("--output", type=Path, default=Path("artifacts/bench/watch.json"))
    return parser.parse_args()


def run_loop(loop, variant, args):
    """One torchrun start of the loop, plain or watched: its timed seconds (rank 0's own clock)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += [*VARIANTS[variant], str(REPO / "benchmarks" / LOOPS[loop])]
    command += ["--windows", str(args.windows), "--batch-size", str(args.batch_size)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"loop_seconds"')]
    if result.returncode != 0 or not lines:
        raise cli.LabError(f"the {loop} loop, {variant}, failed (status {result.returncode}): {result.stderr[-2000:]}")
    if variant == "watched" and "AUDIT PASSED" not in result.stdout:
        raise cli.LabError(f"the {loop} loop was not passed by the watcher: {result.stdout[-2000:]}")
    return json.loads(lines[0])


def main():
    args = parse_args()
    seconds = {loop: {variant: [] for variant in VARIANTS} for loop in args.loops}
    for repeat in range(args.repeats):
        for loop in args.loops:
            for variant in list(VARIANTS)[:: 1 if repeat % 2 == 0 else -1]:
                measured = run_loop(loop, variant, args)
                seconds[loop][variant].append(measured["loop_seconds"])
                print(
                    f"repeat {repeat + 1}/{args.repeats}, {loop} loop, {variant}: {measured['loop_seconds']:.2f} s",
                    file=sys.stderr,
                )
    medians = {
        loop: {variant: statistics.median(times) for variant, times in by.items()} for loop, by in seconds.items()
    }
    overheads = {loop: by["watched"] / by["plain"] - 1 for loop, by in medians.items()}
    micro_batches = args.windows * 4
    print(f"\nThe watcher's cost: {args.windows} windows of 4 micro-batches of {args.batch_size} per rank, 2 ranks")
    print("| loop | run | median seconds | ms per micro-batch | every start's seconds |")
    print("|---|---|---:|---:|---|")
    for loop, by in seconds.items():
        for variant, times in by.items():
            median = medians[loop][variant]
            per = 1000 * median / micro_batches
            print(f"| {loop} | {variant} | {median:.2f} | {per:.1f} | {', '.join(f'{t:.2f}' for t in times)} |")
    for loop, overhead in overheads.items():
        print(f"overhead, {loop} loop: {100 * overhead:+.1f} %")
    record = {
        "machine": machine("cpu"),
        "windows": args.windows,
        "batch_size": args.batch_size,
        "accum_steps": 4,
        "seconds": seconds,
        "medians": medians,
        "overheads": overheads,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(args.output, files.json_bytes(record))
    print(f"written: {args.output}")


if __name__ == "__main__":
    try:
        main()
    except cli.LabError as error:
        cli.exit_with(error, SCRIPT)
