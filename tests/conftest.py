"""Shared fixtures: synthetic data in the real on-disk layouts and real runs of train.py under torchrun.

Every end-to-end test runs the project's scripts as a user would (torchrun with two CPU ranks, gloo), on
small synthetic data, and asserts exact counts. The session-wide `lab_runs` trains both modes once and the
tests that only read artifacts share it (tests that change artifacts work on copies). verify.py and infer.py,
which most tests run many times, run in this process (run_in_process: the same code as `python verify.py`,
without 3 s of starting an interpreter and importing torch each time); a few tests run them as processes too.
"""

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import io
import json
import os
import runpy
import shutil
import struct
import subprocess
import sys
import traceback
import zlib
from pathlib import Path

import pytest
import torch.distributed as dist

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.experiment import MODES
from ddp_no_sync_lab.tasks import data
from tools import synthetic_data

# The suite is the CPU suite, in this process too (infer.py runs here): it means the same on a GPU machine.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
REPO = Path(__file__).resolve().parents[1]

INJECT = Path(__file__).resolve().parent / "inject"
WORKERS = Path(__file__).resolve().parent / "workers"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2"]

# The small experiment most tests share: 200 train-source images (160 train, 40 validation), 100 test, local
# batch 4, accum_steps 4, 2 epochs: 80 images and 20 micro-batches per rank and epoch, 5 windows. Its size
# keeps `make test` within 20 minutes on a 2-core CPU without BF16 instructions (float32: docs/tests.md).
SOURCE_IMAGES, TEST_IMAGES = 200, 100
SMALL_RUN = ["--epochs", "2", "--batch-size", "4", "--accum-steps", "4", "--device", "cpu"]
# A history row's fields that measure time: they differ between reruns that agree on everything else.
TIMING = {
    "comm_seconds",
    "sync_seconds",
    "sync_wait_seconds",
    "all_gather_seconds",
    "all_gather_wait_seconds",
    "epoch_seconds",
    "train_images_per_second",
    "validation_seconds",
    "run_id",
}


def subprocess_env(**variables):
    # gloo binds to loopback only: the tests talk to nothing beyond 127.0.0.1. The suite is the CPU suite:
    # its subprocesses see no GPU, so that it means the same on a machine with one (gpu_check.sh runs CUDA).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": "", **variables}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INJECT), env.get("PYTHONPATH")]))
    if not torchrun_allowed():  # a rank that a script of this test starts under torchrun stops at once (tests/inject)
        env["LAB_TEST_UNMARKED"] = f"{RUNNING['test'].nodeid} started a torchrun job: mark it @pytest.mark.torchrun"
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


def run_in_process(script, *args):
    """A project script run in this process as `python script args` runs it (runpy, as __main__): its
    stdout, stderr and exit code captured; an exception it lets escape becomes exit 1 and its traceback."""
    stdout, stderr, saved_argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = [str(REPO / script), *map(str, args)]
    code = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                runpy.run_path(str(REPO / script), run_name="__main__")
            except SystemExit as exit:  # as the interpreter ends: a number is the code, a message goes to stderr
                if isinstance(exit.code, int) or exit.code is None:
                    code = exit.code or 0
                else:
                    print(exit.code, file=sys.stderr)
                    code = 1
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved_argv
    return subprocess.CompletedProcess(sys.argv, code, stdout.getvalue(), stderr.getvalue())


@functools.cache
def injections():
    """tests/inject/sitecustomize.py as a module of this process (it injects nothing unless asked)."""
    spec = importlib.util.spec_from_file_location("lab_test_injections", INJECT / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def injected(**variables):
    """The injections that LAB_TEST_* `variables` ask for, in this process for the block (as a run's own in
    tests/workers/runs.py), put back after it. What the code under it caches stays cached (verify.py's recomputed
    packing): every in-process call with an injection must ask for the same one."""
    kept = len(injections().PATCHED)
    injections().inject(variables)
    try:
        yield
    finally:
        injections().undo(kept)


def verify(artifacts, *args):
    """verify.py --artifacts ARTIFACTS --expect-from-config, in this process."""
    return run_in_process("verify.py", "--artifacts", artifacts, "--expect-from-config", *args)


# The marker of every test that starts torchrun jobs of its own, through the helpers below or a benchmark:
# `make test-fast` leaves them out and keeps the tests that start none, or read the session's shared pair.
STARTS_TORCHRUN = "torchrun"
RUNNING = {"test": None, "shared pair": False}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{STARTS_TORCHRUN}: starts torchrun jobs of its own (make test-fast leaves it out)"
    )


