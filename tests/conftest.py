"""Shared fixtures: synthetic data in the real on-disk layouts and real runs of train.py under torchrun.

Every end-to-end test runs the project's scripts as a user would (torchrun with two CPU ranks, gloo), on
small synthetic data, and asserts exact counts. The session-wide `lab_runs` trains both modes once and the
tests that only read artifacts share it (tests that change artifacts work on copies).
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools import synthetic_data

INJECT = Path(__file__).resolve().parent / "inject"
WORKERS = Path(__file__).resolve().parent / "workers"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2"]

# The small experiment most tests share: 1,000 train-source images (800 train, 200 validation), 200 test,
# local batch 10, accum_steps 4, 2 epochs: 400 images and 40 micro-batches per rank and epoch, 10 windows.
SOURCE_IMAGES, TEST_IMAGES = 1000, 200
SMALL_RUN = ["--epochs", "2", "--batch-size", "10", "--accum-steps", "4", "--device", "cpu"]
# A history row's fields that measure time: they differ between reruns that agree on everything else.
TIMING = {"comm_seconds", "epoch_seconds", "train_images_per_second", "validation_seconds", "run_id"}


def subprocess_env(**variables):
    # gloo binds to loopback only: the tests talk to nothing beyond 127.0.0.1. The suite is the CPU suite:
    # its subprocesses see no GPU, so that it means the same on a machine with one (gpu_check.sh runs CUDA).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": "", **variables}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INJECT), str(REPO), env.get("PYTHONPATH")]))
    return env


def run_python(script, *args, env=None, timeout=300, cwd=None):
    """A project script (or any script path) run by the test's Python, as a user would run it."""
    return subprocess.run(
        [sys.executable, str(REPO / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or subprocess_env(),
        cwd=cwd or REPO,
    )


def torchrun(script, *args, env=None, timeout=600):
    return subprocess.run(
        [*TORCHRUN, str(REPO / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or subprocess_env(),
        cwd=REPO,
    )


def train(data_dir, output, mode, *extra, env=None):
    return torchrun("train.py", "--mode", mode, "--output", output, "--data-dir", data_dir, *SMALL_RUN, *extra, env=env)


def assert_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def stderr_lines(result):
    return [line for line in result.stderr.splitlines() if line.strip()]


def assert_one_line_error(result, *fragments, code=2):
    """A script run directly: its exit code, one stderr line holding every fragment, no traceback."""
    assert result.returncode == code, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    ours = [line for line in stderr_lines(result) if all(fragment in line for fragment in fragments)]
    assert len(ours) == 1, f"expected one line with {fragments}:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    return ours[0]


def assert_train_error(result, *fragments):
    """train.py under torchrun: one line from rank 0 holding every fragment, no traceback from a rank.

    torchrun itself exits 1 and appends its own failure report (with the launcher's traceback) after it.
    """
    assert result.returncode == 1, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    ours = [line for line in stderr_lines(result) if all(fragment in line for fragment in fragments)]
    assert len(ours) == 1, f"expected one line with {fragments}:\n{result.stderr}"
    assert "exitcode  : 2" in result.stderr, result.stderr  # the ranks stopped on the input error (exit 2)
    assert not [line for line in stderr_lines(result) if line.startswith("[rank")], result.stderr
    return ours[0]


def md5_sums(folder):
    return {path.name: hashlib.md5(path.read_bytes()).hexdigest() for path in Path(folder).iterdir()}


def copy_runs(artifacts, destination):
    shutil.copytree(artifacts, destination)
    return destination


def read_json(path):
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="session")
def image_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data") / "images"
    synthetic_data.write_dataset(root, "image-folders", SOURCE_IMAGES, TEST_IMAGES)
    return root


# The shared runs profile 2 windows of epoch 1 (micro-batches 8-15: window 1 skipped, window 2 the warm-up).
PROFILED = ["--profile-windows", "2"]


@pytest.fixture(scope="session")
def lab_runs(tmp_path_factory, image_data):
    """Both modes trained once on the image-folder data, profiled (PROFILED): every with progress lines,
    no_sync with --quiet. The reruns in test_e2e.py, unprofiled, must match them bit for bit."""
    artifacts = tmp_path_factory.mktemp("runs") / "artifacts"
    results = {
        "every": assert_ok(train(image_data, artifacts / "every", "every", *PROFILED, "--progress-every", "0")),
        "no_sync": assert_ok(train(image_data, artifacts / "no_sync", "no_sync", *PROFILED, "--quiet")),
    }
    return artifacts, results
