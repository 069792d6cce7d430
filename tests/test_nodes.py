"""train.py started as two nodes, as two machines would start it: two torchrun launchers (--nnodes=2, one
process each, c10d rendezvous on 127.0.0.1), each in its own working folder with its own copy of the data.

A two-node run computes exactly what the one-node run of the same configuration computes; a node whose
data or options differ, or that cannot get the data, stops both nodes within seconds with one line naming it.
"""

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest
import torch

from conftest import (
    CLOSED_PORT_URL,
    MODES,
    PROFILED,
    REFUSED,
    REPO,
    RUNS_WORKER,
    SMALL_RUN,
    TIMING,
    assert_ok,
    assert_train_error,
    injected,
    read_json,
    runs_worker_arguments,
    starting_torchrun,
    subprocess_env,
    verify,
)
from ddp_no_sync_lab.run import launch
from test_faults import rank_pid
from tools import loopback

NODE_FAILURE_SECONDS = 60


def start_nodes(
    folders, *node_args, env=None, node_env=({}, {}), checkouts=(REPO, REPO), restarts=0, script="train.py"
):
    """train.py (or another script of the checkout) on two nodes, node r started in folders[r] with node_args[r],
    node_env[r] added to env, from checkouts[r] (the lab's own by default); torchrun restarts failed workers
    `restarts` times."""
    starting_torchrun()
    port = loopback.free_loopback_port()
    env = env or subprocess_env()
    launchers = []
    for node, (folder, args, own_env, checkout) in enumerate(zip(folders, node_args, node_env, checkouts)):
        command = loopback.loopback_node_command(node, 2, port, [checkout / script, *args], restarts)
        # One core per node, as torchrun itself sets for several processes on one machine.
        node_variables = {**env, "OMP_NUM_THREADS": "1", **own_env}
        launchers.append(
            subprocess.Popen(
                command, cwd=folder, env=node_variables, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return launchers


def finish(launchers, timeout=300):
    """Both launchers' results, and the seconds from now until each ended."""
    results, seconds = [], []
    started = time.monotonic()
    try:
        for launcher in launchers:
            stdout, stderr = launcher.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr))
            seconds.append(time.monotonic() - started)
    finally:
        for launcher in launchers:
            launcher.kill()
    return results, seconds


def two_nodes(folders, *node_args, env=None, node_env=({}, {}), checkouts=(REPO, REPO)):
    return finish(start_nodes(folders, *node_args, env=env, node_env=node_env, checkouts=checkouts))


def two_nodes_in_one_start(folders, logs, node_runs, node_env=({}, {})):
    """Several train.py runs in one two-node start (tests/workers/runs.py, as conftest.train_in_one_start on one
    node): node_runs[r] is node r's runs (each a list of its options), as many on each node. Returns each run's
    stderr on each node: [node][run]."""
    node_args = [runs_worker_arguments(logs, runs) for runs in node_runs]
    results, _ = finish(start_nodes(folders, *node_args, node_env=node_env, script=RUNS_WORKER))
    for result in results:
        assert_ok(result)
    count = len(node_runs[0])
    return [[(logs / f"{number}.rank{node}.stderr").read_text() for number in range(count)] for node in (0, 1)]


def node_folders(tmp_path, image_data):
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        shutil.copytree(image_data, folder / "data")
    return folders


def same_run(mode, extra=()):
    args = ["--mode", mode, "--output", f"artifacts/{mode}", "--data-dir", "data", *SMALL_RUN, "--quiet", *extra]
    return args, args


@pytest.fixture(scope="module")
def node_start(tmp_path_factory, image_data):
    """One two-node start: both modes, profiled as the one-node runs; a run on one data folder both nodes share,
    without its decode cache, each decode counted in decodes.log; both modes for one epoch in threads/, node 1's
    on 2 threads; then NODE_REFUSALS' runs, one after the other. Each node's folder and its stderr of each run:
    [node][run]."""
    root = tmp_path_factory.mktemp("nodes")
    node0, node1 = node_folders(root, image_data)
    for folder in (node0, node1):
        shutil.copytree(image_data, folder / "differing")
    cat = sorted((node1 / "differing" / "train" / "cat").iterdir())[0]
    shutil.copy(sorted((node1 / "differing" / "train" / "dog").iterdir())[0], cat)
    shutil.copytree(image_data, node0 / "absent")
    shutil.copytree(image_data, root / "shared-data", ignore=shutil.ignore_patterns(".decoded*"))
    shared_data, _ = same_run("every", ["--data-dir", str(root / "shared-data"), "--epochs", "1"])
    shared_data[shared_data.index("--output") + 1] = "artifacts/shared-data"
    shared_data.append(f"LAB_TEST_COUNT_DECODES={root / 'decodes.log'}")
    pair = [same_run(mode, PROFILED)[0] for mode in MODES]
    threads = [same_run(mode, ["--epochs", "1", "--output", f"threads/{mode}"])[0] for mode in MODES]
    runs = [[*pair, shared_data, *threads], [*pair, shared_data, *(["LAB_TEST_THREADS=2", *run] for run in threads)]]
    for name, (node0_words, node1_words, both, _) in NODE_REFUSALS.items():
        args, _ = same_run("every", both)
        args[args.index("--output") + 1] = f"artifacts/{name.replace(' ', '-')}"
        runs[0].append([REFUSED, *args, *node0_words])  # a node's own words last: the last of an option counts
        runs[1].append([REFUSED, *args, *node1_words])
    return [node0, node1], two_nodes_in_one_start([node0, node1], root / "logs", runs)


