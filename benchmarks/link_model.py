"""The link model of benchmarks/bench_network.py: what a window costs in each mode over a link of rate R, two
ways (from first principles, and from the sync time measured at that rate), and the tables that compare them
with the measurement. No runs here: bench_network.py measures, this module predicts.

A window costs A(c + s) under `every` and Ac + s under `no_sync`: A = accum_steps, c = compute per micro-batch,
s = seconds per sync. From first principles, s = L + W / R, with c and the latency term L measured once on the
runs without a link limit and W the bits one sync puts through the link: the audit's bytes per sync, sent by
both ranks (a two-rank all-reduce sends each rank's buffer once, half in its reduce-scatter and half in its
all-gather), framed as TCP/IP over Ethernet. Under FSDP (train.py --strategy fsdp) a sync is one reduce-scatter
per unit, which gloo runs as an all-reduce of the whole padded gradient (the profiler's gloo:all_reduce events):
W = both ranks' handed bytes, as DDP's; and every micro-batch also all-gathers the units, in both modes:
g = G / R more per micro-batch, G both ranks' shards (A(c + g + s) against A(c + g) + s; the gathers' unlimited
cost is inside c).

Run as a command, it is a calculator for a user's own cluster (the benchmark checks the same functions on two
nodes over an emulated link):

    python benchmarks/link_model.py --gradient-mb 2.234 --compute-ms 200 --rate-mbit 50 --sync-latency-ms 20 \
        --world-size 2 --accum-steps 4 --shared-link
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.cli import ArgumentParser, non_negative_float, positive_float, positive_int  # noqa: E402
from tools import netns  # noqa: E402

SYNC_TO_COMPUTE_RATIOS = (0.01, 0.1, 0.25, 0.5, 0.8, 1, 2, 5, 10)  # the model's "when does it pay" table
# On the emulated link each 1,448-byte TCP payload (the MTU less 20 bytes of IP, 20 of TCP and 12 of its
# timestamp option) travels in a 1,514-byte frame (the loopback's 14-byte Ethernet header), and every second
# segment is answered by a 66-byte ACK through the same queue.
TCP_PAYLOAD = netns.LINK_MTU - 52
WIRE_BYTES_PER_PAYLOAD_BYTE = (netns.LINK_MTU + 14 + 66 / 2) / TCP_PAYLOAD


def rate_label(rate):
    return "unlimited" if rate is None else f"{rate:g} Mbit/s"


def unlimited_terms(rows):
    """c and L, measured once: on the unlimited runs (every A, both modes), the seconds per micro-batch outside
    collectives and the seconds per sync."""
    runs = [run for row in rows if row["rate_mbit"] is None for run in row["runs"].values()]
    micro_batches = sum(
        run["optimizer_steps"] * row["accum_steps"]
        for row in rows
        if row["rate_mbit"] is None
        for run in row["runs"].values()
    )
    compute = sum(run["epoch_seconds"] - run["comm_seconds"] for run in runs) / micro_batches
    latency = sum(run["comm_seconds"] for run in runs) / sum(run["gradient_syncs"] for run in runs)
    return compute, latency


def ring_wire_bits(gradient_bytes, world_size, shared_link):
    """The bits one ring all-reduce of `gradient_bytes` per rank puts through the busiest link, framed: each rank
    sends 2(N-1)/N of the bytes (half in the reduce-scatter, half in the all-gather). On a link the ranks share in
    both directions (the emulated link between two nodes: half-duplex) every rank's sending crosses it, N times that;
    on full-duplex links to a switch each rank's own link carries its own sending."""
    per_rank = 2 * (world_size - 1) / world_size * gradient_bytes
    return (world_size if shared_link else 1) * per_rank * 8 * WIRE_BYTES_PER_PAYLOAD_BYTE


def wire_bits_per_sync(runs):
    """W: what one sync puts through the benchmark's half-duplex link between two nodes, from the audit's bytes:
    both ranks' all-reduced buffers (FSDP's reduce-scatter runs as an all-reduce on gloo), framed."""
    (bytes_per_sync,) = {
        (run["allreduce_bytes"] + run.get("reduce_scatter_bytes", 0)) // run["gradient_syncs"] for run in runs.values()
    }
    return ring_wire_bits(bytes_per_sync, 2, shared_link=True)


