"""The watcher's cost: a user's no_sync epoch of the lab's CNN, plain and under `-m ddp_no_sync_lab.watch`.

    .venv/bin/python benchmarks/bench_watch.py                  # 2 ranks on CPU (gloo), 100 windows of 4 x 50
    .venv/bin/python benchmarks/bench_watch.py --windows 25 --repeats 5

benchmarks/watch_loop.py (the document's loop, nothing of the lab's machinery: CifarCNN, AdamW, batch 50, windows
of 4) under torchrun with 2 ranks, plain and watched, in turns (the order alternating per repeat), each start
timing its own training loop after a warm-up window (not torch's import or the rendezvous). Overhead = the
watched run's median over the plain run's, minus one. The table is printed and written with every measured
time to artifacts/bench/watch.json.
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


def parse_args():
    parser = cli.ArgumentParser(prog=SCRIPT, description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=cli.positive_int, default=100, help="timed windows per rank (100: an epoch)")
    parser.add_argument("--batch-size", type=cli.positive_int, default=50)
    parser.add_argument("--repeats", type=cli.positive_int, default=3, help="timed starts per variant")
    parser.add_argument("--output", type=Path, default=Path("artifacts/bench/watch.json"))
    return parser.parse_args()


def run_loop(variant, args):
    """One torchrun start of the loop, plain or watched: its timed seconds (rank 0's own clock)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += [*VARIANTS[variant], str(REPO / "benchmarks" / "watch_loop.py")]
    command += ["--windows", str(args.windows), "--batch-size", str(args.batch_size)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"loop_seconds"')]
    if result.returncode != 0 or not lines:
        raise cli.LabError(f"the {variant} loop failed (status {result.returncode}): {result.stderr[-2000:]}")
    if variant == "watched" and "AUDIT PASSED" not in result.stdout:
        raise cli.LabError(f"the watched loop was not passed by the watcher: {result.stdout[-2000:]}")
    return json.loads(lines[0])


def main():
    args = parse_args()
    seconds = {variant: [] for variant in VARIANTS}
    for repeat in range(args.repeats):
        for variant in list(VARIANTS)[:: 1 if repeat % 2 == 0 else -1]:
            measured = run_loop(variant, args)
            seconds[variant].append(measured["loop_seconds"])
            print(f"repeat {repeat + 1}/{args.repeats}, {variant}: {measured['loop_seconds']:.2f} s", file=sys.stderr)
    medians = {variant: statistics.median(times) for variant, times in seconds.items()}
    micro_batches = args.windows * 4
    overhead = medians["watched"] / medians["plain"] - 1
    print(f"\nThe watcher's cost: {args.windows} windows of 4 micro-batches of {args.batch_size} per rank, 2 ranks")
    print("| loop | median seconds | ms per micro-batch | every start's seconds |")
    print("|---|---:|---:|---|")
    for variant, times in seconds.items():
        per = 1000 * medians[variant] / micro_batches
        print(f"| {variant} | {medians[variant]:.2f} | {per:.1f} | {', '.join(f'{t:.2f}' for t in times)} |")
    print(f"overhead: {100 * overhead:+.1f} %")
    record = {
        "machine": machine("cpu"),
        "windows": args.windows,
        "batch_size": args.batch_size,
        "accum_steps": 4,
        "seconds": seconds,
        "medians": medians,
        "overhead": overhead,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(args.output, files.json_bytes(record))
    print(f"written: {args.output}")


if __name__ == "__main__":
    try:
        main()
    except cli.LabError as error:
        cli.exit_with(error, SCRIPT)
