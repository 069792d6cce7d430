"""The audit refuses every wrong run and no right one: step fingerprints exact whatever the summation order, a
run whose steps changed nothing or whose ranks read the same samples refused, non-finite values reported as
such, the strict audit's data and learning checks, profiler labels counted once on CUDA, DDP's teardown and a
dead NCCL peer bounded in time."""

import json
import re
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import (
    REPO,
    SMALL_RUN,
    assert_ok,
    assert_one_line_error,
    copy_runs,
    module_runs,
    module_start,
    read_json,
    run_in_process,
    stderr_lines,
    subprocess_env,
    train,
    verify,
)
from ddp_no_sync_lab import experiment, files
from ddp_no_sync_lab.audit import instruments, profiler, projection
from ddp_no_sync_lab.checks import strict_audit
from ddp_no_sync_lab.run import launch

FIXTURES = Path(__file__).resolve().parent / "fixtures"


# ----------------------------------------------------------------------------- the gradients' projection


def projection_parameters():
    """A channels_last convolution, a plain linear layer, and a parameter that is a view with gaps."""
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    gapped = torch.nn.Parameter(torch.randn(4, 8)[:, ::2])
    return [*conv.parameters(), *torch.nn.Linear(8, 4).parameters(), gapped]


def in_memory_order(parameter, gradient):
    """The gradient's elements in the order the parameter's memory holds them (contiguous where it has gaps)."""
    dense = parameter.is_contiguous() or parameter.is_contiguous(memory_format=torch.channels_last)
    laid_out = torch.empty_strided(parameter.shape, parameter.stride()) if dense else torch.empty(parameter.shape)
    return laid_out.copy_(gradient).as_strided((parameter.numel(),), (1,)).double()


def test_the_projection_pairs_each_element_with_its_weight_a_chunk_at_a_time(monkeypatch):
    """Read in chunks of 7 elements, by memory order (channels_last), a gradient with gaps by logical order: the
    same F and Q as one float64 dot product over the gradients laid end to end."""
    monkeypatch.setattr(projection, "CHUNK", 7)
    parameters = projection_parameters()
    for parameter in parameters:  # contiguous gradients: the channels_last one is read in its parameter's order
        parameter.grad = torch.randn(parameter.shape)
    parameters[-1].grad = torch.randn(4, 8)[:, ::2]  # a gradient with gaps too
    read = projection.Projection(parameters, torch.device("cpu"), world_size=2)
    flat = torch.cat([in_memory_order(p, p.grad) for p in parameters])
    held, none_held, sharded = read.held()
    weights = read.weights.double()
    assert (none_held, sharded) == (False, False)
    assert held[0].item() == pytest.approx(torch.dot(weights, flat).item(), rel=1e-12)
    assert held[1].item() == pytest.approx(torch.dot(flat, flat).item(), rel=1e-12)
    read.begin_own()
    for index, parameter in enumerate(parameters):
        read.copy_own(index, parameter.grad)
    assert torch.allclose(read.own_projection(), held, rtol=1e-12, atol=0)


def test_a_second_gradient_in_one_backward_adds_to_f_and_bounds_q_by_the_norms_sum():
    """Reentrant checkpointing can hand a parameter two gradients in one backward: F takes both, Q the square of
    their norms' sum (at least their sum's squared norm), where a copy would have kept the last alone."""
    (parameter,) = torch.nn.Linear(3, 2, bias=False).parameters()
    read = projection.Projection([parameter], torch.device("cpu"), world_size=2)
    first, second = torch.randn(2, 3), torch.randn(2, 3)
    read.begin_own()
    read.copy_own(0, first)
    read.copy_own(0, second)
    weights = read.weights.double()
    f, q = read.own_projection().tolist()
    assert f == pytest.approx(torch.dot(weights, (first.double() + second.double()).reshape(-1)).item(), rel=1e-12)
    assert q == pytest.approx((first.double().norm() + second.double().norm()).item() ** 2, rel=1e-12)
    assert q >= (first.double() + second.double()).norm().item() ** 2


def test_the_projections_weights_are_the_same_whatever_the_cpus_vector_instructions():
    """torch draws float32 normals with the CPU's vector instructions (or without: ATEN_CPU_CAPABILITY=default),
    its float64 ones alike everywhere: nodes of unlike CPUs must project on the same weights."""
    code = (
        "import hashlib, torch\n"
        "from ddp_no_sync_lab.audit import projection\n"
        "weights = projection.projection_weights([torch.empty(100_003)], torch.device('cpu'))\n"
        "print(hashlib.sha256(weights.numpy().tobytes()).hexdigest())"
    )
    digests = {
        capability: subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env=subprocess_env(ATEN_CPU_CAPABILITY=capability),
            cwd=REPO,
        ).stdout.strip()
        for capability in ("default", "avx2")
    }
    assert len(digests["default"]) == 64 and digests["default"] == digests["avx2"], digests


