"""The link model of benchmarks/bench_network.py: what a window costs in each mode over a link of rate R, and
the tables that compare it with the measurement. No runs here: bench_network.py measures, this module predicts.

A window costs A(c + s) under `every` and Ac + s under `no_sync`: A = accum_steps, c = compute per micro-batch,
s = seconds per sync. Only the link is predicted; the rest is each run's own clock, so that the compute's drift
between runs is not counted as the model's error:
- c, the buffer broadcasts and the ranks' wait for one another at the syncs (the skew a sync absorbs: the
  audit's sync_wait_seconds) are measured in the run itself;
- s = max(L, W / R): L, the link's time per sync without a limit (the syncs' time less the ranks' wait),
  measured once on the unlimited runs; W the bits one sync puts through the link: the audit's bytes per sync,
  sent by both ranks (a two-rank all-reduce sends each rank's buffer once, half in its reduce-scatter and half
  in its all-gather), framed as TCP/IP over Ethernet. The longer of the two, not their sum (link_seconds_at).
Under FSDP (train.py --strategy fsdp) a sync is one reduce-scatter per unit, which gloo runs as an all-reduce
of the whole padded gradient (the profiler's gloo:all_reduce events): W = both ranks' handed bytes, as DDP's;
and every micro-batch also all-gathers the units, in both modes: max(L_g, G / R) more per micro-batch, G both
ranks' shards and L_g their time without a limit.

Run as a command, it is a calculator for a user's own cluster (the benchmark checks the same functions on two
nodes over an emulated link):

    python benchmarks/link_model.py --gradient-mb 2.234 --compute-ms 200 --rate-mbit 50 --sync-latency-ms 20 \
        --world-size 2 --accum-steps 4 --shared-link
"""

from ddp_no_sync_lab.cli import ArgumentParser, non_negative_float, positive_float, positive_int
from tools import netns

ERROR_BOUND = 0.10  # the model's aim: each cell's predicted speedup within 10 % of the measured
SYNC_TO_COMPUTE_RATIOS = (0.01, 0.1, 0.25, 0.5, 0.8, 1, 2, 5, 10)  # the model's "when does it pay" table
# On the emulated link each 1,448-byte TCP payload (the MTU less 20 bytes of IP, 20 of TCP and 12 of its
# timestamp option) travels in a 1,514-byte frame (the loopback's 14-byte Ethernet header), and every second
# segment is answered by a 66-byte ACK through the same queue.
TCP_PAYLOAD = netns.LINK_MTU - 52
WIRE_BYTES_PER_PAYLOAD_BYTE = (netns.LINK_MTU + 14 + 66 / 2) / TCP_PAYLOAD


def rate_label(rate):
    return "unlimited" if rate is None else f"{rate:g} Mbit/s"


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


def link_seconds(sample):
    """A run's time in the syncs less the ranks' wait for one another there: the link's part."""
    return sample["sync_seconds"] - sample["sync_wait_seconds"]


def gather_link_seconds(sample):
    """The same of FSDP's all-gathers (0 under DDP)."""
    return sample["all_gather_seconds"] - sample["all_gather_wait_seconds"]


def unlimited_terms(rows):
    """L and L_g, measured once on the unlimited runs (every A, both modes): the link's seconds per sync and,
    under FSDP, per micro-batch of all-gathers."""
    samples = [
        (row["accum_steps"], run, sample)
        for row in rows
        if row["rate_mbit"] is None
        for run in row["runs"].values()
        for sample in run["samples"]
    ]
    latency = sum(link_seconds(sample) for _, _, sample in samples) / sum(
        run["gradient_syncs"] for _, run, _ in samples
    )
    gathers = sum(gather_link_seconds(sample) for _, _, sample in samples)
    return latency, gathers / sum(run["optimizer_steps"] * accum for accum, run, _ in samples)


def link_seconds_at(latency, bits, rate):
    """A sync's (or a micro-batch's all-gathers') time on a link of `rate` bits/s (None: no limit): the longer
    of its time without a limit and its bits at the rate: the bounds are full overlap of its work off the wire
    (copies, the reduction, the TCP stack: gloo's ring reduces one piece while the next is on the wire, the
    kernel sends from the socket buffers) with the bits queued behind the limit, and none (their sum). Chosen
    after the sum over-predicted FSDP's syncs by about L on the EPYC (2026-12-03: at 1000 Mbit/s 33 to 45 ms per
    sync, W / R = 38 ms, L = 16 ms); docs/levers.md has the run that tested it afterwards."""
    return latency if rate is None else max(latency, bits / rate)


def predicted_epoch_seconds(sample, run, accum, terms, bits, rate):
    """One run's training seconds: its own clock for all but the link (its compute, buffer broadcasts and the
    ranks' waits, measured), and the link predicted: each sync max(L, W / R), under FSDP each micro-batch's
    all-gathers max(L_g, G / R)."""
    (latency, gather_latency), (wire_bits, gather_bits) = terms, bits
    own = sample["epoch_seconds"] - link_seconds(sample) - gather_link_seconds(sample)
    micro_batches = run["optimizer_steps"] * accum
    syncs = run["gradient_syncs"] * link_seconds_at(latency, wire_bits, rate)
    return own + syncs + micro_batches * link_seconds_at(gather_latency, gather_bits, rate)