def step_seconds(mode, compute, sync_seconds, accum, gather_seconds=0.0):
    """A window: A(c + g + s) under every, A(c + g) + s under no_sync (g: FSDP's all-gathers per micro-batch)."""
    per_micro_batch = compute + gather_seconds
    return accum * (per_micro_batch + sync_seconds) if mode == "every" else accum * per_micro_batch + sync_seconds


def analyse(rows, gathered_bytes=0):
    """The table, from the runs; gathered_bytes: what one rank hands to a micro-batch's all-gathers (FSDP)."""
    compute, latency = unlimited_terms(rows)
    gather_bits = 2 * gathered_bytes * 8 * WIRE_BYTES_PER_PAYLOAD_BYTE  # both ranks' shards
    table = []
    for row in rows:
        accum, runs = row["accum_steps"], row["runs"]
        sync_seconds = sum(run["comm_seconds"] for run in runs.values()) / sum(
            run["gradient_syncs"] for run in runs.values()
        )
        wire_bits = wire_bits_per_sync(runs)
        rate = None if row["rate_mbit"] is None else row["rate_mbit"] * 1e6
        link_seconds = latency + (0 if rate is None else wire_bits / rate)
        gather_seconds = 0 if rate is None else gather_bits / rate
        step = {mode: run["epoch_seconds"] / run["optimizer_steps"] for mode, run in runs.items()}
        first = {mode: step_seconds(mode, compute, link_seconds, accum, gather_seconds) for mode in runs}
        measured = step["every"] / step["no_sync"]
        predicted = predicted_speedup(compute + gather_seconds, sync_seconds, accum)
        table.append(
            {
                "rate_mbit": row["rate_mbit"],
                "accum_steps": accum,
                "every_step_seconds": step["every"],
                "no_sync_step_seconds": step["no_sync"],
                "seconds_per_sync": sync_seconds,
                "gradient_syncs": {mode: run["gradient_syncs"] for mode, run in runs.items()},
                "optimizer_steps": {mode: run["optimizer_steps"] for mode, run in runs.items()},
                "wire_bits_per_sync": wire_bits,
                "gather_bits_per_micro_batch": gather_bits,
                "first_principles": {
                    "seconds_per_sync": link_seconds,
                    "every_step_seconds": first["every"],
                    "no_sync_step_seconds": first["no_sync"],
                    "speedup": first["every"] / first["no_sync"],
                    "step_errors": {mode: first[mode] / step[mode] - 1 for mode in runs},
                },
                "measured_speedup": measured,
                "predicted_speedup": predicted,
                "relative_error": predicted / measured - 1,
            }
        )
    return (compute, latency), table


def predicted_speedup(compute, sync_seconds, accum):
    return step_seconds("every", compute, sync_seconds, accum) / step_seconds("no_sync", compute, sync_seconds, accum)


def link_fit(table):
    """s(R) = s_unlimited + V / R: V, the bits a synchronized micro-batch puts through the link, by least squares
    (the check on W: the fitted V next to the first-principles bits)."""
    unlimited = [row["seconds_per_sync"] for row in table if row["rate_mbit"] is None]
    s_unlimited = sum(unlimited) / len(unlimited)
    limited = [row for row in table if row["rate_mbit"] is not None]
    if not limited:
        return s_unlimited, None
    inverse = [1 / (row["rate_mbit"] * 1e6) for row in limited]
    extra = [row["seconds_per_sync"] - s_unlimited for row in limited]
    return s_unlimited, sum(e * i for e, i in zip(extra, inverse)) / sum(i * i for i in inverse)