@pytest.fixture(scope="module")
def two_node_runs(node_start):
    """Both modes on two nodes, from the module's two-node start; each node's stderr of each mode."""
    folders, stderr = node_start
    return folders, [dict(zip(MODES, node_stderr)) for node_stderr in stderr]


@pytest.mark.torchrun
def test_two_nodes_compute_exactly_what_one_node_computes(two_node_runs, lab_runs):
    (node0, node1), node_stderr = two_node_runs
    artifacts, _ = lab_runs
    for mode in ("every", "no_sync"):
        one_node = read_json(artifacts / mode / "history.json")
        two_nodes_history = read_json(node0 / "artifacts" / mode / "history.json")
        assert [{k: v for k, v in row.items() if k not in TIMING} for row in two_nodes_history] == [
            {k: v for k, v in row.items() if k not in TIMING} for row in one_node
        ]
        one_config = read_json(artifacts / mode / "run.json")["config"]
        two_config = read_json(node0 / "artifacts" / mode / "run.json")["config"]
        assert (one_config.pop("nodes"), two_config.pop("nodes")) == (1, 2)
        assert one_config == two_config
        weights = [
            torch.load(folder / mode / "model.pt", weights_only=True)["model"]
            for folder in (artifacts, node0 / "artifacts")
        ]
        assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    # Only rank 0 writes: node 1's working folder holds nothing but its data folders (the refusals' too), and node 1
    # says where they are.
    assert not [path.name for path in node1.iterdir() if path.name not in ("data", "differing", "absent")]
    for node, stderr in enumerate(node_stderr):
        assert (
            f"node {node} of 2; rank 0 writes the artifacts on {socket.gethostname()} into {node0}/artifacts/every"
            in stderr["every"]
        )


@pytest.mark.torchrun
def test_verify_passes_on_a_two_node_pair(two_node_runs):
    (node0, _), _ = two_node_runs
    result = verify(node0 / "artifacts")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "AUDIT PASSED: no_sync reduced gradient synchronizations by 4x"
    # The profiler's witness of both nodes' ranks, gathered by rank 0 on node 0.
    for rank in (0, 1):
        assert any(
            line.startswith(f"| every | 8-15 | {rank} | 12 | 8 + 2 x 2 | 16 | 16 | ")
            for line in result.stdout.splitlines()
        )
        assert any(
            line.startswith(f"| no_sync | 8-15 | {rank} | 6 | 2 + 2 x 2 | 4 | 4 | ")
            for line in result.stdout.splitlines()
        )


def assert_both_nodes_stop(results, seconds, *fragments):
    for node, (result, took) in enumerate(zip(results, seconds)):
        assert took < NODE_FAILURE_SECONDS, f"node {node} took {took:.0f} s to stop"
        assert_train_error(result, *fragments, store_may_go_first=True)


