"""benchmarks/bench_checkpointing.py on two small micro-batches: each size measured both ways, the held
activations counted as train.py counts them, the table and the JSON written."""

import json

import torch
from torch import nn

from conftest import assert_one_line_error, run_python
from ddp_no_sync_lab.audit import memory
from ddp_no_sync_lab.precision import choose_precision
from model import MEMORY_FORMAT, CifarCNN


def saved_bytes(batch_size, activation_checkpointing):
    network = CifarCNN(activation_checkpointing=activation_checkpointing).to(memory_format=MEMORY_FORMAT)
    inputs = torch.randn(batch_size, 3, 32, 32).contiguous(memory_format=MEMORY_FORMAT)
    with memory.saved_activations(network) as held:
        with choose_precision("auto", torch.device("cpu")).autocast("cpu"):  # the benchmark's default
            nn.functional.cross_entropy(network(inputs), torch.zeros(batch_size, dtype=torch.long))
    return held.activation_bytes


def test_each_size_is_measured_both_ways(tmp_path):
    output = tmp_path / "checkpointing.json"
    result = run_python(
        "benchmarks/bench_checkpointing.py",
        "--batch-sizes",
        "4",
        "8",
        "--repeats",
        "2",
        "--micro-batches",
        "1",
        "--output",
        output,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(output.read_text())
    assert record["settings"] == {"batch_sizes": [4, 8], "micro_batches": 1, "repeats": 2, "threads": 1}
    assert [row["batch_size"] for row in record["rows"]] == [4, 8]
    for row in record["rows"]:
        for variant, checkpointed in (("plain", False), ("checkpointed", True)):
            measured = row[variant]
            assert measured["saved_activation_bytes"] == saved_bytes(row["batch_size"], checkpointed)
            assert len(measured["seconds_per_micro_batch"]) == 2 and measured["peak_allocated_bytes"] is None
        assert row["plain"]["saved_activation_bytes"] > 2 * row["checkpointed"]["saved_activation_bytes"]
    lines = result.stdout.splitlines()
    assert lines[1] == f"precision: {choose_precision('auto', torch.device('cpu')).reason}"
    assert lines[2].startswith("| micro-batch | saved activations MB, plain | checkpointed |")
    assert [line.split(" | ")[0] for line in lines[4:6]] == ["| 4", "| 8"]
    assert lines[-1] == f"written: {output}"


def test_cuda_without_a_gpu_is_one_line():
    """The tests' subprocesses see no GPU (conftest.subprocess_env)."""
    result = run_python("benchmarks/bench_checkpointing.py", "--device", "cuda")
    assert_one_line_error(result, "bench_checkpointing.py: error: --device cuda: no GPU is visible", code=2)