# The files whose tests take longest, longest first (their CPU-seconds in the whole suite on the EPYC as AVX2,
# 2026-12-06: docs/tests.md; test_packed.py's include the module start and the workers' start, which it asks for
# first). pytest-xdist (--dist loadfile --no-loadscope-reorder) hands a worker the next file in this order as it
# runs out of tests, so that the long files start first and the two workers end together; the files not named
# follow in their own order.
LONGEST_FIRST = (
    "test_packed.py",  # 315
    "test_resume.py",  # 178
    "test_watch.py",  # 103
    "test_nodes.py",  # 69
    "test_checklist.py",  # 69
    "test_bench_network.py",  # 61 (and its waits)
    "test_watch_frameworks.py",  # 35 (and 8 s of waits)
    "test_bench_speed.py",  # 37
    "test_ddp_settings.py",  # 32
    "test_faults.py",  # 30
    "test_tools.py",  # 23
    "test_e2e.py",  # 21
    "test_sharded.py",  # 24
    "test_audit_holes.py",  # 18
    "test_checkpointing.py",  # 9
    "test_face.py",  # 10
    "test_verify.py",  # 7
)


def pytest_collection_modifyitems(items):
    order = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: each file's tests in its order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    RUNNING["test"] = item


def torchrun_allowed():
    """A torchrun start belongs to a test marked torchrun (its fixtures' starts too), or to the shared pair:
    the fast tier can then not grow a start unseen."""
    test = RUNNING["test"]
    return RUNNING["shared pair"] or test is None or test.get_closest_marker(STARTS_TORCHRUN)


def starting_torchrun():
    assert torchrun_allowed(), f"{RUNNING['test'].nodeid} starts torchrun: mark it @pytest.mark.{STARTS_TORCHRUN}"