def mean(values):
    return sum(values) / len(values)


def spread(values):
    """(max - min) / mean: how far a cell's repeats lie apart."""
    return (max(values) - min(values)) / mean(values)


def run_inputs(run, accum):
    """What the model took from a run's own clock (c: a micro-batch's time outside the syncs and all-gathers),
    and the link's time per sync it measured (means over the repeats)."""
    micro_batches, syncs = run["optimizer_steps"] * accum, run["gradient_syncs"]
    outside = [
        sample["epoch_seconds"] - sample["sync_seconds"] - sample["all_gather_seconds"] for sample in run["samples"]
    ]
    return {
        "compute_ms": mean(outside) / micro_batches * 1e3,
        "wait_ms_per_sync": mean([sample["sync_wait_seconds"] for sample in run["samples"]]) / syncs * 1e3,
        "link_ms_per_sync": mean([link_seconds(sample) for sample in run["samples"]]) / syncs * 1e3,
    }


def analyse(rows, gathered_bytes=0):
    """The table, from the runs; gathered_bytes: what one rank hands to a micro-batch's all-gathers (FSDP)."""
    terms = unlimited_terms(rows)
    gather_bits = 2 * gathered_bytes * 8 * WIRE_BYTES_PER_PAYLOAD_BYTE  # both ranks' shards
    table = []
    for row in rows:
        accum, runs = row["accum_steps"], row["runs"]
        rate = None if row["rate_mbit"] is None else row["rate_mbit"] * 1e6
        wire_bits = wire_bits_per_sync(runs)
        measured, predicted = {}, {}
        for mode, run in runs.items():
            steps = run["optimizer_steps"]
            measured[mode] = [sample["epoch_seconds"] / steps for sample in run["samples"]]
            predicted[mode] = [
                predicted_epoch_seconds(sample, run, accum, terms, (wire_bits, gather_bits), rate) / steps
                for sample in run["samples"]
            ]
        speedup = mean(measured["every"]) / mean(measured["no_sync"])
        predicted_speedup_ = mean(predicted["every"]) / mean(predicted["no_sync"])
        repeat_speedups = [every / no_sync for every, no_sync in zip(measured["every"], measured["no_sync"])]
        table.append(
            {
                "rate_mbit": row["rate_mbit"],
                "accum_steps": accum,
                "gradient_syncs": {mode: run["gradient_syncs"] for mode, run in runs.items()},
                "optimizer_steps": {mode: run["optimizer_steps"] for mode, run in runs.items()},
                "wire_bits_per_sync": wire_bits,
                "gather_bits_per_micro_batch": gather_bits,
                "predicted_ms_per_sync": link_seconds_at(terms[0], wire_bits, rate) * 1e3,
                "inputs": {mode: run_inputs(run, accum) for mode, run in runs.items()},
                "step_seconds": {
                    mode: {
                        "measured": mean(measured[mode]),
                        "spread": spread(measured[mode]),
                        "predicted": mean(predicted[mode]),
                        "error": mean(predicted[mode]) / mean(measured[mode]) - 1,
                    }
                    for mode in runs
                },
                "measured_speedup": speedup,
                "repeat_speedups": repeat_speedups,
                "speedup_spread": spread(repeat_speedups),
                "predicted_speedup": predicted_speedup_,
                "relative_error": predicted_speedup_ / speedup - 1,
            }
        )
    return terms, table


def predicted_speedup(compute, sync_seconds, accum):
    return step_seconds("every", compute, sync_seconds, accum) / step_seconds("no_sync", compute, sync_seconds, accum)


def link_fit(table):
    """s(R) = s_unlimited + V / R: V, the bits a sync puts through the link, by least squares over the cells'
    link time per sync (the check on W: the fitted V next to the first-principles bits)."""
    per_sync = [
        (row["rate_mbit"], mean([row["inputs"][mode]["link_ms_per_sync"] for mode in row["inputs"]]) / 1e3)
        for row in table
    ]
    s_unlimited = mean([seconds for rate, seconds in per_sync if rate is None])
    limited = [(rate, seconds) for rate, seconds in per_sync if rate is not None]
    if not limited:
        return s_unlimited, None
    inverse = [1 / (rate * 1e6) for rate, _ in limited]
    extra = [seconds - s_unlimited for _, seconds in limited]
    return s_unlimited, sum(e * i for e, i in zip(extra, inverse)) / sum(i * i for i in inverse)


def cell_verdict(row):
    """within: the predicted speedup within the bound of the measured; spread: outside it, but inside the spread
    of the cell's repeats (its noise is wider than the bound); off: outside both."""
    error = abs(row["relative_error"])
    if error <= ERROR_BOUND:
        return "within"
    return "spread" if error <= row["speedup_spread"] else "off"


def limited(table):
    """The cells with a link limit: the model's test (without one, L is fitted on the cells themselves)."""
    return [row for row in table if row["rate_mbit"] is not None]


