"""benchmarks/bench_network.py: its model's arithmetic, its refusals, and one small real run (two torchrun
nodes in a network namespace of its own, a 50 Mbit/s link) that leaves nothing behind."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, assert_one_line_error, run_python

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_network  # noqa: E402
import link_model  # noqa: E402


def history_row(epoch_seconds, comm_seconds, syncs, steps):
    return {
        "epoch_seconds": epoch_seconds,
        "comm_seconds": comm_seconds,
        "gradient_syncs": syncs,
        "optimizer_steps": steps,
        "allreduce_bytes": syncs * 1_000_000,
    }


def slow_link_rows():
    """c = 0.25 s per micro-batch; s = 0.01 s unlimited and 0.25 s on the slow link; 8 micro-batches, 2 steps."""
    return [
        {"rate_mbit": None, "accum_steps": 4, "runs": {"every": history_row(2.08, 0.08, 8, 2), "no_sync": history_row(2.02, 0.02, 2, 2)}},
        {"rate_mbit": 50, "accum_steps": 4, "runs": {"every": history_row(4.0, 2.0, 8, 2), "no_sync": history_row(2.5, 0.5, 2, 2)}},
    ]  # fmt: skip


def test_the_model_predicts_from_compute_and_sync_time():
    rows = slow_link_rows()
    (compute, latency), table = link_model.analyse(rows)
    assert compute == pytest.approx(0.25) and latency == pytest.approx(0.01)
    slow = table[1]
    assert slow["seconds_per_sync"] == pytest.approx(0.25)
    assert slow["measured_speedup"] == pytest.approx(4.0 / 2.5)
    assert slow["predicted_speedup"] == pytest.approx(4 * 0.5 / (4 * 0.25 + 0.25))  # A(c+s)/(Ac+s) = 1.6
    assert slow["relative_error"] == pytest.approx(1.6 / 1.6 - 1)
    s_unlimited, bits = link_model.link_fit(table)
    assert s_unlimited == pytest.approx(0.01) and bits == pytest.approx(0.24 * 50e6)
    # From first principles: each sync puts both ranks' 1,000,000 bytes through the link, framed: 1,514-byte
    # frames for 1,448 bytes of payload and a 66-byte ACK every second segment; s = L + W / R.
    wire_bits = 2 * 1_000_000 * 8 * (1514 + 33) / 1448
    assert slow["wire_bits_per_sync"] == pytest.approx(wire_bits)
    first = slow["first_principles"]
    sync = 0.01 + wire_bits / 50e6
    assert first["seconds_per_sync"] == pytest.approx(sync)
    assert first["every_step_seconds"] == pytest.approx(4 * (0.25 + sync))
    assert first["no_sync_step_seconds"] == pytest.approx(4 * 0.25 + sync)
    assert first["step_errors"]["every"] == pytest.approx(4 * (0.25 + sync) / 2.0 - 1)


def test_under_fsdp_the_model_adds_the_all_gathers_to_every_micro_batch():
    """--strategy fsdp: a sync reduce-scatters (gloo runs it as an all-reduce: both ranks' handed bytes), and every
    micro-batch all-gathers both ranks' shards, in both modes."""
    fsdp = {"allreduce_bytes": 0, "reduce_scatter_bytes": 8 * 1_000_000}
    rows = [
        {"rate_mbit": None, "accum_steps": 4, "runs": {"every": {**history_row(2.08, 0.08, 8, 2), **fsdp}, "no_sync": {**history_row(2.02, 0.02, 2, 2), **fsdp, "reduce_scatter_bytes": 2 * 1_000_000}}},
        {"rate_mbit": 50, "accum_steps": 4, "runs": {"every": {**history_row(4.0, 2.0, 8, 2), **fsdp}, "no_sync": {**history_row(2.5, 0.5, 2, 2), **fsdp, "reduce_scatter_bytes": 2 * 1_000_000}}},
    ]  # fmt: skip
    _, table = link_model.analyse(rows, gathered_bytes=500_000)
    framing = (1514 + 33) / 1448
    slow = table[1]
    assert slow["wire_bits_per_sync"] == pytest.approx(2 * 1_000_000 * 8 * framing)
    assert slow["gather_bits_per_micro_batch"] == pytest.approx(2 * 500_000 * 8 * framing)
    sync, gather = 0.01 + 16e6 * framing / 50e6, 8e6 * framing / 50e6
    first = slow["first_principles"]
    assert first["every_step_seconds"] == pytest.approx(4 * (0.25 + gather + sync))
    assert first["no_sync_step_seconds"] == pytest.approx(4 * (0.25 + gather) + sync)


def test_the_calculator_predicts_what_the_benchmark_checks_and_a_ring_for_n_ranks():
    """benchmarks/link_model.py as a command: on two ranks sharing one half-duplex link it is the benchmark's own
    first-principles prediction; for N ranks each sends 2(N-1)/N of the bytes."""
    rows = slow_link_rows()
    (compute, latency), table = link_model.analyse(rows)
    first = table[1]["first_principles"]
    sync, steps, speedup = link_model.calculate(1_000_000, compute, 50, latency, 2, 4, shared_link=True)
    assert sync == pytest.approx(first["seconds_per_sync"])
    assert steps == pytest.approx({"every": first["every_step_seconds"], "no_sync": first["no_sync_step_seconds"]})
    assert speedup == pytest.approx(first["speedup"])
    framing = (1514 + 33) / 1448
    assert link_model.ring_wire_bits(1e6, 8, shared_link=False) == pytest.approx(2 * 7 / 8 * 1e6 * 8 * framing)
    assert link_model.ring_wire_bits(1e6, 2, shared_link=False) == pytest.approx(1e6 * 8 * framing)
    result = run_python(
        "benchmarks/link_model.py", "--gradient-mb", "1", "--compute-ms", "250", "--rate-mbit", "50",
        "--sync-latency-ms", "10", "--accum-steps", "4", "--shared-link",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"| every | {first['every_step_seconds']:.3f} |" in result.stdout
    assert (
        result.stdout.splitlines()[-1] == f"no_sync: {first['speedup']:.2f}x faster per optimizer step (at most A = 4x)"
    )
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
    monkeypatch.setattr(bench_network, "RUN_TIMEOUT", 30)
    started = time.monotonic()
    bench_network.Nodes().run([], logs=tmp_path / "logs")
    assert time.monotonic() - started < 20
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


def test_a_small_run_over_a_slow_link_then_nothing_is_left(tmp_path):
    """As root (CI runs as root), one optimizer step of 2 micro-batches per mode with BF16-compressed
    gradients, at no limit and at 50 Mbit/s; as another user, the one-line refusal."""
    result = run_python(
        "benchmarks/bench_network.py", "--rates", "unlimited,50", "--accum-steps", "2", "--comm-hook", "bf16",
        "--steps", "1", "--repeats", "1", "--out", tmp_path, timeout=600,
    )  # fmt: skip
    if os.geteuid() != 0:
        assert_one_line_error(result, "needs root to make a network namespace")
        return
    assert result.returncode == 0, result.stdout + result.stderr
    assert "clean-up: no process left in the benchmark's namespace" in result.stderr
    record = json.loads((tmp_path / "network.json").read_text())
    assert [row["rate_mbit"] for row in record["rows"]] == [None, 50]
    for row in record["rows"]:
        assert row["accum_steps"] == 2 and row["gradient_syncs"] == {"every": 2, "no_sync": 1}
        assert row["optimizer_steps"] == {"every": 1, "no_sync": 1}
        # BF16 compression: both ranks' 1,117,076 bytes, framed: 19.1 Mbit through the link per sync.
        assert row["wire_bits_per_sync"] == pytest.approx(2 * 1_117_076 * 8 * (1514 + 33) / 1448)
    slow = record["rows"][1]
    # 0.38 s at 50 Mbit/s, whatever the compute (the unlimited sync's time depends on it: it includes the wait
    # for the slower rank).
    assert slow["seconds_per_sync"] > 0.3 and slow["first_principles"]["seconds_per_sync"] > 0.38
    assert slow["measured_speedup"] > 1.1
    assert Path(tmp_path / "network.png").stat().st_size > 0
    assert not [
        line for line in os.popen("ps -eo args").read().splitlines() if "bench-network-" in line
    ]  # its workspace
