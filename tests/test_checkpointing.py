"""--activation-checkpointing changes memory and time, nothing else: the same gradients at every step, the
same parameters and BatchNorm buffers, the same communication; and each way of doing it wrong is caught.

The model-level tests run CifarCNN in this process with the lab's numerics (the precision `auto` takes here,
channels_last, deterministic algorithms); the others run the real train.py under torchrun on the shared small
data.
"""

import copy
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

import model
from conftest import (
    SMALL_RUN,
    TIMING,
    assert_one_line_error,
    assert_train_error,
    module_runs,
    module_start,
    read_json,
    subprocess_env,
    verify,
)
from conftest import (
    train as train_run,
)
from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.audit import memory
from ddp_no_sync_lab.precision import choose_precision
from ddp_no_sync_lab.strategies import ddp
from model import MEMORY_FORMAT, CifarCNN

BATCH, ACCUM, STEPS = 8, 4, 3
LAB_PRECISION = choose_precision("auto", torch.device("cpu"))


@pytest.fixture
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def micro_batches(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(BATCH, 3, 32, 32, generator=generator).to(memory_format=MEMORY_FORMAT),
            torch.randint(0, 10, (BATCH,), generator=generator),
        )
        for _ in range(count)
    ]


def forward_loss(network, inputs, targets):
    with LAB_PRECISION.autocast("cpu"):
        return nn.functional.cross_entropy(network(inputs), targets) / ACCUM


def reentrant(function, *args, use_reentrant=None, context_fn=None, **kwargs):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)


def test_checkpointed_training_equals_plain_training_bit_for_bit(deterministic):
    """Three windows of four micro-batches with AdamW: gradients equal before every step, parameters and
    BatchNorm buffers (running statistics and counters) equal after the last; the activations held per
    micro-batch more than 2x fewer."""
    torch.manual_seed(0)
    plain = CifarCNN().to(memory_format=MEMORY_FORMAT)
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing = True
    networks = (plain, checkpointed)
    optimizers = [torch.optim.AdamW(network.parameters(), lr=3e-3, weight_decay=1e-4) for network in networks]
    held = []
    for step, window in enumerate(range(STEPS)):
        for inputs, targets in micro_batches(ACCUM, seed=window):
            for network in networks:
                with memory.saved_activations(network) as saved:
                    loss = forward_loss(network, inputs, targets)
                held.append((network is checkpointed, saved.activation_bytes))
                loss.backward()
        for a, b in zip(plain.parameters(), checkpointed.parameters()):
            assert torch.equal(a.grad, b.grad), f"gradients differ before step {step + 1}"
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), checkpointed.parameters()))
    assert [name for name, _ in plain.named_buffers()] == [name for name, _ in checkpointed.named_buffers()]
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), checkpointed.buffers()))
    assert plain.features[1].num_batches_tracked.item() == STEPS * ACCUM
    plain_bytes = {size for is_checkpointed, size in held if not is_checkpointed}
    checkpointed_bytes = {size for is_checkpointed, size in held if is_checkpointed}
    assert len(plain_bytes) == len(checkpointed_bytes) == 1  # the same every micro-batch
    assert plain_bytes.pop() > 2 * checkpointed_bytes.pop()


