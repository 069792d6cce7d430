"""What each strategy and mode holds per rank: DDP's replicas against FSDP2's shards, every against no_sync.

    .venv/bin/python benchmarks/bench_memory.py                 # synthetic data, the documented micro-batch of 50

Four short runs of the real train.py (2 ranks, one epoch of two windows of A = 4 micro-batches at the documented
batch), one per strategy and mode; from each run's history (rank 0, read from the tensors themselves): the gradient
and parameter bytes held between micro-batches at their most (ddp_no_sync_lab/audit/memory.py's held_bytes: FSDP's
shards, and its unsharded parameters and gradients while they are allocated), the activations a micro-batch's forward
leaves for its backward, and on CUDA the allocator's peak. DDP's bucket, its own copy of the gradients for the
all-reduce, is no tensor of the model's: its bytes are the gradients' (one bucket under the 25 MB cap), added in the
table as DDP's. Printed, and written to artifacts/bench/memory.json and memory.png.
"""

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ddp_no_sync_lab import cli, experiment, files
from ddp_no_sync_lab.precision import PRECISIONS
from ddp_no_sync_lab.report import pictures
from tools import synthetic_data

REPO = Path(__file__).resolve().parents[1]

SCRIPT = "bench_memory.py"
BATCH, ACCUM = experiment.DOCUMENTED["batch_size"], experiment.DOCUMENTED["accum_steps"]
MICRO_BATCHES = 2 * ACCUM  # per rank: two windows


def parse_args():
    parser = cli.ArgumentParser(prog=SCRIPT, description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=PRECISIONS, default="auto", help="as train.py --precision")
    parser.add_argument("--out", type=Path, default=REPO / "artifacts" / "bench", help="where memory.json/.png go")
    return parser.parse_args()


def run(strategy, mode, data_dir, workspace, precision):
    output = workspace / f"{strategy}-{mode}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", REPO / "train.py"]
    command += ["--strategy", strategy, "--mode", mode, "--output", output, "--data-dir", data_dir, "--epochs", "1"]
    command += ["--batch-size", BATCH, "--accum-steps", ACCUM, "--device", "cpu", "--precision", precision, "--quiet"]
    result = subprocess.run(list(map(str, command)), capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        raise cli.LabError(f"train.py --strategy {strategy} --mode {mode} failed: {result.stderr.strip()[-400:]}")
    row = json.loads((output / files.HISTORY_FILE).read_text())[0]
    held = row["held_bytes"]
    bucket = held["gradients"] if strategy == "ddp" else 0  # DDP's bucket: a copy of the gradients
    return {
        "strategy": strategy,
        "mode": mode,
        "gradients": held["gradients"],
        "parameters": held["parameters"],
        "ddp_bucket": bucket,
        "saved_activations": row["saved_activation_bytes"],
        "peak_allocated": row["peak_allocated_bytes"],
        "reduce_scatters": row["reduce_scatters"],
        "gradient_syncs": row["gradient_syncs"],
    }


def main():
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as workspace:
        workspace = Path(workspace)
        source = MICRO_BATCHES * BATCH * 2 * experiment.VALIDATION_FRACTION // (experiment.VALIDATION_FRACTION - 1)
        synthetic_data.write_dataset(workspace / "data", "image-folders", source, 200)
        rows = [
            run(strategy, mode, workspace / "data", workspace, args.precision)
            for strategy in experiment.STRATEGIES
            for mode in experiment.MODES
        ]
    print("Bytes held per rank between micro-batches (rank 0, MB; a micro-batch of 50, CifarCNN's 558,538 parameters):")
    print("| strategy | mode | gradients | DDP's bucket | parameters | total | saved activations |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        total = row["gradients"] + row["ddp_bucket"] + row["parameters"]
        print(
            f"| {row['strategy']} | {row['mode']} | {row['gradients'] / 1e6:.2f} | {row['ddp_bucket'] / 1e6:.2f} | "
            f"{row['parameters'] / 1e6:.2f} | {total / 1e6:.2f} | {row['saved_activations'] / 1e6:.2f} |"
        )
    by = {(row["strategy"], row["mode"]): row for row in rows}
    image, data = pictures.bar_panels(
        "Bytes held per rank between micro-batches (2 ranks)",
        [
            {
                "title": title,
                "y_label": "MB",
                "x_label": "strategy",
                "groups": experiment.STRATEGIES,
                "bars": {
                    mode: [value(by[strategy, mode]) / 1e6 for strategy in experiment.STRATEGIES]
                    for mode in experiment.MODES
                },
            }
            for title, value in (
                ("gradients (with DDP's bucket)", lambda row: row["gradients"] + row["ddp_bucket"]),
                ("parameters", lambda row: row["parameters"]),
            )
        ],
    )
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "torch": torch.__version__,
        "setup": {"batch_size": BATCH, "accum_steps": ACCUM, "micro_batches_per_rank": MICRO_BATCHES, "ranks": 2},
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    files.write_atomic(args.out / "memory.json", files.json_bytes(result))
    files.write_atomic(args.out / "memory.png", files.png_bytes(image, {"data": json.dumps(data)}))
    print(f"wrote {args.out / 'memory.json'} and {args.out / 'memory.png'}")


if __name__ == "__main__":
    try:
        main()
    except cli.LabError as error:
        cli.exit_with(error, SCRIPT)