# ----------------------------------------------------------------------------- the step fingerprint


def test_the_fingerprint_does_not_depend_on_the_order_or_the_threads():
    """The same 558,538 values summed with 1 or 2 threads, as one tensor or as several: one fingerprint."""
    values = torch.randn(558_538, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = instruments.fingerprint([values])
        torch.set_num_threads(2)
        two_threads = instruments.fingerprint([values])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, two_threads)
    assert torch.equal(instruments.fingerprint(torch.split(values, [100_000, 458_538])), one_thread)


def test_one_ulp_and_a_swap_change_the_fingerprint():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    reference = instruments.fingerprint([values])
    nudged = values.clone()
    nudged[500] = torch.nextafter(nudged[500], torch.tensor(float("inf")))
    swapped = values.clone()
    swapped[[3, 700]] = swapped[[700, 3]]
    across = [values[:10].clone(), values[10:].clone()]
    across[0][0], across[1][0] = across[1][0].item(), across[0][0].item()  # a swap between two tensors
    for changed in ([nudged], [swapped], across):
        assert not torch.equal(instruments.fingerprint(changed)[:2], reference[:2])
    assert reference[2] == 0


def test_non_finite_values_are_counted_not_hashed_away():
    values = torch.randn(100)
    values[[5, 50]] = torch.tensor([float("nan"), float("inf")])
    assert instruments.fingerprint([values])[2].item() == 2


def test_a_step_that_changes_nothing_and_non_finite_values_are_each_told_apart(one_process_group):
    """ranks_agree's verdicts in a one-process group: [gradients agreed, parameters agreed, gradients finite,
    parameters finite, parameters changed, a rank asked to stop]."""
    parameter = torch.nn.Parameter(torch.randn(10))
    parameter.grad = torch.randn(10)
    before = instruments.before_step([parameter])
    with torch.no_grad():
        parameter.add_(1.0)
    assert instruments.ranks_agree(before, [parameter], None).tolist() == [True, True, True, True, True, False]
    before = instruments.before_step([parameter])
    assert instruments.ranks_agree(before, [parameter], None).tolist() == [True, True, True, True, False, False]
    assert instruments.ranks_agree(before, [parameter], None, stop_requested=True).tolist()[5] is True
    parameter.grad[0] = float("nan")
    with torch.no_grad():
        parameter[0] = float("nan")
    before = instruments.before_step([parameter])
    assert instruments.ranks_agree(before, [parameter], None).tolist() == [True, True, False, False, False, False]