def print_table(terms, table):
    latency, gather_latency = terms
    print(
        f"measured once, unlimited: L = {latency * 1e3:.1f} ms link time per sync"
        + (f", L_g = {gather_latency * 1e3:.1f} ms of all-gathers per micro-batch" if gather_latency else "")
        + f"; W = both ranks' bytes x 8 x {WIRE_BYTES_PER_PAYLOAD_BYTE:.4f} (framing); each run's own c and wait"
    )
    print(
        "| link | A | every s/step (spread) | predicted | no_sync s/step (spread) | predicted | syncs every/no_sync | "
        "speedup (spread) | predicted | link ms per sync (predicted) | c ms every/no_sync | wait ms per sync every/no_sync |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in table:
        steps, inputs, syncs = row["step_seconds"], row["inputs"], row["gradient_syncs"]
        cells = [
            f"{steps[mode]['measured']:.3f} ({steps[mode]['spread'] * 100:.0f}%) | {steps[mode]['predicted']:.3f} "
            f"({steps[mode]['error'] * 100:+.1f}%)"
            for mode in ("every", "no_sync")
        ]
        flag = {"within": "", "spread": " spread", "off": " OFF"}[cell_verdict(row)]
        print(
            f"| {rate_label(row['rate_mbit'])} | {row['accum_steps']} | {cells[0]} | {cells[1]} | "
            f"{syncs['every']}/{syncs['no_sync']} | {row['measured_speedup']:.2f}x ({row['speedup_spread'] * 100:.0f}%) | "
            f"{row['predicted_speedup']:.2f}x ({row['relative_error'] * 100:+.1f}%){flag} | "
            f"{mean([inputs[mode]['link_ms_per_sync'] for mode in inputs]):.0f} ({row['predicted_ms_per_sync']:.0f}) | "
            f"{inputs['every']['compute_ms']:.0f}/{inputs['no_sync']['compute_ms']:.0f} | "
            f"{inputs['every']['wait_ms_per_sync']:.0f}/{inputs['no_sync']['wait_ms_per_sync']:.0f} |"
        )
    verdicts = [cell_verdict(row) for row in limited(table)]
    print(
        f"of the {len(verdicts)} cells with a link limit: {verdicts.count('within')} within {ERROR_BOUND:.0%}, "
        f"{verdicts.count('spread')} outside it but inside their repeats' spread, {verdicts.count('off')} off"
    )


def print_model_table(table, accums):
    """The model alone, by s/c and A: when no_sync pays, beside where the measured rates fall (r from each
    rate's cells: the link's time per sync over the compute per micro-batch)."""
    ratios = {}
    for row in table:
        for inputs in row["inputs"].values():
            ratios.setdefault(rate_label(row["rate_mbit"]), []).append(
                inputs["link_ms_per_sync"] / inputs["compute_ms"]
            )
    print(
        "predicted speedup A(1+r)/(A+r) by r = s/c; measured rates: "
        + ", ".join(
            f"{label} r = {mean(values):.2f}"
            for label, values in sorted(ratios.items(), key=lambda item: mean(item[1]))
        )
    )
    print("| A \\ s/c | " + " | ".join(f"{ratio:g}" for ratio in SYNC_TO_COMPUTE_RATIOS) + " |")
    print("|---|" + "---:|" * len(SYNC_TO_COMPUTE_RATIOS))
    for accum in accums:
        speedups = [f"{predicted_speedup(1, ratio, accum):.2f}x" for ratio in SYNC_TO_COMPUTE_RATIOS]
        print(f"| {accum} | " + " | ".join(speedups) + " |")


def calculate(gradient_bytes, compute, rate_mbit, latency, world_size, accum, shared_link):
    """Each mode's predicted seconds per optimizer step and no_sync's speedup, from the benchmark's own terms."""
    sync_seconds = link_seconds_at(latency, ring_wire_bits(gradient_bytes, world_size, shared_link), rate_mbit * 1e6)
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
        gradient_bytes,
        args.compute_ms / 1e3,
        args.rate_mbit,
        args.sync_latency_ms / 1e3,
        args.world_size,
        args.accum_steps,
        args.shared_link,
    )
    print(
        f"assumed: ring all-reduce, each rank sending 2(N-1)/N of {args.gradient_mb:g} MB per sync; "
        f"{'one half-duplex link shared by all ranks' if args.shared_link else 'full-duplex links, one per rank'}; "
        f"TCP/IP framing x {WIRE_BYTES_PER_PAYLOAD_BYTE:.4f}; s = max(latency, bits / rate) (a sync's work off the "
        f"wire overlaps its bits on it); compute and syncs not overlapped; "
        f"a window costs A(c + s) under every and Ac + s under no_sync"
    )
    print(f"s = {sync * 1e3:.1f} ms per sync, r = s/c = {sync / (args.compute_ms / 1e3):.2f}")
    print("| mode | s per optimizer step |\n|---|---:|")
    for mode, seconds in steps.items():
        print(f"| {mode} | {seconds:.3f} |")
    print(f"no_sync: {speedup:.2f}x faster per optimizer step (at most A = {args.accum_steps}x)")


if __name__ == "__main__":
    main()
