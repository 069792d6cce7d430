"""benchmarks/bench_network.py: its model's arithmetic, its refusals, and one small real run (two torchrun
nodes in a network namespace of its own, a 50 Mbit/s link) that leaves nothing behind."""

import json
import os
import sys

import pytest
from PIL import Image

from benchmarks import bench_network, link_model
from conftest import assert_one_line_error, run_python

FRAMING = (1514 + 33) / 1448  # a 1,514-byte frame per 1,448 bytes of TCP payload, a 66-byte ACK every second


def run(syncs, steps, *samples, sent=1_000_000, **counts):
    """One mode in one cell: its counts, and each repeat's (epoch, comm, sync, its wait, all-gather, its wait)
    seconds."""
    keys = bench_network.TIMES
    return {
        "gradient_syncs": syncs,
        "optimizer_steps": steps,
        "allreduce_bytes": syncs * sent,
        **counts,
        "samples": [dict(zip(keys, sample)) for sample in samples],
    }


def slow_link_rows():
    """2 steps of A = 4: c = 0.25 s per micro-batch; each sync's link time 0.01 s unlimited and 0.2 s on the slow
    link, where the ranks also wait 0.05 s for one another at each sync."""
    return [
        {
            "rate_mbit": None,
            "accum_steps": 4,
            "runs": {
                "every": run(8, 2, (2.08, 0.08, 0.08, 0, 0, 0)),
                "no_sync": run(2, 2, (2.02, 0.02, 0.02, 0, 0, 0)),
            },
        },
        {
            "rate_mbit": 50,
            "accum_steps": 4,
            "runs": {"every": run(8, 2, (4.0, 2.0, 2.0, 0.4, 0, 0)), "no_sync": run(2, 2, (2.5, 0.5, 0.5, 0.1, 0, 0))},
        },
    ]


def test_the_model_predicts_the_link_and_takes_the_rest_from_each_runs_own_clock():
    (latency, gather_latency), table = link_model.analyse(slow_link_rows())
    assert latency == pytest.approx(0.01) and gather_latency == 0
    slow = table[1]
    # Each sync puts both ranks' 1,000,000 bytes through the link, framed; s = max(L, W / R): W / R here.
    wire_bits = 2 * 1_000_000 * 8 * FRAMING
    assert slow["wire_bits_per_sync"] == pytest.approx(wire_bits)
    sync = wire_bits / 50e6
    assert slow["predicted_ms_per_sync"] == pytest.approx(sync * 1e3)
    # The run's own clock: all but the link's part of the syncs (the sync time less the ranks' wait).
    every = (4.0 - (2.0 - 0.4) + 8 * sync) / 2
    no_sync = (2.5 - (0.5 - 0.1) + 2 * sync) / 2
    steps = slow["step_seconds"]
    assert steps["every"]["predicted"] == pytest.approx(every) and steps["no_sync"]["predicted"] == pytest.approx(
        no_sync
    )
    assert steps["every"]["error"] == pytest.approx(every / 2.0 - 1)
    assert slow["measured_speedup"] == pytest.approx(4.0 / 2.5)
    assert slow["predicted_speedup"] == pytest.approx(every / no_sync)
    assert slow["relative_error"] == pytest.approx(every / no_sync / 1.6 - 1)
    assert slow["inputs"]["every"] == pytest.approx(
        {"compute_ms": 250, "wait_ms_per_sync": 50, "link_ms_per_sync": 200}
    )
    # The longer of the two, never their sum: a link fast enough for the bits leaves the time without a limit.
    assert [link_model.link_seconds_at(0.01, 1e6, rate) for rate in (None, 50e6, 200e6)] == [0.01, 0.02, 0.01]
    # The unlimited cell: its own link time is the latency itself, so the prediction is the measurement.
    assert table[0]["relative_error"] == pytest.approx(0)
    s_unlimited, bits = link_model.link_fit(table)
    assert s_unlimited == pytest.approx(0.01) and bits == pytest.approx(0.19 * 50e6)