def torchrun(script, *args, env=None, timeout=600, launcher=()):
    """script under torchrun (two ranks on this node), with torchrun's own `launcher` options."""
    starting_torchrun()
    return subprocess.run(
        [*TORCHRUN, *launcher, str(REPO / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or subprocess_env(),
        cwd=REPO,
    )


def start_train(*args, launcher=()):
    """train.py under torchrun, started and returned at once: in a session of its own (a test can signal the
    whole job), its output piped."""
    starting_torchrun()
    return subprocess.Popen(
        [*TORCHRUN, *launcher, str(REPO / "train.py"), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        cwd=REPO,
        start_new_session=True,
    )


def train(data_dir, output, mode, *extra, env=None, launcher=()):
    options = ["--mode", mode, "--output", output, "--data-dir", data_dir, *SMALL_RUN, *extra]
    return torchrun("train.py", *options, env=env, launcher=launcher)


RUNS_WORKER = WORKERS.relative_to(REPO) / "runs.py"
REFUSED = "REFUSED"  # a run of tests/workers/runs.py that must end in a start-up refusal


def runs_worker_arguments(logs, runs):
    """tests/workers/runs.py's command line for `runs` (each a list of train.py's options), LOGS made."""
    logs.mkdir(parents=True, exist_ok=True)
    return [logs, *(argument for run in runs for argument in ("--", *map(str, run)))]


def outputs_by_group(logs, groups):
    """The outputs of runs trained in one start as groups (name: its runs, in the start's order), by group."""
    outputs = iter(runs_outputs(logs, [run for runs in groups.values() for run in runs]))
    return {name: [next(outputs) for _ in runs] for name, runs in groups.items()}


def train_in_one_start(logs, *runs, env=None, timeout=600):
    """Several train.py runs (each a list of its options) in one torchrun start (tests/workers/runs.py): one
    start's cost for all. Returns each run's output as a finished process's: every rank's, rank 0's first."""
    assert_ok(torchrun(RUNS_WORKER, *runs_worker_arguments(logs, runs), env=env, timeout=timeout))
    return runs_outputs(logs, runs)


def runs_outputs(logs, runs):
    """Each run's output that tests/workers/runs.py kept in LOGS, as a process's that ended with status 0."""

    def output(number, stream):
        return "".join(path.read_text() for path in sorted(logs.glob(f"{number}.rank*.{stream}")))

    return [
        subprocess.CompletedProcess(run, 0, output(number, "stdout"), output(number, "stderr"))
        for number, run in enumerate(runs)
    ]


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


def assert_train_error(result, *fragments, store_may_go_first=False):
    """train.py under torchrun: one line from rank 0 holding every fragment, no traceback from a rank.

    torchrun itself exits 1 and appends its own failure report (with the launcher's traceback) after it. With
    store_may_go_first (a node of several): the node hosting the rendezvous store may end first, and this node's
    launcher then reports the store lost instead of its ranks' exit code, after its ranks stopped on the line.
    """
    assert result.returncode == 1, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    ours = [line for line in stderr_lines(result) if all(fragment in line for fragment in fragments)]
    assert len(ours) == 1, f"expected one line with {fragments}:\n{result.stderr}"
    store_lost = store_may_go_first and "RendezvousConnectionError" in result.stderr
    assert "exitcode  : 2" in result.stderr or store_lost, result.stderr  # the ranks stopped on the input error
    assert not [line for line in stderr_lines(result) if line.startswith("[rank")], result.stderr
    return ours[0]


def md5_sums(folder):
    return {path.name: hashlib.md5(path.read_bytes()).hexdigest() for path in Path(folder).iterdir()}


def png_header_only(path, width, height):
    """A PNG that declares width x height pixels; Pillow reads the size before any pixel."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b""))
    return path


def write_png_with_a_damaged_chunk(path):
    """A PNG whose image data is split over two IDAT chunks, the second's type damaged (b"ID#T"): Pillow opens it
    and raises SyntaxError ("broken PNG file") only as it decodes."""
    from PIL import Image

    encoded = io.BytesIO()
    Image.effect_noise((32, 32), 60).convert("RGB").save(encoded, format="PNG")
    content = encoded.getvalue()
    start = content.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", content[start : start + 4])
    payload = content[start + 8 : start + 8 + length]

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    half = len(payload) // 2
    damaged = chunk(b"IDAT", payload[:half]) + chunk(b"ID#T", payload[half:])
    Path(path).write_bytes(content[:start] + damaged + content[start + 12 + length :])


def copy_runs(artifacts, destination):
    shutil.copytree(artifacts, destination)
    return destination


def read_json(path):
    return json.loads(Path(path).read_text())


def made_once(tmp_path_factory, name, make):
    """The folder `name`, made by make(folder) once for the whole session, however many pytest-xdist workers
    run it: the first to ask makes it under a lock, the others wait for it there and read what it made (a
    make that failed fails them at once, with its error). Made, what several modules read is only read: a test
    that writes copies it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    folder, made, failed = root / name, root / f"{name}.made", root / f"{name}.failed"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.exists():
            pytest.fail(f"{name}, shared by the session's workers, could not be made: {failed.read_text()}")
        if not made.exists():
            try:
                folder.mkdir()
                make(folder)
            except BaseException as error:
                failed.write_text(f"{type(error).__name__}: {error}")
                raise
            made.touch()
    return folder


@pytest.fixture(scope="session")
def image_data(tmp_path_factory):
    """The shared experiment's images, their decode cache made with them (train.py reads it, never writes it)."""

    def write(folder):
        synthetic_data.write_dataset(folder / "images", "image-folders", SOURCE_IMAGES, TEST_IMAGES)
        data.prepare_data(folder / "images")

    return made_once(tmp_path_factory, "shared-data", write) / "images"


# The shared runs profile 2 windows of epoch 1 (micro-batches 8-15: window 1 skipped, window 2 the warm-up).
PROFILED = ["--profile-windows", "2"]


# A task of the user's own, outside the package (docs/architecture.md's recipe), found by train.py and verify.py
# on PYTHONPATH as a user's would be.
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
VECTOR_TASK = ["--task", "vector_task:VectorTask", "--device", "cpu", "--quiet"]


# train.py's single-node start-up refusals that the tests read from the shared start (each a run marked REFUSED in
# tests/workers/runs.py): its options after the shared experiment's (the last of an option counts), and its
# injections. That a refusal also ends train.py's job, in one line, is tested as a command (test_faults.py).
CLOSED_PORT_URL = "LAB_TEST_CIFAR_URL=http://127.0.0.1:9/cifar-10-python.tar.gz"
SHARED_REFUSALS = {
    "profile-windows": ([], lambda folder: ["--profile-windows", "4", "--quiet"]),
    "partial-window": ([], lambda folder: ["--batch-size", "12"]),  # 80 images per rank in micro-batches of 12: 7
    "cuda": ([], lambda folder: ["--device", "cuda"]),
    "download": ([CLOSED_PORT_URL], lambda folder: ["--data-dir", folder / "empty"]),  # a folder without data
}


# Three of DDP's levers at once, in a pair of the shared start (test_ddp_settings.py).
DDP_LEVERS = ["--comm-hook", "bf16", "--bucket-cap-mb", "0.5", "--no-broadcast-buffers"]


# The shared experiment's data in micro-batches of 12 with --partial-window scale, one epoch, at the bounds of
# --seed and --bucket-cap-mb (torch's own), every with --device auto and no_sync with cpu (test_faults.py).
PARTIAL_WINDOW_SCALE = ["--batch-size", "12", "--partial-window", "scale", "--epochs", "1", "--quiet"]
PARTIAL_WINDOW_SCALE += ["--seed", str(2**64 - 2), "--bucket-cap-mb", str(experiment.BUCKET_CAP_MB_LIMIT - 1)]
PARTIAL_WINDOW_DEVICES = {"every": "auto", "no_sync": "cpu"}


def shared_runs(folder, image_data):
    """The session's shared start, its runs by group: both modes of the shared experiment, profiled (PROFILED),
    every with progress lines and no_sync with --quiet; both modes of the vector task (tests/tasks/vector_task.py);
    both modes of the shared experiment with DDP_LEVERS; its no_sync with the PIL loader; both modes with
    PARTIAL_WINDOW_SCALE; then the refusals of SHARED_REFUSALS, each into its own output folder."""
    artifacts, common = folder / "artifacts", ["--data-dir", image_data, *SMALL_RUN, *PROFILED]
    plain = ["--data-dir", image_data, *SMALL_RUN, "--quiet"]
    return {
        "lab": [
            ["--mode", "every", "--output", artifacts / "every", *common, "--progress-every", "0"],
            ["--mode", "no_sync", "--output", artifacts / "no_sync", *common, "--quiet"],
        ],
        "vectors": [["--mode", mode, "--output", folder / "vectors" / mode, *VECTOR_TASK] for mode in MODES],
        "levers": [["--mode", mode, "--output", folder / "levers" / mode, *plain, *DDP_LEVERS] for mode in MODES],
        "pil": [["--mode", "no_sync", "--output", folder / "pil" / "no_sync", *plain, "--loader", "pil"]],
        "partial-window": [
            ["--mode", mode, "--output", folder / "partial-window" / mode, "--data-dir", image_data]
            + [*PARTIAL_WINDOW_SCALE, "--device", device]
            for mode, device in PARTIAL_WINDOW_DEVICES.items()
        ],
        "refused": [
            [REFUSED, *injections, "--mode", "every", "--output", folder / "refused" / name]
            + ["--data-dir", image_data, *SMALL_RUN, *options(folder)]
            for name, (injections, options) in SHARED_REFUSALS.items()
        ],
    }


def shared_start(tmp_path_factory, image_data):
    """The session's shared start's folder and its runs' outputs by group (shared_runs), made once, whichever
    pytest-xdist worker asks first."""

    def train_all(folder):
        RUNNING["shared pair"] = True
        try:
            env = subprocess_env()
            env["PYTHONPATH"] += f"{os.pathsep}{TASKS_DIR}"
            runs = [run for group in shared_runs(folder, image_data).values() for run in group]
            train_in_one_start(folder / "logs", *runs, env=env)
        finally:
            RUNNING["shared pair"] = False

    folder = made_once(tmp_path_factory, "shared-pair", train_all)
    groups = shared_runs(folder, image_data)
    return folder, outputs_by_group(folder / "logs", groups)


@pytest.fixture(scope="session")
def lab_runs(tmp_path_factory, image_data):
    """Both modes of the shared experiment, trained once for the session in its shared start. The reruns in
    test_e2e.py, unprofiled, must match them bit for bit."""
    folder, outputs = shared_start(tmp_path_factory, image_data)
    return folder / "artifacts", dict(zip(MODES, outputs["lab"]))


@pytest.fixture(scope="session")
def vector_runs(tmp_path_factory, image_data):
    """Both modes of the vector task, a task of the user's own, trained in the session's shared start."""
    folder, outputs = shared_start(tmp_path_factory, image_data)
    return folder / "vectors", dict(zip(MODES, outputs["vectors"]))


@pytest.fixture(scope="session")
def shared_refusals(tmp_path_factory, image_data):
    """SHARED_REFUSALS' runs in the session's shared start: their output folders' parent, and each one's stderr."""
    folder, outputs = shared_start(tmp_path_factory, image_data)
    return folder / "refused", {name: output.stderr for name, output in zip(SHARED_REFUSALS, outputs["refused"])}


@pytest.fixture(scope="session")
def levers_runs(tmp_path_factory, image_data):
    """Both modes of the shared experiment with DDP_LEVERS, trained in the session's shared start."""
    folder, _ = shared_start(tmp_path_factory, image_data)
    return folder / "levers"


@pytest.fixture(scope="session")
def partial_window_runs(tmp_path_factory, image_data):
    """Both modes with PARTIAL_WINDOW_SCALE, trained in the session's shared start: their folder, and each mode's
    output."""
    folder, outputs = shared_start(tmp_path_factory, image_data)
    return folder / "partial-window", dict(zip(MODES, outputs["partial-window"]))


@pytest.fixture(scope="session")
def pil_run(tmp_path_factory, image_data):
    """The shared experiment's no_sync with the PIL loader, trained in the session's shared start: its output
    folder, and the run's output."""
    folder, outputs = shared_start(tmp_path_factory, image_data)
    return folder / "pil" / "no_sync", outputs["pil"][0]


# The runs that test modules train in the session's module start, by module: each registered at import by
# module_runs (collection imports every module, in one order, in each pytest-xdist worker).
MODULE_RUNS = {}
MODULE_START_TIMEOUT = 1200  # against a hang: at least 5x the start's 210 s on the EPYC as AVX2


def pytest_collection_finish(session):
    """The module start trains the runs of the modules whose tests the session selected, no others (the same
    selection in every worker)."""
    selected = {item.module.__name__ for item in session.items}
    for name in [name for name, (runs, _) in MODULE_RUNS.items() if runs.__module__ not in selected]:
        del MODULE_RUNS[name]


def module_runs(name, prepare=None):
    """Registers a module's runs in the session's module start: the decorated function of (its folder, the
    shared images) returns its runs (train.py's options each, REFUSED and LAB_TEST_* words first where needed);
    prepare(folder), if given, first writes what they read."""

    def register(runs):
        MODULE_RUNS[name] = (runs, prepare)
        return runs

    return register


def module_start(tmp_path_factory, image_data, name):
    """The runs module_runs registered as `name`: their folder and each run's output. The session trains the runs
    of every module it selected (pytest_collection_finish) in one torchrun start, made once, whichever worker asks
    first: one start's cost for all. A module's folder is its own: its tests (one worker's, as --dist loadfile
    gives each file whole) may write there."""
    starting_torchrun()  # whoever made the start: a test reading it is marked

    def runs_by_module(folder):
        return {module: runs(folder / module, image_data) for module, (runs, _) in MODULE_RUNS.items()}

    def train_all(folder):
        for module, (_, prepare) in MODULE_RUNS.items():
            (folder / module).mkdir()
            if prepare:
                prepare(folder / module)
        runs = [run for runs in runs_by_module(folder).values() for run in runs]
        train_in_one_start(folder / "logs", *runs, timeout=MODULE_START_TIMEOUT)

    folder = made_once(tmp_path_factory, "module-runs", train_all)
    return folder / name, outputs_by_group(folder / "logs", runs_by_module(folder))[name]


# The worker scripts whose results tests read (test_equivalence.py, test_packed.py, test_comm_audit.py), run in one
# torchrun start for the session (tests/workers/several_workers.py).
SHARED_WORKERS = ("equivalence.py", "text_equivalence.py", "comm_audit.py")


@pytest.fixture(scope="session")
def worker_results(tmp_path_factory):
    """Each of SHARED_WORKERS' result by script: the JSON of rank 0's last line. Run once, whichever worker asks
    first."""
    starting_torchrun()  # whoever made the start: a test reading it is marked

    def run_all(folder):
        scripts = [WORKERS / script for script in SHARED_WORKERS]
        assert_ok(torchrun(WORKERS.relative_to(REPO) / "several_workers.py", folder, *scripts))

    folder = made_once(tmp_path_factory, "worker-results", run_all)
    return {
        script: json.loads((folder / f"{script}.rank0.stdout").read_text().strip().splitlines()[-1])
        for script in SHARED_WORKERS
    }


def assert_refused(stderr, *fragments):
    """A run of train.py refused at start-up (read from a REFUSED run's log): one line holding every fragment, the
    only error, no traceback."""
    lines = stderr.splitlines()
    ours = [line for line in lines if all(fragment in line for fragment in fragments)]
    assert len(ours) == 1, f"expected one line with {fragments}:\n{stderr[-3000:]}"
    assert len([line for line in lines if "error:" in line or "Error:" in line]) == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "no refusal" not in stderr, stderr[-3000:]
    return ours[0]


@pytest.fixture
def one_process_group(monkeypatch):
    """A gloo process group of this process alone (rank 0 of 1), for the audit's collectives in-process."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
