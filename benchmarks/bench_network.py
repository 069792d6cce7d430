"""no_sync's speedup over a slow link between two nodes, measured against the link model's prediction.

    sudo .venv/bin/python benchmarks/bench_network.py                       # ddp: 4 rates x A = 2, 4, 8
    sudo .venv/bin/python benchmarks/bench_network.py --comm-hook bf16      # BF16-compressed gradients
    sudo .venv/bin/python benchmarks/bench_network.py --strategy fsdp       # FSDP2's modes
    sudo .venv/bin/python benchmarks/bench_network.py --data-dir /tmp/cifar10-jpeg --rates unlimited,50

Two machines emulated on one, without touching the machine's own network: the script re-runs itself in a
network namespace of its own (unshare --net) whose loopback, brought up with an Ethernet-sized MTU, is the
whole test network. `tc qdisc ... tbf rate R` on that loopback limits the link to R Mbit/s; it carries both
directions through one queue, so the emulated link is half-duplex (a real full-duplex link of rate R is up
to twice as fast for the same all-reduce). Two torchrun nodes (one process each, one core each,
OMP_NUM_THREADS=1) run the real train.py inside it and talk over 127.0.0.1 only. For each rate and each
--accum-steps A both modes train --steps optimizer steps (local batch 50, train.py's --comm-hook and
--strategy) in one epoch, --repeats times in turn (every, no_sync, no_sync, every, ...).

The model (benchmarks/link_model.py, docs/levers.md): a window costs A(c + s) under `every` and Ac + s under
`no_sync`; only the link is predicted, s = max(L, W / R) per sync (W the audit's bytes per sync through the link,
framed; L measured once on the unlimited runs), and everything else is each run's own clock (its compute, its
broadcasts, the ranks' wait for one another at the syncs). Each cell's measured and predicted speedup, their
error, the repeats' spread and the model's inputs go to the table and to artifacts/bench/network.json
(network-bf16.json, network-fsdp.json for the other variants); network.png plots every variant measured into
the folder, measured against predicted. Everything it made (namespace, qdisc, processes, temporary files) is
gone when it exits, Ctrl-C included.
"""

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.link_model import (
    ERROR_BOUND,
    WIRE_BYTES_PER_PAYLOAD_BYTE,
    analyse,
    cell_verdict,
    limited,
    link_fit,
    print_model_table,
    print_table,
    rate_label,
)
from ddp_no_sync_lab import cli, experiment, files
from ddp_no_sync_lab.precision import PRECISIONS
from ddp_no_sync_lab.report import pictures
from ddp_no_sync_lab.strategies import fsdp
from ddp_no_sync_lab.tasks import data
from model import CLASSES, CifarCNN
from tools import loopback, netns, synthetic_data

REPO = Path(__file__).resolve().parents[1]

SCRIPT = "bench_network.py"
DEFAULT_RATES = "unlimited,1000,200,50"
DEFAULT_ACCUM_STEPS = "2,4,8"
# Each variant's results file, by (--strategy, --comm-hook); the picture reads whichever are in the folder.
RESULT_NAMES = {
    ("ddp", "allreduce"): "network",
    **{("ddp", hook): f"network-{hook}" for hook in experiment.COMM_HOOKS if hook != "allreduce"},
    ("fsdp", "allreduce"): "network-fsdp",
}
RUN_TIMEOUT = 600


def parse_rates(text):
    rates = []
    for part in text.split(","):
        if part == "unlimited":
            rates.append(None)
            continue
        try:
            rate = float(part)
        except ValueError:
            rate = 0
        if not rate > 0 or math.isinf(rate):
            raise argparse.ArgumentTypeError(f"expected 'unlimited' or Mbit/s above 0, got {part!r}")
        rates.append(rate)
    if None not in rates:
        raise argparse.ArgumentTypeError(
            "include 'unlimited': the model's L (a sync's link time without a limit) is measured there"
        )
    return rates