def graph_saved_tensors(loss, parameters):
    """{storage: bytes} of every tensor the autograd graph from `loss` saved (_saved_*), parameters aside."""
    found, seen, nodes = {}, set(), [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                for tensor in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in parameters:
                        found[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return found


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_saved_bytes_are_the_autograd_graphs_saved_tensors(precision):
    """An independent count: walk the graph from the loss and read each node's saved tensors. Under BF16
    autocast the graph also holds autocast's BF16 copies of the weights: counted apart, 2 bytes per weight of
    the convolutions and the classifier, not as activations. (Two 8x8 images: BF16 is emulated, slowly, on
    CPUs without BF16 instructions.)"""
    network = CifarCNN().to(memory_format=MEMORY_FORMAT)
    inputs = torch.randn(2, 3, 8, 8).contiguous(memory_format=MEMORY_FORMAT)
    with memory.saved_activations(network) as saved:
        with choose_precision(precision, torch.device("cpu")).autocast("cpu"):
            # (undivided: a division by a number saves no tensor, but its graph node shows it as one)
            loss = nn.functional.cross_entropy(network(inputs), torch.tensor([1, 2]))
    parameters = {parameter.untyped_storage().data_ptr() for parameter in network.parameters()}
    found = graph_saved_tensors(loss, parameters)
    assert {**saved.activations, **saved.weight_copies} == found and saved.activation_bytes > 0
    cast_weights = [m.weight for m in network.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    expected_copies = 2 * sum(weight.numel() for weight in cast_weights) if precision == "bf16" else 0
    assert saved.weight_copy_bytes == expected_copies


def test_reentrant_checkpointing_gives_the_stages_no_gradient(monkeypatch):
    """The images need no gradient: a reentrant checkpoint of the first stage returns an output that needs
    none either, so no stage's parameters get a gradient, with only a warning. The lab's non-reentrant
    checkpoint gives every parameter its gradient."""
    ((inputs, targets),) = micro_batches(1)
    network = CifarCNN(activation_checkpointing=True).to(memory_format=MEMORY_FORMAT)
    forward_loss(network, inputs, targets).backward()
    assert all(parameter.grad is not None for parameter in network.parameters())
    monkeypatch.setattr(model, "checkpoint", reentrant)
    network = CifarCNN(activation_checkpointing=True).to(memory_format=MEMORY_FORMAT)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        forward_loss(network, inputs, targets).backward()
    assert [name for name, parameter in network.named_parameters() if parameter.grad is not None] == [
        "classifier.weight",
        "classifier.bias",
    ]


def test_batchnorm_recomputed_as_is_updates_its_statistics_twice(monkeypatch):
    """A recomputation in training mode updates BatchNorm's running statistics again: the gradients are the
    same, the buffers (and so the saved model) are not. model.statistics_kept puts them back."""
    from contextlib import nullcontext

    ((inputs, targets),) = micro_batches(1)
    torch.manual_seed(0)
    plain = CifarCNN().to(memory_format=MEMORY_FORMAT)
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing = True
    monkeypatch.setattr(model, "recompute_context", lambda stage: (nullcontext(), nullcontext()))
    for network in (plain, checkpointed):
        forward_loss(network, inputs, targets).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), checkpointed.parameters()))
    assert (plain.features[1].num_batches_tracked.item(), checkpointed.features[1].num_batches_tracked.item()) == (1, 2)
    assert not torch.equal(plain.features[1].running_mean, checkpointed.features[1].running_mean)


def test_ddps_marked_ready_twice_becomes_one_line(monkeypatch):
    """The genuine DDP error of reentrant checkpointing with find_unused_parameters=True, in a one-process
    group, turned into train.py's one line that names the fix."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setattr(model, "checkpoint", reentrant)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp_model = nn.parallel.DistributedDataParallel(
            CifarCNN(activation_checkpointing=True), find_unused_parameters=True
        )
        ((inputs, targets),) = micro_batches(1)
        with pytest.raises(RuntimeError) as caught:
            forward_loss(ddp_model, inputs.requires_grad_(), targets).backward()
    finally:
        dist.destroy_process_group()
    explained = ddp.explain_ddp_error(caught.value)
    assert explained.line("train.py") == (
        "RuntimeError: DDP saw a parameter's gradient twice in one backward (\"Expected to mark a variable ready "
        'only once"): with activation checkpointing use torch.utils.checkpoint.checkpoint(..., use_reentrant=False), '
        "as model.CifarCNN does for --activation-checkpointing; reentrant checkpointing gives no gradient to a stage "
        "whose input needs none and, with find_unused_parameters=True, marks its parameters ready twice"
    )
    assert ddp.explain_ddp_error(RuntimeError("CUDA out of memory")) is None


# ----------------------------------------------------------------------------- the real train.py


@module_runs("checkpointed")
def checkpointing_runs(folder, image_data):
    """The checkpointed pair (in artifacts/), and beside it (twice/) `every` checkpointed with BatchNorm recomputed
    as is (tests/inject), in the session's module start."""
    common = ["--data-dir", image_data, *SMALL_RUN, "--activation-checkpointing", "--quiet"]
    runs = [["--mode", mode, "--output", folder / "artifacts" / mode, *common] for mode in experiment.MODES]
    return [*runs, ["LAB_TEST_CHECKPOINT=statistics_twice", "--mode", "every", "--output", folder / "twice", *common]]