def test_repeats_that_spread_wider_than_the_bound_are_reported_as_such():
    """Two repeats per mode: the cell's spread is that of the repeats' speedups; a cell off by more than 10 %
    is "spread" when its error lies inside that spread, else "off"."""
    rows = slow_link_rows()
    rows[1]["runs"]["every"] = run(8, 2, (4.0, 2.0, 2.0, 0.4, 0, 0), (4.0, 2.0, 2.0, 0.4, 0, 0))
    rows[1]["runs"]["no_sync"] = run(2, 2, (2.5, 0.5, 0.5, 0.1, 0, 0), (2.0, 0.5, 0.5, 0.1, 0, 0))
    _, table = link_model.analyse(rows)
    slow = table[1]
    assert slow["repeat_speedups"] == pytest.approx([1.6, 2.0])
    assert slow["speedup_spread"] == pytest.approx(0.4 / 1.8)  # of the repeats' mean
    assert slow["step_seconds"]["no_sync"]["spread"] == pytest.approx(0.25 / 1.125)
    assert link_model.cell_verdict(table[0]) == "within"
    assert link_model.cell_verdict({**slow, "relative_error": 0.15}) == "spread"
    assert link_model.cell_verdict({**slow, "relative_error": 0.15, "speedup_spread": 0.05}) == "off"
    assert link_model.cell_verdict({**slow, "relative_error": -0.3}) == "off"  # wider than the spread
    assert link_model.limited(table) == [slow]


def test_under_fsdp_the_model_adds_the_all_gathers_to_every_micro_batch():
    """--strategy fsdp: a sync reduce-scatters (gloo runs it as an all-reduce: both ranks' handed bytes), and every
    micro-batch all-gathers both ranks' shards, in both modes: L_g from the unlimited runs, G / R more on a link."""
    fsdp = {"allreduce_bytes": 0}
    rows = [
        {
            "rate_mbit": None,
            "accum_steps": 4,
            "runs": {
                "every": run(8, 2, (2.24, 0.24, 0.08, 0, 0.16, 0), **fsdp, reduce_scatter_bytes=8 * 1_000_000),
                "no_sync": run(2, 2, (2.18, 0.18, 0.02, 0, 0.16, 0), **fsdp, reduce_scatter_bytes=2 * 1_000_000),
            },
        },
        {
            "rate_mbit": 50,
            "accum_steps": 4,
            "runs": {
                "every": run(8, 2, (6.0, 4.0, 2.0, 0.4, 2.0, 0.4), **fsdp, reduce_scatter_bytes=8 * 1_000_000),
                "no_sync": run(2, 2, (4.5, 2.5, 0.5, 0.1, 2.0, 0.4), **fsdp, reduce_scatter_bytes=2 * 1_000_000),
            },
        },
    ]
    (latency, gather_latency), table = link_model.analyse(rows, gathered_bytes=500_000)
    assert latency == pytest.approx(0.01) and gather_latency == pytest.approx(0.32 / 16)
    slow = table[1]
    assert slow["wire_bits_per_sync"] == pytest.approx(2 * 1_000_000 * 8 * FRAMING)
    assert slow["gather_bits_per_micro_batch"] == pytest.approx(2 * 500_000 * 8 * FRAMING)
    sync, gather = 16e6 * FRAMING / 50e6, 8e6 * FRAMING / 50e6
    steps = slow["step_seconds"]
    # Each run's own clock less the link's part of its syncs and of its all-gathers (their time less the wait).
    assert steps["every"]["predicted"] == pytest.approx((6.0 - 1.6 - 1.6 + 8 * sync + 8 * gather) / 2)
    assert steps["no_sync"]["predicted"] == pytest.approx((4.5 - 0.4 - 1.6 + 2 * sync + 8 * gather) / 2)
    assert slow["inputs"]["every"]["compute_ms"] == pytest.approx((6.0 - 2.0 - 2.0) / 8 * 1e3)


def test_the_calculator_predicts_what_the_benchmark_checks_and_a_ring_for_n_ranks():
    """benchmarks/link_model.py as a command: on two ranks sharing one half-duplex link its sync is the
    benchmark's predicted one; for N ranks each sends 2(N-1)/N of the bytes."""
    (latency, _), table = link_model.analyse(slow_link_rows())
    sync, steps, speedup = link_model.calculate(1_000_000, 0.25, 50, latency, 2, 4, shared_link=True)
    assert sync * 1e3 == pytest.approx(table[1]["predicted_ms_per_sync"])
    assert steps == pytest.approx({"every": 4 * (0.25 + sync), "no_sync": 4 * 0.25 + sync})
    assert speedup == pytest.approx(steps["every"] / steps["no_sync"])
    assert link_model.ring_wire_bits(1e6, 8, shared_link=False) == pytest.approx(2 * 7 / 8 * 1e6 * 8 * FRAMING)
    assert link_model.ring_wire_bits(1e6, 2, shared_link=False) == pytest.approx(1e6 * 8 * FRAMING)
    cell = ["--gradient-mb", "1", "--compute-ms", "250", "--rate-mbit", "50", "--sync-latency-ms", "10"]
    result = run_python("benchmarks/link_model.py", *cell, "--accum-steps", "4", "--shared-link")
    assert result.returncode == 0, result.stderr
    assert f"| every | {steps['every']:.3f} |" in result.stdout
    assert result.stdout.splitlines()[-1] == f"no_sync: {speedup:.2f}x faster per optimizer step (at most A = 4x)"
    assert_one_line_error(
        run_python("benchmarks/link_model.py", "--gradient-mb", "0", "--compute-ms", "1", "--rate-mbit", "1"),
        "argument --gradient-mb: must be more than 0, got 0",
    )