# Each way the nodes can disagree at start-up, as node 0's and node 1's runs of train.py (their options, data
# folder and test-only injections), and the line both nodes must stop on. All in the module's two-node start, after
# its pair and its shared-folder run (tests/workers/runs.py, each run REFUSED); that a refusal also ends both launchers within a minute is
# tested as a command: an option one node cannot parse (train.main agrees on it after the process group is made,
# before the runs worker's steps), a node running other code, a killed rank.
NODE_REFUSALS = {
    "data": (
        [],
        [],
        ["--data-dir", "differing"],  # node 1's copy has one image of another class
        "train.py: error: [rank 1, node 1] its data in differing/ differ from rank 0's: fingerprint of images and "
        "labels",
    ),
    "no data": (
        [CLOSED_PORT_URL],
        [CLOSED_PORT_URL],
        ["--data-dir", "absent"],  # node 1 has none and cannot download it
        "train.py: error: [rank 1, node 1] CIFAR-10 could not be downloaded into absent/",
    ),
    "world size": ([], ["--expected-world-size", "4"], [], "ValueError: [rank 1, node 1] expected world_size=4, got 2"),
    "devices": (
        ["LAB_TEST_FAKE_GPUS=1:1"],  # node 1 sees a GPU for its one process (faked: CI has none), node 0 none
        ["LAB_TEST_FAKE_GPUS=1:1"],
        ["--device", "auto"],  # the last --device counts
        "[rank 1, node 1] its device differs from rank 0's: device cuda vs cpu; give every node one GPU per process",
    ),
    "torch": (
        ["LAB_TEST_NODE_TORCH_VERSION=1:2.7.0"],
        ["LAB_TEST_NODE_TORCH_VERSION=1:2.7.0"],
        [],
        f"[rank 1, node 1] its code or versions differ from rank 0's: torch 2.7.0 vs {torch.__version__}",
    ),
    "options": (
        [],
        ["--mode", "no_sync"],
        [],
        "[rank 1, node 1] its train.py options differ from rank 0's: --mode no_sync vs every",
    ),
    "precision": (  # node 1 decides as a CPU without BF16 instructions, node 0 as one with them
        ["LAB_TEST_CPU_BF16=1"],
        ["LAB_TEST_CPU_BF16=0"],
        [],
        (
            "[rank 1, node 1] its precision differs from rank 0's: fp32 on a CPU",
            "vs bf16 on a CPU",
            "pass the same --precision on every node",
        ),
    ),
}


@pytest.fixture(scope="module")
def node_refusals(node_start):
    """NODE_REFUSALS' runs, from the module's two-node start: node 0's folder, and each node's stderr of each."""
    (node0, _), stderr = node_start
    return node0, {
        name: [stderr[node][number - len(NODE_REFUSALS)] for node in (0, 1)]
        for number, name in enumerate(NODE_REFUSALS)
    }


@pytest.mark.torchrun
@pytest.mark.parametrize("refusal", NODE_REFUSALS)
def test_nodes_that_disagree_at_start_up_both_stop_on_one_line_naming_the_node(node_refusals, refusal):
    """Data, a node without data that cannot download it, the world size, devices, another torch, options that
    differ, CPUs that would choose another precision: every rank raises at the same check, and each node says it
    in one line."""
    node0, stderr = node_refusals
    line = NODE_REFUSALS[refusal][3]
    fragments = line if isinstance(line, tuple) else (line,)
    for node, text in enumerate(stderr[refusal]):
        ours = [row for row in text.splitlines() if all(fragment in row for fragment in fragments)]
        assert len(ours) == 1, f"node {node}:\n{text[-3000:]}"
        assert "Traceback" not in text and "no refusal" not in text, text[-3000:]
        assert len([row for row in text.splitlines() if "error:" in row or "Error:" in row]) == 1, text[-3000:]
    if refusal == "data":  # its output was checked and claimed (its lock file), nothing was written
        claimed = [
            path.name
            for path in (node0 / "artifacts").iterdir()
            if path.name.split(".")[:2] in (["data"], ["", "data"])
        ]
        assert claimed == [".data.lock"]


@pytest.mark.torchrun
def test_nodes_sharing_one_data_folder_decode_it_once(node_start):
    """Two nodes, one data folder (a shared filesystem), no cache yet: one node decodes while the other waits
    for it, and both train on the one cache (the run ended, or the start would have failed)."""
    (node0, _), _ = node_start
    shared = node0.parent / "shared-data"
    assert len((node0.parent / "decodes.log").read_text().splitlines()) == 1
    assert len(list(shared.glob(".decoded-*.npz"))) == 1 and not list(shared.glob(".*tmp-*"))


@pytest.mark.torchrun
def test_an_option_that_one_node_cannot_parse_stops_both(tmp_path, image_data):
    """train.main makes the process group before it stops on a usage error, so that every node learns of it."""
    node0, node1 = node_folders(tmp_path, image_data)
    good, _ = same_run("every")
    results, seconds = two_nodes([node0, node1], good, [*good, "--epochs", "0"])
    assert_both_nodes_stop(
        results,
        seconds,
        "train.py: error: [rank 1, node 1] argument --epochs: must be at least 1, got 0 (see: python train.py --help)",
    )


