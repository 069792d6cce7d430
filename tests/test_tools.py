"""The helper commands: the environment check, the synthetic data writer and `make clean`."""

import importlib.util
import json
import shutil
import subprocess

import pytest
import torch

from conftest import REPO, assert_one_line_error, run_python
from lab import launch
from lab.cli import LabError
from lab.precision import choose_precision


def test_check_env_reports_the_machine_and_the_way_the_lab_runs():
    result = run_python("check_env.py")
    assert result.returncode == 0, result.stderr
    for label in (
        "OS:",
        "Python:",
        "torch:",
        "torchvision:",
        "CUDA runtime:",
        "GPU count:",
        "free disk here:",
        "data:",
    ):
        assert label in result.stdout
    assert f"CPU capability:   {torch.backends.cpu.get_cpu_capability()}" in result.stdout
    assert f"precision:        {choose_precision('auto', torch.device('cpu')).reason}" in result.stdout
    # The tests' subprocesses see no GPU (conftest.subprocess_env), also on a machine that has one.
    assert "The lab will run on CPU: 2 process(es) here with gloo" in result.stdout
    assert run_python("check_env.py", "--lab-device").stdout.strip() == "cpu"
    assert run_python("check_env.py", "--lab-device", "--nproc-per-node", "1").stdout.strip() == "cpu"


def test_synthetic_data_refuses_to_write_over_a_folder(tmp_path):
    (tmp_path / "data").mkdir()
    assert_one_line_error(
        run_python("tools/synthetic_data.py", "--out", tmp_path / "data"), "already exists; remove it"
    )
    assert_one_line_error(
        run_python("tools/synthetic_data.py", "--out", tmp_path / "new", "--seed", "-1"),
        "argument --seed: must be at least 0, got -1",
    )


def test_make_clean_removes_only_the_labs_outputs(tmp_path):
    lab_copy = tmp_path / "lab"
    shutil.copytree(REPO, lab_copy, ignore=shutil.ignore_patterns(".venv*", ".git", "artifacts", "data", "__pycache__"))
    for made in ("artifacts/every", "data/train", ".venv/bin", "__pycache__"):
        (lab_copy / made).mkdir(parents=True)
    (tmp_path / "artifacts").mkdir()  # someone else's folder beside the lab
    result = subprocess.run(["make", "-C", str(lab_copy), "clean"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for made in ("artifacts", "data", ".venv", "__pycache__"):
        assert not (lab_copy / made).exists()
    assert (lab_copy / "train.py").is_file() and (lab_copy / "README.md").is_file()
    assert (tmp_path / "artifacts").is_dir()


def test_one_device_policy_per_node(monkeypatch):
    """launch.node_device, used by train.py --device auto and check_env.py: CUDA only with a GPU per process."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert launch.node_device(1) == ("cuda", 1)  # 2 nodes x 1 GPU: each node runs one process on its GPU
    assert launch.node_device(2) == ("cpu", 1)  # one GPU for two processes: CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.node_device(1) == ("cpu", 0)


def test_ranks_share_a_gpu_only_over_gloo(monkeypatch):
    """NCCL refuses two ranks on one GPU: --device cuda needs a GPU per process unless --gpu-backend gloo, whose
    training collectives stay in the default gloo group (gpu_check.sh runs that job on one GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    place = launch.Place(rank=1, local_rank=1, node=0, world_size=2, local_world_size=2, nodes=1)
    with pytest.raises(
        LabError, match="2 processes on this node, 1 GPU.* or share the GPUs over gloo with --gpu-backend gloo"
    ):
        launch.choose_device("cuda", place)
    assert launch.choose_device("cuda", place, "gloo") == "cuda"
    assert launch.choose_device("auto", place, "gloo") == "cpu"  # auto keeps its policy: a GPU per process
    assert launch.training_group(torch.device("cuda", 0), "gloo") is None


def test_the_hta_check_reads_every_ranks_trace_or_says_what_it_needs(lab_runs, tmp_path):
    """tools/hta_check.py (optional: HolisticTraceAnalysis is not among the requirements). A run folder without
    traces, and a trace that does not name its rank, are one line; the shared profiled runs are read by HTA
    where it is installed, and otherwise the line says how to install it."""
    artifacts, _ = lab_runs
    assert_one_line_error(run_python("tools/hta_check.py", tmp_path), f"{tmp_path}/run.json is missing")
    result = run_python("tools/hta_check.py", artifacts / "no_sync")
    if importlib.util.find_spec("hta") is None:
        assert_one_line_error(
            result, "HolisticTraceAnalysis is not installed: pip install HolisticTraceAnalysis==0.5.0"
        )
    else:
        assert result.returncode == 0, result.stderr
        assert f"HTA loaded the traces of ranks [0, 1] from {artifacts / 'no_sync'}" in result.stdout
        assert "no GPU kernels in these traces (a CPU run)" in result.stdout
    copy = tmp_path / "copy"
    shutil.copytree(artifacts / "no_sync", copy)
    trace = copy / "profile_trace.rank1.json"
    content = json.loads(trace.read_bytes())
    content["distributedInfo"]["rank"] = 0
    trace.write_text(json.dumps(content))
    assert_one_line_error(run_python("tools/hta_check.py", copy), f"{trace}: its distributedInfo names rank 0, not 1")