def test_a_node_that_writes_much_cannot_stall_the_other(tmp_path, monkeypatch):
    """Node 1 writes 1 MB (a pipe holds 64 KB) and node 0 waits for node 1 to end, as nodes wait for each other
    in a collective: with the launchers' output in files, neither waits on the benchmark to read it."""
    done = tmp_path / "node1-done"

    def waiting_nodes(node, nodes, port, script_args):
        if node == 1:
            code = f"import sys, pathlib; sys.stderr.write('x' * 1_000_000); pathlib.Path({str(done)!r}).touch()"
        else:
            code = f"import time, pathlib\nwhile not pathlib.Path({str(done)!r}).exists(): time.sleep(0.05)"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(bench_network.loopback, "loopback_node_command", waiting_nodes)
    monkeypatch.setattr(bench_network, "RUN_TIMEOUT", 60)  # a stall ends there, in a LabError
    bench_network.Nodes().run([], logs=tmp_path / "logs")
    assert (tmp_path / "logs" / "node1.log").stat().st_size == 1_000_000


@pytest.mark.parametrize(
    "rates, message",
    [
        ("200,50", "include 'unlimited'"),
        ("unlimited,fast", "expected 'unlimited' or Mbit/s above 0, got 'fast'"),
        ("unlimited,-5", "got '-5'"),
    ],
)
def test_bad_rates_get_one_line(rates, message):
    assert_one_line_error(
        run_python("benchmarks/bench_network.py", "--rates", rates),
        "bench_network.py: error: argument --rates:",
        message,
    )


def test_bad_accumulation_steps_get_one_line():
    assert_one_line_error(
        run_python("benchmarks/bench_network.py", "--accum-steps", "2,0"),
        "bench_network.py: error: argument --accum-steps: expected whole numbers of at least 1",
    )


@pytest.mark.torchrun
def test_a_small_run_over_a_slow_link_then_nothing_is_left(tmp_path):
    """As root (CI runs as root), one optimizer step of 2 micro-batches per mode with BF16-compressed
    gradients, at no limit and at 50 Mbit/s; as another user, the one-line refusal."""
    options = ["--rates", "unlimited,50", "--accum-steps", "2", "--comm-hook", "bf16", "--steps", "1", "--repeats", "1"]
    result = run_python("benchmarks/bench_network.py", *options, "--out", tmp_path, timeout=600)
    if os.geteuid() != 0:
        assert_one_line_error(result, "needs root to make a network namespace")
        return
    assert result.returncode == 0, result.stdout + result.stderr
    assert "clean-up: no process left in the benchmark's namespace" in result.stderr
    record = json.loads((tmp_path / "network-bf16.json").read_text())
    assert [row["rate_mbit"] for row in record["rows"]] == [None, 50]
    for row in record["rows"]:
        assert row["accum_steps"] == 2 and row["gradient_syncs"] == {"every": 2, "no_sync": 1}
        assert row["optimizer_steps"] == {"every": 1, "no_sync": 1}
        # BF16 compression: both ranks' 1,117,076 bytes, framed: 19.1 Mbit through the link per sync.
        assert row["wire_bits_per_sync"] == pytest.approx(2 * 1_117_076 * 8 * FRAMING)
        for inputs in row["inputs"].values():
            assert inputs["compute_ms"] > 0 and 0 <= inputs["wait_ms_per_sync"] and inputs["link_ms_per_sync"] > 0
    slow = record["rows"][1]
    # The times are the benchmark's to print and record (a test on a shared machine judges none of them): here
    # the record's own arithmetic: the speedup is the ratio of the modes' measured steps.
    steps = slow["step_seconds"]
    assert slow["measured_speedup"] == pytest.approx(steps["every"]["measured"] / steps["no_sync"]["measured"])
    assert sum(record["limited_cells"].values()) == 1
    picture = Image.open(tmp_path / "network.png")
    assert [point["series"] for point in json.loads(picture.text["data"])["points"]] == ["ddp bf16"] * 2
    assert not [
        line for line in os.popen("ps -eo args").read().splitlines() if "bench-network-" in line
    ]  # its workspace