def test_the_steps_agreement_reads_nothing_from_the_host_and_nothing_back(one_process_group):
    """On CUDA a tensor made from a host value is a host-to-device copy, and a value read back a sync: every
    step's agreement (the stop request included) must make neither. Seen here at the dispatcher, on CPU."""

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.operators = set()

        def __torch_dispatch__(self, operator, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(operator.overloadpacket)
            if name == "aten._to_copy" and kwargs.get("device") not in (None, args[0].device):
                name = "a copy between devices"
            self.operators.add(name)
            return operator(*args, **kwargs)

    parameter = torch.nn.Parameter(torch.randn(10))
    parameter.grad = torch.randn(10)
    for stop in (False, True):
        before = instruments.before_step([parameter])
        with Dispatched() as seen:
            verdict = instruments.ranks_agree(before, [parameter], None, stop_requested=stop)
        assert verdict.tolist()[5] is stop
        assert "aten.full" in seen.operators  # the flag, filled on the device
        assert not seen.operators & {"aten.lift_fresh", "aten._local_scalar_dense", "a copy between devices"}


# ----------------------------------------------------------------------------- real runs the audit refuses


# Each an `every` run of the shared experiment with one fault injected beneath the lab (tests/inject), audited
# beside the shared no_sync run.
FAULTS = {
    "drift_ulp": ["LAB_TEST_DRIFT_AT_STEP=1:8", "LAB_TEST_DRIFT=ulp"],
    "lost_gradients": ["LAB_TEST_LOSE_GRADIENTS=1"],
    "same_shard": ["LAB_TEST_SAME_SHARD=1"],
    "same_order": ["LAB_TEST_SAME_ORDER=1"],
    "nan": ["LAB_TEST_NAN_AT_STEP=*:2"],
}


@module_runs("faults")
def fault_runs(folder, image_data):
    """Every fault's run, in the session's module start."""
    options = ["--data-dir", image_data, *SMALL_RUN, "--quiet"]
    return [
        [*injections, "--mode", "every", "--output", folder / fault / "every", *options]
        for fault, injections in FAULTS.items()
    ]


@pytest.fixture(scope="module")
def faulty_runs(tmp_path_factory, image_data):
    folder, _ = module_start(tmp_path_factory, image_data, "faults")
    return folder


def beside_the_shared_no_sync(lab_runs, faulty_runs, fault, tmp_path):
    runs = copy_runs(faulty_runs / fault, tmp_path / "artifacts")
    shutil.copytree(lab_runs[0] / "no_sync", runs / "no_sync")
    return runs


@pytest.mark.torchrun
def test_a_one_ulp_drift_on_one_rank_is_caught(lab_runs, faulty_runs, tmp_path):
    """Rank 1 moves one weight by one ulp after its 8th step (epoch 2, step 3): the smallest difference there is."""
    runs = beside_the_shared_no_sync(lab_runs, faulty_runs, "drift_ulp", tmp_path)
    rows = read_json(runs / "every" / "history.json")
    assert [row["first_rank_disagreement"] for row in rows] == [None, {"optimizer_step": 3, "differed": ["parameters"]}]
    assert_one_line_error(
        verify(runs),
        f"{runs}/every/history.json: epoch 2: at optimizer step 3 the ranks held different parameters",
        code=1,
    )


@pytest.mark.torchrun
def test_a_run_whose_steps_changed_nothing_is_refused(lab_runs, faulty_runs, tmp_path):
    """The optimizer finds no gradients (tests/inject): every count, position, agreement and BatchNorm counter
    holds, and the run sits at chance (so the working pipeline's accuracy, above 0.5 in test_e2e.py, is evidence
    that it learns); the steps that changed no parameter give it away."""
    runs = beside_the_shared_no_sync(lab_runs, faulty_runs, "lost_gradients", tmp_path)
    rows = read_json(runs / "every" / "history.json")
    assert [(row["steps_with_ranks_agreed"], row["steps_that_changed_parameters"]) for row in rows] == [(5, 0), (5, 0)]
    assert read_json(runs / "every" / "report.json")["model_test_accuracy"] < 0.25
    assert_one_line_error(
        verify(runs),
        f"{runs}/every/history.json: epoch 1: 5 of 5 optimizer steps changed no parameter: the optimizer did not "
        "learn from its gradients",
        code=1,
    )


@pytest.mark.torchrun
def test_ranks_that_read_the_same_samples_are_refused(lab_runs, faulty_runs, tmp_path):
    """Every rank reads rank 0's shard: the averaged gradients agree, so the fingerprints cannot see it; the
    epoch's shards can."""
    runs = beside_the_shared_no_sync(lab_runs, faulty_runs, "same_shard", tmp_path)
    rows = read_json(runs / "every" / "history.json")
    assert shards_read(rows[0]) == {"samples_per_rank": 80, "distinct_samples": 80, "split_size": 160}
    assert rows[0]["steps_with_ranks_agreed"] == 5
    assert_one_line_error(
        verify(runs),
        f"{runs}/every/history.json: epoch 1: the 2 ranks read 80 samples each, 80 distinct of the 160 in the "
        "train split (expected 80 each, all 160 distinct): the ranks' shards overlap",
        code=1,
    )


@pytest.mark.torchrun
def test_epochs_that_read_one_order_are_refused(lab_runs, faulty_runs, tmp_path):
    """The samplers' set_epoch does nothing beneath the lab (tests/inject): every epoch reads the first one's order,
    in disjoint shards that cover the split; the order the loaders were handed gives it away."""
    runs = beside_the_shared_no_sync(lab_runs, faulty_runs, "same_order", tmp_path)
    rows = read_json(runs / "every" / "history.json")
    assert [shards_read(row) for row in rows] == [
        {"samples_per_rank": 80, "distinct_samples": 160, "split_size": 160}
    ] * 2
    assert rows[0]["sample_shards"]["order"] == rows[1]["sample_shards"]["order"]
    assert_one_line_error(
        verify(runs),
        f"{runs}/every/history.json: epoch 2: the ranks read epoch 1's order of samples again (order "
        f"{rows[0]['sample_shards']['order']}): the sampler's set_epoch did not take, and every epoch repeats one "
        "order [checklist item 2: each rank: 20,000 examples, 400 micro-batches per epoch]",
        code=1,
    )


def shards_read(row):
    """An epoch row's shards as read, without the fingerprint of their order."""
    return {key: value for key, value in row["sample_shards"].items() if key != "order"}


def test_the_shared_runs_record_disjoint_shards_each_epoch_its_order_and_steps_that_changed_the_weights(lab_runs):
    artifacts, _ = lab_runs
    for mode in experiment.MODES:
        rows = read_json(artifacts / mode / "history.json")
        for row in rows:
            assert shards_read(row) == {"samples_per_rank": 80, "distinct_samples": 160, "split_size": 160}
            assert re.fullmatch("[0-9a-f]{16}", row["sample_shards"]["order"])
            assert row["steps_that_changed_parameters"] == row["optimizer_steps"] == 5
            assert row["first_nonfinite_step"] is None
        assert len({row["sample_shards"]["order"] for row in rows}) == len(rows)


@pytest.mark.torchrun
def test_non_finite_values_on_every_rank_are_reported_as_such(lab_runs, faulty_runs, tmp_path):
    """A NaN in one gradient on every rank in step 2, which the step writes into the parameters: the ranks still
    agree (the same bits), and verify.py says what happened, not that the ranks disagreed."""
    runs = beside_the_shared_no_sync(lab_runs, faulty_runs, "nan", tmp_path)
    row = read_json(runs / "every" / "history.json")[0]
    assert row["first_nonfinite_step"] == {"optimizer_step": 2, "in": ["parameters"]}
    assert row["first_rank_disagreement"] is None
    assert_one_line_error(
        verify(runs),
        f"{runs}/every/history.json: epoch 1: at optimizer step 2 the parameters held NaN or infinite values: the "
        "run diverged",
        code=1,
    )


# ----------------------------------------------------------------------------- the strict audit


def documented_record(synthetic):
    return {"config": {"data_synthetic": synthetic}, "data_dir": "data/synthetic"}


def test_the_strict_audit_refuses_synthetic_data(tmp_path):
    strict_audit.check_real_data(tmp_path, documented_record(False))
    with pytest.raises(files.AuditError) as caught:
        strict_audit.check_real_data(tmp_path, documented_record(True))
    assert str(caught.value) == (
        f"{tmp_path}/run.json: the run trained on synthetic data (tools/synthetic_data.py wrote data/synthetic), not "
        "CIFAR-10: run the documented experiment on CIFAR-10, or audit these runs with --expect-from-config"
    )


def test_the_strict_audit_refuses_a_model_that_did_not_learn(tmp_path):
    report = {"model_test_accuracy": 0.1003, "baseline_accuracy": 0.1}
    with pytest.raises(files.AuditError) as caught:
        strict_audit.check_learned(tmp_path, report)
    assert str(caught.value) == (
        f"{tmp_path}/report.json: test accuracy 0.1003 is below 0.5 (the majority baseline is 0.1000): the model "
        "did not learn"
    )
    strict_audit.check_learned(tmp_path, {**report, "model_test_accuracy": 0.7063})


def test_runs_on_synthetic_data_say_so(lab_runs):
    artifacts, _ = lab_runs
    assert read_json(artifacts / "every" / "run.json")["config"]["data_synthetic"] is True


def test_strict_verify_names_synthetic_data_first(lab_runs):
    artifacts, _ = lab_runs
    line = assert_one_line_error(
        run_in_process("verify.py", "--artifacts", artifacts), "the run trained on synthetic data", code=1
    )
    assert "--expect-from-config" in line


# ----------------------------------------------------------------------------- the profiler's labels on CUDA


def fixture_events(name):
    """A recorded profiler's events as JSON (tests/fixtures), as objects that profiler.summarize reads."""
    kinds = {"cpu": torch.autograd.DeviceType.CPU, "cuda": torch.autograd.DeviceType.CUDA}
    return [
        SimpleNamespace(
            name=event["name"],
            device_type=kinds[event["device"]],
            time_range=SimpleNamespace(start=event["start"], end=event["end"]),
        )
        for event in json.loads((FIXTURES / name).read_text())
    ]


def test_cuda_annotations_of_the_labels_are_not_counted_twice():
    """On CUDA each record_function range comes twice: on the CPU and as a device-side annotation of the same
    name. The summary takes the CPU's: each micro-batch once, the agreement span only where the CPU ran it."""
    events = fixture_events("cuda_profile_events.json")
    assert sum(event.name == "micro-batch 8" for event in events) == 2  # the fixture holds both kinds
    summary = profiler.summarize(events, rank=0, audit={})
    assert [span[0] for span in summary["micro_batches"]] == [8, 9, 10, 11]
    fsdp = {"c10d::_allgather_base_": 0, "c10d::_reduce_scatter_base_": 0}
    assert summary["calls"] == {"c10d::allreduce_": 5, "c10d::broadcast_": 2, **fsdp}
    assert summary["executions"] == {"c10d::allreduce_": 5, "c10d::broadcast_": 2, "c10d::_allgather_base_": 0}
    kinds = [kind for kind, _, _ in summary["collectives"]]
    # The device-side agreement annotation lags into the next window's broadcasts; the CPU span does not.
    assert (kinds.count("gradient all-reduce"), kinds.count("rank-agreement all-reduce"), kinds.count("broadcast")) == (
        4,
        1,
        2,
    )


def test_verify_requires_each_profiled_micro_batch_once(lab_runs, tmp_path):
    runs = copy_runs(lab_runs[0], tmp_path / "artifacts")
    path = runs / "every" / files.PROFILE_FILE
    profile = read_json(path)
    profile["ranks"][1]["micro_batches"].append(profile["ranks"][1]["micro_batches"][0])
    path.write_text(json.dumps(profile))
    record_path = runs / "every" / files.RUN_RECORD_FILE
    record = read_json(record_path)
    record["files"][files.PROFILE_FILE] = {"bytes": path.stat().st_size, "sha256": files.sha256_file(path)}
    record_path.write_text(json.dumps(record))
    assert_one_line_error(
        verify(runs), "rank 1: the profiled micro-batches are labelled [8, 8, 9,", "not once each 8 to 15", code=1
    )


def test_every_ranks_trace_names_its_rank(lab_runs):
    artifacts, _ = lab_runs
    for mode in experiment.MODES:
        for rank, name in enumerate(files.profile_trace_files(2)):
            trace = json.loads((artifacts / mode / name).read_bytes())
            assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2


# ----------------------------------------------------------------------------- bounded waits


def test_a_dead_nccl_peer_ends_the_job_within_a_minute(monkeypatch):
    """CPU-testable part: the NCCL training group gets a 45 s timeout and asynchronous error handling, set
    before the group is made."""
    made = {}

    def new_group(**options):
        made.update(options, error_handling=launch.os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
        return "nccl group"

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setattr(launch.dist, "new_group", new_group)
    assert launch.training_group(torch.device("cpu")) is None
    assert launch.training_group(torch.device("cuda", 0)) == "nccl group"
    assert made == {"backend": "nccl", "timeout": timedelta(seconds=45), "error_handling": "1"}
    assert launch.NCCL_TIMEOUT + timedelta(seconds=15) <= timedelta(minutes=1)


@pytest.mark.torchrun
def test_a_teardown_that_hangs_is_ended_and_its_restart_does_not_train_again(image_data, tmp_path):
    """Closing the process groups hangs in the job's first start (tests/inject): the watchdog ends each process
    after its bound (10 s; 2 s here) with one line from the node (SIGKILL), the run it closes complete. Under
    --max-restarts the restart finds the run this job published (run.json's launch_id) and ends at once, exit 0,
    the run left as it was."""
    output = tmp_path / "every"
    hang = subprocess_env(LAB_TEST_HANG_IN_TEARDOWN="2")
    started = time.monotonic()
    result = train(image_data, output, "every", "--quiet", "--epochs", "1", env=hang, launcher=["--max-restarts=1"])
    assert time.monotonic() - started < 150  # against a hang: 5x the 30 s measured on the AVX2 kind (two files at once)
    assert_ok(result)
    lines = [line for line in result.stderr.splitlines() if "did not close within" in line]
    assert lines == [
        "train.py: the process groups did not close within 2 s (gloo's threads still held the communication hook's "
        "callbacks); ending the process (the run's artifacts were written before it)"
    ]
    assert "exitcode: -9" in result.stderr  # torchrun saw the first start killed, then restarted it
    report_lines = [json.loads(line) for line in result.stdout.splitlines() if '"model_test_accuracy"' in line]
    record = read_json(output / files.RUN_RECORD_FILE)
    assert len(report_lines) == 1 and report_lines[0]["run_id"] == record["run_id"]
    assert f"train.py: run {record['run_id']} is finished; nothing left to do" in stderr_lines(result)
    assert "resuming" not in result.stderr
    assert launch.TEARDOWN_SECONDS == 10  # the bound a user's run waits, shortened here