@pytest.fixture(scope="module")
def checkpointed_runs(image_data, tmp_path_factory):
    folder, _ = module_start(tmp_path_factory, image_data, "checkpointed")
    return folder / "artifacts"


@pytest.mark.torchrun
def test_checkpointed_runs_pass_the_audit_with_the_plain_runs_counts(checkpointed_runs, lab_runs):
    result = verify(checkpointed_runs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| every | on | " in result.stdout and "| no_sync | on | " in result.stdout
    plain_artifacts, _ = lab_runs
    memory = {"saved_activation_bytes", "peak_allocated_bytes"}
    for mode in experiment.MODES:
        rows, plain_rows = (
            read_json(folder / mode / "history.json") for folder in (checkpointed_runs, plain_artifacts)
        )
        # Everything but time and memory is the plain run's: counts, positions, losses, accuracies, agreement.
        assert [{k: v for k, v in row.items() if k not in TIMING | memory} for row in rows] == [
            {k: v for k, v in row.items() if k not in TIMING | memory} for row in plain_rows
        ]
        assert all(
            2 * row["saved_activation_bytes"] < plain["saved_activation_bytes"] for row, plain in zip(rows, plain_rows)
        )
        # The same parameters and BatchNorm buffers, bit for bit.
        weights, plain_weights = (
            torch.load(folder / mode / "model.pt", weights_only=True)["model"]
            for folder in (checkpointed_runs, plain_artifacts)
        )
        assert weights.keys() == plain_weights.keys() and all(
            torch.equal(weights[name], plain_weights[name]) for name in weights
        )
        assert read_json(checkpointed_runs / mode / "run.json")["config"]["activation_checkpointing"] is True


@pytest.mark.torchrun
def test_verify_refuses_to_compare_a_checkpointed_run_with_a_plain_one(checkpointed_runs, lab_runs, tmp_path):
    shutil.copytree(lab_runs[0] / "every", tmp_path / "every")
    shutil.copytree(checkpointed_runs / "no_sync", tmp_path / "no_sync")
    assert_one_line_error(
        verify(tmp_path), "come from different configurations (activation_checkpointing: False vs True", code=1
    )


@pytest.mark.torchrun
def test_reentrant_checkpointing_in_train_py_stops_with_one_line(image_data, tmp_path):
    result = train_run(
        image_data,
        tmp_path / "every",
        "every",
        "--activation-checkpointing",
        "--quiet",
        env=subprocess_env(LAB_TEST_CHECKPOINT="reentrant"),
    )
    assert_train_error(
        result,
        'RuntimeError: DDP found parameters that got no gradient in the last backward ("Expected to have finished '
        'reduction in the prior iteration"): with activation checkpointing use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)',
    )


@pytest.mark.torchrun
def test_statistics_updated_twice_are_caught_by_verify(checkpointed_runs, tmp_path):
    """The recomputation left to update BatchNorm again: every count, loss and gradient is right, and only the
    BatchNorm counters (and running statistics) of the saved model give it away."""
    runs = tmp_path / "artifacts"
    shutil.copytree(checkpointed_runs / "no_sync", runs / "no_sync")
    shutil.copytree(checkpointed_runs.parent / "twice", runs / "every")
    assert_one_line_error(
        verify(runs),
        f"{runs}/every/model.pt: features.1 counted 80 BatchNorm updates, the run had 40 training forwards: its running "
        "statistics were updated more than once per forward",
        code=1,
    )