def parse_accum_steps(text):
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = [0]
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers of at least 1, separated by commas, got {text!r}")
    return values


def parse_args():
    parser = cli.ArgumentParser(prog=SCRIPT, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates", type=parse_rates, default=parse_rates(DEFAULT_RATES), help=f"Mbit/s (default {DEFAULT_RATES})"
    )
    parser.add_argument("--steps", type=cli.positive_int, default=3, help="optimizer steps per run (default 3)")
    parser.add_argument(
        "--accum-steps",
        type=parse_accum_steps,
        default=parse_accum_steps(DEFAULT_ACCUM_STEPS),
        help=f"A values (default {DEFAULT_ACCUM_STEPS})",
    )
    parser.add_argument("--comm-hook", choices=experiment.COMM_HOOKS, default="allreduce", help="as train.py's")
    parser.add_argument("--strategy", choices=experiment.STRATEGIES, default="ddp", help="as train.py's")
    parser.add_argument(
        "--repeats", type=cli.positive_int, default=2, help="runs of each mode per cell, averaged (default 2)"
    )
    parser.add_argument("--precision", choices=PRECISIONS, default="auto", help="as train.py --precision")
    parser.add_argument(
        "--data-dir", type=Path, help="an image-folder CIFAR-10 tree to take a subset of (default: synthetic)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "artifacts" / "bench", help="where network.json/.png go")
    parser.add_argument("--inside-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.strategy == "fsdp" and args.comm_hook != "allreduce":
        parser.error("argument --comm-hook: DDP's gradient hook; --strategy fsdp reduce-scatters uncompressed")
    return args


# ----------------------------------------------------------------------------- inside the namespace: the runs


def subset_of(data_dir, destination, source_size, test_size):
    """The first files of each class of an image-folder tree, linked into a new tree."""
    if not data.is_image_folder_tree(data_dir):
        raise cli.LabError(
            f"--data-dir {data_dir} is not an image-folder tree (train/<class>/, test/<class>/); pass one"
        )
    for split, size in (("train", source_size), ("test", test_size)):
        for name in CLASSES:
            files = sorted((data_dir / split / name).iterdir())[: size // len(CLASSES)]
            if len(files) < size // len(CLASSES):
                raise cli.LabError(
                    f"{data_dir / split / name} has {len(files)} images; the benchmark needs {size // len(CLASSES)}"
                )
            (destination / split / name).mkdir(parents=True)
            for file in files:
                (destination / split / name / file.name).symlink_to(file.resolve())


class Nodes:
    """The two torchrun launchers of one run; each in its own session, so that all of it can be killed. Their
    output goes to files (a launcher whose pipe filled while this script waited on the other would stall)."""

    def __init__(self):
        self.launchers = []

    def run(self, train_args, logs):
        """train.py on both nodes; each node's output into logs/node<N>.log. One line naming the node if it fails."""
        cores = sorted(os.sched_getaffinity(0))
        shares = [cores[: max(len(cores) // 2, 1)], cores[len(cores) // 2 :] or cores]
        port = loopback.free_loopback_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
        logs.mkdir(parents=True, exist_ok=True)
        paths = [logs / f"node{node}.log" for node in range(len(shares))]
        for share, path in zip(shares, paths):
            node_command = loopback.loopback_node_command(
                len(self.launchers), 2, port, [REPO / "train.py", *train_args]
            )
            with open(path, "w") as log:
                self.launchers.append(
                    subprocess.Popen(
                        ["taskset", "-c", ",".join(map(str, share)), *node_command],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        try:
            deadline = time.monotonic() + RUN_TIMEOUT
            for node, (launcher, path) in enumerate(zip(self.launchers, paths)):
                launcher.wait(timeout=max(deadline - time.monotonic(), 1))
                if launcher.returncode != 0:
                    lines = [line for line in path.read_text().splitlines() if line.strip()]
                    ours = [line for line in lines if "train.py: error:" in line] or lines[-1:]
                    raise cli.LabError(
                        f"node {node} failed (exit {launcher.returncode}): {ours[0] if ours else ''} ({path})"
                    )
        except subprocess.TimeoutExpired:
            raise cli.LabError(f"the run did not finish within {RUN_TIMEOUT} s; its logs: {paths}") from None
        finally:
            self.stop()

    def stop(self):
        for launcher in self.launchers:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        self.launchers = []


TIMES = (
    "epoch_seconds",
    "comm_seconds",
    "sync_seconds",
    "sync_wait_seconds",
    "all_gather_seconds",
    "all_gather_wait_seconds",
)


def repeated_run(samples):
    """One mode in one cell: its counts, which its repeats must agree on, and each repeat's times."""
    counted = ("gradient_syncs", "optimizer_steps", "allreduce_bytes", *experiment.FSDP_COUNTS)
    counts = {tuple(run[key] for key in counted) for run in samples}
    if len(counts) != 1:
        raise cli.LabError(
            f"repeated runs disagree on their counts {sorted(counts)}: the lab is not deterministic here"
        )
    return {
        **{key: samples[0][key] for key in counted},
        "samples": [{key: run[key] for key in TIMES} for run in samples],
    }


def measure(args, workspace, nodes):
    documented = experiment.DOCUMENTED
    batch, world, test_size = documented["batch_size"], documented["world_size"], 500
    data_folders = {}
    for accum in args.accum_steps:  # --steps optimizer steps of A micro-batches per rank: one epoch
        source_size = (
            args.steps * accum * batch * world * experiment.VALIDATION_FRACTION // (experiment.VALIDATION_FRACTION - 1)
        )
        data_folders[accum] = workspace / f"data-accum-{accum}"
        if args.data_dir is None:
            synthetic_data.write_dataset(data_folders[accum], "image-folders", source_size, test_size)
        else:
            subset_of(args.data_dir, data_folders[accum], source_size, test_size)
    rows = []
    for rate in args.rates:
        netns.set_link(rate)
        for accum in args.accum_steps:
            samples = {mode: [] for mode in experiment.MODES}
            # every, no_sync, no_sync, every, ...: a drift of the machine's speed during the pairs cancels out.
            order = [
                mode
                for repeat in range(args.repeats)
                for mode in (experiment.MODES if repeat % 2 == 0 else experiment.MODES[::-1])
            ]
            for index, mode in enumerate(order):
                output = workspace / "runs" / f"{rate or 0:g}-{accum}" / f"{mode}-{index}"
                started = time.monotonic()
                options = ["--mode", mode, "--output", output, "--data-dir", data_folders[accum], "--epochs", 1]
                options += ["--batch-size", batch, "--accum-steps", accum, "--comm-hook", args.comm_hook]
                options += ["--device", "cpu", "--strategy", args.strategy, "--precision", args.precision, "--quiet"]
                nodes.run(options, logs=output.with_name(f"{output.name}-logs"))
                samples[mode].append(json.loads((output / files.HISTORY_FILE).read_text())[0])
                chosen = json.loads((output / files.RUN_RECORD_FILE).read_text())["config"]["precision"]
                print(
                    f"{rate_label(rate)}, A = {accum}, {mode}: {time.monotonic() - started:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            runs = {mode: repeated_run(runs) for mode, runs in samples.items()}
            rows.append({"rate_mbit": rate, "accum_steps": accum, "runs": runs})
    setup = {"train_images_per_optimizer_step": batch * world, "test_images": test_size, "batch_size": batch}
    setup.update(accum_steps=args.accum_steps, comm_hook=args.comm_hook, strategy=args.strategy, precision=chosen)
    return rows, setup


# ----------------------------------------------------------------------------- the results


def variant_label(result):
    setup = result["setup"]
    return setup["strategy"] + ("" if setup["comm_hook"] == "allreduce" else f" {setup['comm_hook']}")


def draw(results):
    """Every cell of the results in one folder (ddp, its BF16 compression, fsdp: each a run of this script),
    its measured speedup against the predicted."""
    points = [
        {
            "label": f"{'inf' if row['rate_mbit'] is None else format(row['rate_mbit'], 'g')}/A{row['accum_steps']}",
            "series": variant_label(result),
            "predicted": row["predicted_speedup"],
            "measured": row["measured_speedup"],
        }
        for result in results
        for row in result["rows"]
    ]
    caption = "each point a cell: rate in Mbit/s (inf: no limit) / A; the link predicted, the rest each run's own clock"
    return pictures.agreement_image(
        "no_sync's speedup over a slow link: measured against predicted (2 nodes, emulated)",
        points,
        ERROR_BOUND,
        caption,
    )


def machine():
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def inside(args):
    netns.bring_up_loopback()
    nodes = Nodes()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below on a plain kill too
    try:
        with tempfile.TemporaryDirectory(prefix="bench-network-") as workspace:
            rows, setup = measure(args, Path(workspace), nodes)
    finally:
        nodes.stop()
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    # FSDP's all-gathers per micro-batch, from its units (ddp_no_sync_lab/strategies/fsdp.py); DDP gathers nothing.
    world = experiment.DOCUMENTED["world_size"]
    sharded = args.strategy == "fsdp"
    gathered = fsdp.gathered_bytes(fsdp.unit_numels(CifarCNN(), world), world) if sharded else 0
    terms, table = analyse(rows, gathered)
    fit = link_fit(table)
    print(
        f"precision: {setup['precision']} (train.py --precision {args.precision}), --comm-hook {args.comm_hook}, "
        f"--strategy {args.strategy}"
    )
    print_table(terms, table)
    print(
        f"fitted on the limited rates: {fit[1] / 1e6:.1f} Mbit per sync"
        if fit[1]
        else "no limited rate: nothing to fit"
    )
    print()
    print_model_table(table, args.accum_steps)
    result = {
        "machine": machine(),
        "torch": torch.__version__,
        "link": f"tbf on a network namespace's loopback (MTU {netns.LINK_MTU}), both directions through one queue",
        "setup": {
            **setup,
            "steps": args.steps,
            "repeats": args.repeats,
            "data": str(args.data_dir) if args.data_dir else "synthetic",
            "nodes": 2,
            "processes_per_node": 1,
            "threads_per_process": 1,
        },
        "latency_seconds_per_sync": terms[0],
        "gather_latency_seconds_per_micro_batch": terms[1],
        "wire_bytes_per_payload_byte": WIRE_BYTES_PER_PAYLOAD_BYTE,
        "error_bound": ERROR_BOUND,
        "limited_cells": {
            verdict: sum(cell_verdict(row) == verdict for row in limited(table))
            for verdict in ("within", "spread", "off")
        },
        "fit": {"seconds_per_sync_unlimited": fit[0], "bits_per_sync": fit[1]},
        "rows": table,
        "runs": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = RESULT_NAMES[args.strategy, args.comm_hook]
    files.write_atomic(args.out / f"{name}.json", files.json_bytes(result))
    # The picture holds every variant measured into this folder so far (each a run of this script).
    results = [
        json.loads((args.out / f"{other}.json").read_text())
        for other in RESULT_NAMES.values()
        if (args.out / f"{other}.json").is_file()
    ]
    results = [result for result in results if "limited_cells" in result]  # not those of an earlier model
    image, data = draw(results)
    files.write_atomic(args.out / "network.png", files.png_bytes(image, {"data": json.dumps(data)}))
    print(f"wrote {args.out / f'{name}.json'} and {args.out / 'network.png'}")


def main():
    args = parse_args()
    try:
        if args.inside_namespace:
            inside(args)
            return 0
        netns.check_prerequisites()
        return netns.run_in_namespace(Path(__file__).resolve(), [*sys.argv[1:], "--inside-namespace"])
    except cli.LabError as error:
        cli.exit_with(error, SCRIPT)
    except KeyboardInterrupt:
        print(f"{SCRIPT}: interrupted; cleaned up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