@pytest.mark.torchrun
def test_a_rank_killed_on_one_node_ends_the_other_node_quickly(tmp_path, image_data):
    node0, node1 = node_folders(tmp_path, image_data)
    args, _ = same_run("every", ["--epochs", "50"])
    args = [arg for arg in args if arg != "--quiet"] + ["--progress-every", "0"]
    launchers = start_nodes([node0, node1], args, args)
    for line in launchers[0].stderr:  # wait until training is under way
        if "train:" in line:
            break
    os.kill(rank_pid(launchers[1].pid, 1), signal.SIGKILL)
    results, seconds = finish(launchers, timeout=120)
    assert max(seconds) < NODE_FAILURE_SECONDS, seconds
    assert [result.returncode for result in results] == [1, 1]
    assert "Signal 9 (SIGKILL)" in results[1].stderr  # node 1's torchrun names its killed rank
    assert "Connection closed by peer" in results[0].stderr or "Connection reset by peer" in results[0].stderr, results[
        0
    ].stderr[-3000:]


@pytest.mark.torchrun
def test_nodes_with_different_thread_counts_pass_the_audit(node_start):
    """One process per node leaves the thread count to the node: 1 here, 2 there (the module start's threads/
    runs). Their sums differ in the last bits; the step fingerprints (exact integer sums of the values' bits) do
    not, and verify.py passes both modes (one epoch each: every step is compared)."""
    (node0, _), stderr = node_start
    for node, node_stderr in enumerate(stderr):  # runs 3 and 4 of the start: the threads/ pair
        assert ["LAB_TEST_THREADS: 2 intra-op threads" in text for text in node_stderr[3:5]] == [node == 1] * 2
    result = verify(node0 / "threads")
    assert result.returncode == 0, result.stdout + result.stderr
    for mode in ("every", "no_sync"):
        rows = read_json(node0 / "threads" / mode / "history.json")
        assert [row["steps_with_ranks_agreed"] for row in rows] == [row["optimizer_steps"] for row in rows]


def test_a_runs_own_thread_count_is_put_back_after_it():
    """LAB_TEST_THREADS (node 1's thread count in the module start's threads/ runs) holds for its run alone."""
    before = torch.get_num_threads()
    with injected(LAB_TEST_THREADS=str(before + 1)):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before


def test_the_code_every_node_must_share_is_every_python_file_of_the_package_in_its_subfolders_too(
    tmp_path, monkeypatch
):
    """The hash a node compares covers train.py, model.py and each Python file beneath the package, at any depth:
    this checkout's own, then a made-up tree's."""
    package_files = sorted((REPO / "ddp_no_sync_lab").rglob("*.py"))
    assert [path.relative_to(REPO).as_posix() for path in package_files if path.parent.name == "run"] == [
        "ddp_no_sync_lab/run/__init__.py",
        "ddp_no_sync_lab/run/launch.py",
        "ddp_no_sync_lab/run/records.py",
        "ddp_no_sync_lab/run/resume.py",
    ]
    assert launch.hashed_code() == [REPO / "train.py", REPO / "model.py", *package_files]
    package = tmp_path / "package"
    hashed = ["train.py", "model.py", "package/__init__.py", "package/cli.py", "package/tasks/__init__.py"]
    hashed.append("package/tasks/image.py")
    for name in [*hashed, "package/tasks/notes.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    monkeypatch.setattr(launch, "LAB_ROOT", tmp_path)
    monkeypatch.setattr(launch, "PACKAGE_ROOT", package)
    assert [path.relative_to(tmp_path).as_posix() for path in launch.hashed_code()] == hashed
    before = launch.code_and_versions()["code sha256"]
    with open(package / "tasks" / "image.py", "a") as source:
        source.write("# an edit in a subfolder\n")
    assert launch.code_and_versions()["code sha256"] != before


@pytest.mark.torchrun
def test_a_node_running_other_code_stops_both(tmp_path, image_data):
    """Node 1 runs a stale checkout: its ddp_no_sync_lab/audit/instruments.py differs by one comment."""
    node0, node1 = node_folders(tmp_path, image_data)
    stale = tmp_path / "stale-checkout"
    shutil.copytree(
        REPO, stale, ignore=shutil.ignore_patterns(".git", ".venv*", "artifacts", "data", "__pycache__", "tests")
    )
    with open(stale / "ddp_no_sync_lab" / "audit" / "instruments.py", "a") as source:
        source.write("# an edit this node alone has\n")
    results, seconds = two_nodes([node0, node1], *same_run("every"), checkouts=(REPO, stale))
    assert_both_nodes_stop(
        results,
        seconds,
        "[rank 1, node 1] its code or versions differ from rank 0's: code sha256",
        "run one checkout of the lab",
    )
