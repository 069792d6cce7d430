"""The bias of micro-batch normalization on packed rows: each window's gradient under it against the per-token one.

    .venv/bin/python benchmarks/bench_packed.py                                        # initial weights
    .venv/bin/python benchmarks/bench_packed.py --checkpoint artifacts/text/no_sync/model.pt   # trained ones

For the text task's documented configuration (ddp_no_sync_lab/experiment.py's TEXT_DOCUMENTED: 2 ranks, accum_steps 4, the
seed's split and packing; other rows per micro-batch with --batch-sizes), every window of epoch 1 as the two
ranks' samplers deal it: each micro-batch's mean-token-loss gradient, in float32 at one fixed set of weights, then
the window's gradient two ways from the same micro-batch gradients: per token (each weighted by its tokens over
the window's tokens over both ranks: train.py --loss-normalization tokens, which DDP's average makes the mean
over every token) and per micro-batch (each weighted 1 / (ranks x window length): --loss-normalization
micro-batch). Printed per micro-batch size: the tokens per micro-batch and window, and the relative error
|g_micro-batch - g_tokens| / |g_tokens| over the windows (min, median, max). Written with every window's
numbers to artifacts/bench/packed.json, and drawn (tokens per micro-batch and window, the error per window) to
artifacts/bench/packed.png.
"""

import json
import statistics
from pathlib import Path

import torch

from benchmarks.bench_speed import machine
from ddp_no_sync_lab import cli, experiment, files
from ddp_no_sync_lab.report import pictures
from ddp_no_sync_lab.tasks import packed
from ddp_no_sync_lab.tasks.language import ByteTransformer, TokenCrossEntropy

REPO = Path(__file__).resolve().parents[1]

SCRIPT = "bench_packed.py"
DOCUMENTED = experiment.TEXT_DOCUMENTED
COLOURS = [(31, 119, 180), (227, 111, 30), (44, 160, 44), (148, 103, 189), (140, 86, 75)]


def parse_args():
    parser = cli.ArgumentParser(prog=SCRIPT, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch-sizes",
        type=cli.positive_int,
        nargs="+",
        default=[DOCUMENTED["batch_size"], 2],
        metavar="ROWS",
        help="rows per micro-batch and rank (the documented 8, and 2)",
    )
    parser.add_argument("--checkpoint", type=Path, help="a text run's model.pt (default: the seed's initial weights)")
    parser.add_argument("--out", type=Path, default=REPO / "artifacts" / "bench", help="where packed.json/.png go")
    return parser.parse_args()


def window_bias(model, rows, batch_size):
    """Per window of epoch 1: its micro-batches' tokens (rank by rank), its tokens, and the relative error."""
    world_size, accum_steps, seed = DOCUMENTED["world_size"], DOCUMENTED["accum_steps"], DOCUMENTED["seed"]
    criterion, parameters = TokenCrossEntropy(), list(model.parameters())
    orders = []
    for rank in range(world_size):
        sampler = packed.train_sampler(len(rows.inputs), seed, rank, world_size)
        sampler.set_epoch(0)
        orders.append(torch.tensor(list(sampler)).split(batch_size))
    windows = []
    for start in range(0, len(orders[0]), accum_steps):
        batches = [order[i] for order in orders for i in range(start, min(start + accum_steps, len(order)))]
        tokens = [int(rows.tokens[batch].sum()) for batch in batches]
        total, length = sum(tokens), len(batches) // world_size
        per_token = per_micro_batch = None
        for batch, count in zip(batches, tokens):
            loss = criterion(model(rows.inputs[batch]), rows.targets[batch])
            gradient = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, parameters)]).double()
            per_token = gradient * (count / total) + (0 if per_token is None else per_token)
            per_micro_batch = gradient / (world_size * length) + (0 if per_micro_batch is None else per_micro_batch)
        error = ((per_micro_batch - per_token).norm() / per_token.norm()).item()
        windows.append({"micro_batch_tokens": tokens, "tokens": total, "relative_error": error})
    return windows


def main():
    args = parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(DOCUMENTED["seed"])
    model = ByteTransformer()
    weights = "initial (seed 47)"
    if args.checkpoint:
        try:
            model.load_state_dict(torch.load(args.checkpoint, map_location="cpu", weights_only=True)["model"])
        except Exception as error:
            cli.exit_with(cli.LabError(f"--checkpoint {args.checkpoint}: not a text run's model.pt ({error})"), SCRIPT)
        weights = str(args.checkpoint)
    try:
        source = packed.load_corpus()
    except cli.LabError as error:
        cli.exit_with(error, SCRIPT)
    rows = packed.make_split(source, DOCUMENTED["seed"], 0, DOCUMENTED["world_size"]).parts["train"]
    results = {size: window_bias(model, rows, size) for size in args.batch_sizes}
    print(f"Epoch 1 of the text task's documented run (2 ranks, accum_steps 4), weights: {weights}; float32, 1 thread")
    print(
        "| rows per micro-batch | windows | tokens per micro-batch | tokens per window | relative error of "
        "micro-batch normalization: min | median | max |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size, windows in results.items():
        micro = [count for window in windows for count in window["micro_batch_tokens"]]
        totals = [window["tokens"] for window in windows]
        errors = [window["relative_error"] for window in windows]
        print(
            f"| {size} | {len(windows)} | {min(micro)}-{max(micro)} | {min(totals)}-{max(totals)} | "
            f"{min(errors):.2e} | {statistics.median(errors):.2e} | {max(errors):.2e} |"
        )
    report = {
        "machine": machine("cpu"),
        "corpus": source.summary(),
        "weights": weights,
        "configuration": DOCUMENTED,
        "windows": {str(size): windows for size, windows in results.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    files.write_atomic(args.out / "packed.json", files.json_bytes(report))
    size = args.batch_sizes[0]
    windows = results[size]
    panels = [
        {
            "title": f"tokens per micro-batch ({size} rows), rank by rank",
            "x_label": "micro-batch of epoch 1",
            "y_label": "target tokens",
            "series": [
                {
                    "label": f"rank {rank}",
                    "colour": COLOURS[rank],
                    "values": [
                        w["micro_batch_tokens"][rank * (len(w["micro_batch_tokens"]) // 2) + i]
                        for w in windows
                        for i in range(len(w["micro_batch_tokens"]) // 2)
                    ],
                }
                for rank in range(DOCUMENTED["world_size"])
            ],
        },
        {
            "title": "tokens per window, both ranks",
            "x_label": "window (optimizer step)",
            "y_label": "target tokens",
            "series": [{"label": "window", "colour": COLOURS[2], "values": [w["tokens"] for w in windows]}],
        },
        {
            "title": "micro-batch normalization vs tokens",
            "x_label": "window (optimizer step)",
            "y_label": "relative gradient error",
            "series": [
                {
                    "label": f"{rows_} rows",
                    "colour": COLOURS[3 + index % 2],
                    "values": [w["relative_error"] for w in ws],
                }
                for index, (rows_, ws) in enumerate(results.items())
            ],
        },
    ]
    image, data = pictures.index_panels("Packed rows: unequal tokens, and the bias of dividing by the window", panels)
    files.write_atomic(args.out / "packed.png", files.png_bytes(image, {"data": json.dumps(data)}))
    print(f"wrote {args.out / 'packed.json'} and {args.out / 'packed.png'}")


if __name__ == "__main__":
    main()