def print_table(terms, table):
    compute, latency = terms
    print(
        f"measured once, unlimited: c = {compute * 1e3:.1f} ms compute per micro-batch, L = {latency * 1e3:.1f} ms "
        f"per sync; W = both ranks' bytes x 8 x {WIRE_BYTES_PER_PAYLOAD_BYTE:.4f} (framing)"
    )
    print(
        "| link | A | every s/step | first principles | no_sync s/step | first principles | syncs every/no_sync | "
        "measured speedup | first principles | from measured s: A(c+s)/(Ac+s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in table:
        syncs, first = row["gradient_syncs"], row["first_principles"]
        errors = first["step_errors"]
        print(
            f"| {rate_label(row['rate_mbit'])} | {row['accum_steps']} | {row['every_step_seconds']:.3f} | "
            f"{first['every_step_seconds']:.3f} ({errors['every'] * 100:+.1f}%) | {row['no_sync_step_seconds']:.3f} | "
            f"{first['no_sync_step_seconds']:.3f} ({errors['no_sync'] * 100:+.1f}%) | {syncs['every']}/{syncs['no_sync']} | "
            f"{row['measured_speedup']:.2f}x | {first['speedup']:.2f}x ({first['speedup'] / row['measured_speedup'] * 100 - 100:+.1f}%) | "
            f"{row['predicted_speedup']:.2f}x ({row['relative_error'] * 100:+.1f}%) |"
        )


def print_model_table(table, compute, accums):
    """The model alone, by s/c and A: when no_sync pays, beside where the measured rates fall."""
    measured = {(rate_label(row["rate_mbit"]), round(row["seconds_per_sync"] / compute, 2)) for row in table}
    print(
        "predicted speedup A(1+r)/(A+r) by r = s/c; measured rates: "
        + ", ".join(f"{label} r = {ratio:.2f}" for label, ratio in sorted(measured, key=lambda item: item[1]))
    )
    print("| A \\ s/c | " + " | ".join(f"{ratio:g}" for ratio in SYNC_TO_COMPUTE_RATIOS) + " |")
    print("|---|" + "---:|" * len(SYNC_TO_COMPUTE_RATIOS))
    for accum in accums:
        speedups = [f"{predicted_speedup(1, ratio, accum):.2f}x" for ratio in SYNC_TO_COMPUTE_RATIOS]
        print(f"| {accum} | " + " | ".join(speedups) + " |")


def calculate(gradient_bytes, compute, rate_mbit, latency, world_size, accum, shared_link):
    """Each mode's predicted seconds per optimizer step and no_sync's speedup, from the benchmark's own terms."""
    sync_seconds = latency + ring_wire_bits(gradient_bytes, world_size, shared_link) / (rate_mbit * 1e6)
    steps = {mode: step_seconds(mode, compute, sync_seconds, accum) for mode in ("every", "no_sync")}
    return sync_seconds, steps, steps["every"] / steps["no_sync"]


def main():
    parser = ArgumentParser(prog="link_model.py", description="What no_sync saves per optimizer step on a link.")
    parser.add_argument("--gradient-mb", type=positive_float, required=True, help="gradient MB all-reduced per sync")
    parser.add_argument("--compute-ms", type=positive_float, required=True, help="forward + backward per micro-batch")
    parser.add_argument("--rate-mbit", type=positive_float, required=True, help="the link's rate, Mbit/s")
    parser.add_argument(
        "--sync-latency-ms",
        type=non_negative_float,
        default=0.0,
        help="one sync's time at this world size without a rate limit (measured: its latency hops and waits)",
    )
    parser.add_argument("--world-size", type=positive_int, default=2)
    parser.add_argument("--accum-steps", type=positive_int, default=4)
    parser.add_argument("--shared-link", action="store_true", help="all ranks' traffic through one half-duplex link")
    args = parser.parse_args()
    gradient_bytes = args.gradient_mb * 1e6
    sync, steps, speedup = calculate(
        gradient_bytes, args.compute_ms / 1e3, args.rate_mbit, args.sync_latency_ms / 1e3, args.world_size,
        args.accum_steps, args.shared_link,
    )  # fmt: skip
    print(
        f"assumed: ring all-reduce, each rank sending 2(N-1)/N of {args.gradient_mb:g} MB per sync; "
        f"{'one half-duplex link shared by all ranks' if args.shared_link else 'full-duplex links, one per rank'}; "
        f"TCP/IP framing x {WIRE_BYTES_PER_PAYLOAD_BYTE:.4f}; compute and syncs not overlapped; "
        f"a window costs A(c + s) under every and Ac + s under no_sync"
    )
    print(f"s = {sync * 1e3:.1f} ms per sync, r = s/c = {sync / (args.compute_ms / 1e3):.2f}")
    print("| mode | s per optimizer step |\n|---|---:|")
    for mode, seconds in steps.items():
        print(f"| {mode} | {seconds:.3f} |")
    print(f"no_sync: {speedup:.2f}x faster per optimizer step (at most A = {args.accum_steps}x)")


if __name__ == "__main__":
    main()
