"""The helper commands: the environment check, the synthetic data writer and `make clean`."""

import importlib.util
import json
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO, assert_one_line_error, run_python
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.precision import choose_precision
from ddp_no_sync_lab.run import launch
from model import CLASSES


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
    for made in ("artifacts/every", "data/train", ".venv/bin", "__pycache__", "ddp_no_sync_lab/run/__pycache__"):
        (lab_copy / made).mkdir(parents=True)
    (tmp_path / "artifacts").mkdir()  # someone else's folder beside the lab
    result = subprocess.run(["make", "-C", str(lab_copy), "clean"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for made in ("artifacts", "data", ".venv", "__pycache__", "ddp_no_sync_lab/run/__pycache__"):
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


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_jpeg_copy_is_made_from_the_official_archive_and_its_quality_read_back(tmp_path):
    jpeg_copy, synthetic = load_tool("jpeg_copy"), load_tool("synthetic_data")
    (train_images, train_labels), (test_images, test_labels) = synthetic.write_dataset(
        tmp_path / "src", "torchvision", 60, 30
    )
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:  # the official archive's layout: cifar-10-batches-py/<batch>
        tar.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    assert jpeg_copy.write_copy(archive, tmp_path / "copy", jpeg_copy.QUALITY) == {"train": 60, "test": 30}
    for split, images, labels in (("train", train_images, train_labels), ("test", test_images, test_labels)):
        for label, name in enumerate(CLASSES):
            files = sorted((tmp_path / "copy" / split / name).iterdir())
            originals = images[[i for i, each in enumerate(labels) if each == label]]
            assert [path.name for path in files] == [f"{n:04d}.jpg" for n in range(len(originals))]
            decoded = np.stack([np.asarray(Image.open(path)) for path in files]).astype(int)
            distance = np.abs(decoded[:, None] - originals[None].astype(int)).mean(axis=(2, 3, 4))
            assert distance.min() > 0  # lossy, and each file nearest its own image: the same image in its place
            assert distance.argmin(axis=1).tolist() == list(range(len(originals)))
    assert jpeg_copy.read_quality(tmp_path / "copy") == {75: 90}
    # From the unpacked folder, at another quality; the synthetic marker travels with the copy.
    jpeg_copy.write_copy(tmp_path / "src" / "cifar-10-batches-py", tmp_path / "copy90", 90)
    assert jpeg_copy.read_quality(tmp_path / "copy90") == {90: 90}
    assert (tmp_path / "copy90" / "synthetic.json").is_file() and not (tmp_path / "copy").joinpath(
        "synthetic.json"
    ).exists()
    reencoded = tmp_path / "copy90/test/cat/0000.jpg"  # tables of no Pillow quality
    Image.open(reencoded).save(reencoded, qtables=[[3] * 64, [5] * 64])
    assert jpeg_copy.read_quality(tmp_path / "copy90") == {90: 89, None: 1}
    result = run_python("tools/jpeg_copy.py", "--read-quality", tmp_path / "copy")
    assert result.returncode == 0 and result.stdout == "90 files at quality 75\n", result.stderr
    assert_one_line_error(
        run_python("tools/jpeg_copy.py", "--source", tmp_path, "--out", tmp_path / "copy"), "already exists; remove it"
    )
    # A download cut short, and a PNG under a .jpg name: one line each, no traceback.
    cut = tmp_path / "cut" / "cifar-10-python.tar.gz"
    cut.parent.mkdir()
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    assert_one_line_error(
        run_python("tools/jpeg_copy.py", "--source", cut, "--out", tmp_path / "none"), "download the archive again"
    )
    assert not (tmp_path / "none").exists()
    Image.open(reencoded).save(tmp_path / "copy90/test/cat/0001.jpg", format="PNG")
    assert_one_line_error(
        run_python("tools/jpeg_copy.py", "--read-quality", tmp_path / "copy90"),
        "0001.jpg: not a readable JPEG (a PNG file)",
    )
