"""A task of the user's own, defined outside the package (tests/tasks/vector_task.py: a small MLP on synthetic vectors)
through the public protocol: train.py trains its pair by `--task vector_task:VectorTask` with its folder on
PYTHONPATH (in the session's shared start), and verify.py audits it against its own configuration, every
checklist item observed, finding the task by the name the runs recorded."""

import hashlib
import shutil
import sys

import pytest

from conftest import TASKS_DIR, assert_one_line_error, read_json, verify
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.run import launch
from ddp_no_sync_lab.tasks import registry

NAME = "vector_task:VectorTask"
# The MLP 16-32-10: (16 x 32 + 32) + (32 x 10 + 10) float32 parameters, all in one bucket.
GRADIENT_BYTES = 874 * 4


@pytest.fixture
def task_on_path(monkeypatch):
    """The task's folder on this process's path, as PYTHONPATH puts it on a user's; found afresh, forgotten after."""
    monkeypatch.syspath_prepend(str(TASKS_DIR))
    registry.find_task.cache_clear()
    yield
    sys.modules.pop("vector_task", None)
    registry.find_task.cache_clear()


def test_the_task_of_your_own_records_its_name_and_its_codes_hash(vector_runs):
    artifacts, _ = vector_runs
    source = (TASKS_DIR / "vector_task.py").read_bytes()
    for mode in ("every", "no_sync"):
        config = read_json(artifacts / mode / "run.json")["config"]
        assert config["task"] == NAME and config["model"] == "MLP 16-32-10" and config["augmentation"] == "none"
        assert (config["train_size"], config["validation_size"], config["test_size"]) == (160, 40, 100)
        assert (config["epochs"], config["batch_size"], config["partial_window"]) == (2, 4, "error")  # its defaults
        assert config["data_layout"] == "synthetic vectors" and config["data_synthetic"] is True
        assert config["code"]["task code sha256"] == hashlib.sha256(source).hexdigest()[:16]


def test_the_task_of_your_own_trains_with_the_labs_counts(vector_runs):
    """80 vectors per rank and epoch in micro-batches of 4: 20 micro-batches, 5 windows of 4; the MLP has no
    buffers, so DDP broadcasts none."""
    artifacts, _ = vector_runs
    for mode, syncs in (("every", 20), ("no_sync", 5)):
        history = read_json(artifacts / mode / "history.json")
        assert [row["epoch"] for row in history] == [1, 2]
        for row in history:
            assert row["optimizer_steps"] == 5 and row["gradient_syncs"] == row["sync_bucket_calls"] == syncs
            assert row["allreduce_bytes"] == syncs * GRADIENT_BYTES
            assert row["buffer_broadcast_collectives"] == row["broadcast_bytes"] == 0
            assert row["gradient_sync_positions"] == ([[0, 20, 1]] if mode == "every" else [[3, 20, 4]])
            assert row["optimizer_step_positions"] == [[3, 20, 4]]
        report = read_json(artifacts / mode / "report.json")
        assert report["task"] == NAME and sum(map(sum, report["confusion_matrix"])) == 100


def test_verify_finds_the_task_by_its_recorded_name_and_passes_every_checklist_item(
    vector_runs, task_on_path, tmp_path
):
    artifacts, _ = vector_runs
    result = verify(artifacts, "--pictures", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("| every | 5 | 20 | ") for line in lines), lines
    assert any(line.startswith("| no_sync | 5 | 5 | ") for line in lines), lines
    checklist = [line for line in lines if line.startswith(tuple(f"| {number} | " for number in range(1, 11)))]
    assert len(checklist) == 10 and all("| ✓ | ✓ |" in line for line in checklist), checklist
    assert lines[-1] == "AUDIT PASSED: no_sync reduced gradient synchronizations by 4x"


def test_verify_refuses_in_one_line_a_task_it_cannot_import(vector_runs, tmp_path):
    """Without the task's folder on the path, verify.py says so and how: never a traceback."""
    registry.find_task.cache_clear()
    runs = tmp_path / "vectors"
    shutil.copytree(vector_runs[0], runs)
    result = verify(runs, "--pictures", tmp_path)
    assert_one_line_error(
        result,
        f"{runs}/every/run.json: the runs' task {NAME}: ModuleNotFoundError: No module named 'vector_task'; put the "
        "folder that holds vector_task.py on PYTHONPATH",
        code=1,
    )


NOT_TASKS = [
    "images",
    "vector_task:",
    "no_such_module:Task",
    "vector_task:Nope",
    "half_task:HalfTask",
    "misnamed:Misnamed",
]


def test_a_task_name_train_py_cannot_use_is_refused_in_one_line(task_on_path, tmp_path):
    """train.py's --task: the lab's names, or MODULE:CLASS with every Task member and its own name."""
    (tmp_path / "half_task.py").write_text("class HalfTask:\n    name = 'half_task:HalfTask'\n")
    (tmp_path / "misnamed.py").write_text(
        "from vector_task import VectorTask\n\nclass Misnamed(VectorTask):\n    pass\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        refusals = {}
        for name in NOT_TASKS:
            with pytest.raises(LabError) as refused:
                registry.find_task(name)
            refusals[name] = str(refused.value)
    finally:
        sys.path.remove(str(tmp_path))
        for module in ("half_task", "misnamed"):
            sys.modules.pop(module, None)
    assert refusals == {
        "images": "task 'images' is neither the lab's (cifar10, text) nor MODULE:CLASS, a task of your own",
        "vector_task:": "task 'vector_task:' is neither the lab's (cifar10, text) nor MODULE:CLASS, a task of your own",
        "no_such_module:Task": "task no_such_module:Task: ModuleNotFoundError: No module named 'no_such_module'; put "
        "the folder that holds no_such_module.py on PYTHONPATH",
        "vector_task:Nope": "task vector_task:Nope: AttributeError: module 'vector_task' has no attribute 'Nope'; put "
        "the folder that holds vector_task.py on PYTHONPATH",
        "half_task:HalfTask": "task half_task:HalfTask lacks the Task members documented, evaluate, prepare_data, "
        "load_source, source_place, make_split, build_loaders, build_model, criterion, window_plan, run_config, "
        "epoch_plan, write_results (ddp_no_sync_lab/tasks/registry.py)",
        "misnamed:Misnamed": f"task misnamed:Misnamed calls itself '{NAME}': its name must be the MODULE:CLASS that "
        "finds it",
    }
    assert registry.find_task(NAME).name == NAME and registry.find_task("text") is registry.TASKS["text"]


def test_the_nodes_code_covers_a_task_of_your_own_byte_for_byte(task_on_path, tmp_path):
    """launch.code_and_versions, which every node compares with rank 0's: a task's file outside the package
    adds its own hash, so nodes running two copies of it that differ stop with one line."""
    copy = tmp_path / "vector_task.py"
    shutil.copy(TASKS_DIR / "vector_task.py", copy)
    task_file = registry.task_file(registry.find_task(NAME))
    assert task_file == TASKS_DIR / "vector_task.py" and registry.task_file(registry.TASKS["cifar10"]) is None
    ours, theirs = launch.code_and_versions(task_file), launch.code_and_versions(copy)
    assert ours == theirs and "task code sha256" not in launch.code_and_versions()
    copy.write_text(copy.read_text() + "\n# another copy\n")
    changed = launch.code_and_versions(copy)
    assert changed["task code sha256"] != ours["task code sha256"] and changed["code sha256"] == ours["code sha256"]
