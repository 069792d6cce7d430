"""A task of the user's own, defined outside the package (tests/tasks/vector_task.py: a small MLP on synthetic vectors)
through the public protocol: train.py trains its pair by `--task vector_task:VectorTask` with its folder on
PYTHONPATH (in the session's shared start), and verify.py audits it against its own configuration, every
checklist item observed, finding the task by the name the runs recorded."""

import dataclasses
import hashlib
import json
import os
import shutil
import sys

import pytest
import torch

from conftest import TASKS_DIR, assert_one_line_error, read_json, run_in_process, run_python, subprocess_env, verify
from ddp_no_sync_lab import experiment
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
    assert f"A task of your own ({NAME}): item 10 is its own checks of its results (its `results`)." in lines
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


# Modules a user might name, each refused by find_task in one line (written into the test's folder).
NOT_TASK_MODULES = {
    "half_task.py": "class HalfTask:\n    name = 'half_task:HalfTask'\n",
    "misnamed.py": "from vector_task import VectorTask\n\n\nclass Misnamed(VectorTask):\n    pass\n",
    "misdocumented.py": "from vector_task import VectorTask\n\n\nclass Misdocumented(VectorTask):\n"
    "    name = 'misdocumented:Misdocumented'\n    documented = {'epochs': 0, 'batch_size': 4}\n",
    "broken_task.py": "raise RuntimeError('no data server configured')\n",
    "needs_dependency.py": "import not_installed_dependency\n",
}
REFUSALS = {
    "images": "task 'images' is neither the lab's (cifar10, text) nor MODULE:CLASS, a task of your own",
    "vector_task:": "task 'vector_task:' is neither the lab's (cifar10, text) nor MODULE:CLASS, a task of your own",
    "no_such_module:Task": "task no_such_module:Task: ModuleNotFoundError: No module named 'no_such_module'; put the "
    "folder that holds no_such_module.py on PYTHONPATH",
    "no_such.package:Task": "task no_such.package:Task: ModuleNotFoundError: No module named 'no_such'; put the "
    "folder that holds no_such/package.py on PYTHONPATH",
    "vector_task:Nope": "task vector_task:Nope: AttributeError: module 'vector_task' has no attribute 'Nope'",
    "half_task:HalfTask": "task half_task:HalfTask lacks documented, evaluate, prepare_data, load_source, source_place, "
    "make_split, build_loaders, build_model, criterion, window_plan, run_config, epoch_plan, write_results, results "
    "(ddp_no_sync_lab/tasks/registry.py's Task, TaskResults)",
    "misnamed:Misnamed": f"task misnamed:Misnamed calls itself '{NAME}': its name must be the MODULE:CLASS that finds "
    "it",
    "misdocumented:Misdocumented": "task misdocumented:Misdocumented: its documented epochs=0, partial_window=None: "
    "epochs and batch_size must be positive whole numbers, partial_window one of ('error', 'scale')",
    "broken_task:Task": "task broken_task:Task: RuntimeError: no data server configured",
    "needs_dependency:Task": "task needs_dependency:Task: ModuleNotFoundError: No module named "
    "'not_installed_dependency'",
}


@pytest.fixture
def not_tasks(task_on_path, tmp_path, monkeypatch):
    for name, source in NOT_TASK_MODULES.items():
        (tmp_path / name).write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in NOT_TASK_MODULES:
        sys.modules.pop(name.removesuffix(".py"), None)


def test_a_task_name_train_py_cannot_use_is_refused_in_one_line(not_tasks):
    """train.py's --task: the lab's names, or MODULE:CLASS with every member of Task and TaskResults, its own
    name and its documented options; whatever its module's code raises is said in one line, the PYTHONPATH remedy
    only where the module itself was not found."""
    refusals = {}
    for name in REFUSALS:
        with pytest.raises(LabError) as refused:
            registry.find_task(name)
        refusals[name] = str(refused.value)
    assert refusals == REFUSALS
    assert registry.find_task(NAME).name == NAME and registry.find_task("text") is registry.TASKS["text"]


def test_train_py_refuses_a_task_whose_module_fails_in_one_line_before_training(not_tasks):
    """The parser's refusal, as a user sees it: one line, exit 2, no traceback (under torchrun every node stops on
    it: launch.TorchrunArgumentParser)."""
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(not_tasks), str(TASKS_DIR), env["PYTHONPATH"]])
    result = run_python("train.py", "--task", "broken_task:Task", "--mode", "every", "--output", not_tasks, env=env)
    line = assert_one_line_error(result, "argument --task: task broken_task:Task: RuntimeError: no data server")
    assert line.startswith("train.py: error: ")


def test_the_strict_audit_refuses_a_task_of_your_own_naming_expect_from_config(vector_runs, task_on_path):
    result = run_in_process("verify.py", "--artifacts", vector_runs[0])
    assert_one_line_error(
        result,
        f"{vector_runs[0]}/every/run.json: the strict audit holds the lab's documented experiments (cifar10, text), "
        f"and these runs trained the task {NAME}: audit them with --expect-from-config",
        code=1,
    )


def test_the_tasks_own_checks_refuse_its_report_and_checkpoint_altered(vector_runs, task_on_path, tmp_path):
    """Item 10 for a task of your own: its `results` (VectorResults) read the report and checkpoint before the
    lab's checksums do."""
    runs = tmp_path / "vectors"
    shutil.copytree(vector_runs[0], runs)
    report = read_json(runs / "no_sync" / "report.json")
    (runs / "no_sync" / "report.json").write_text(json.dumps({**report, "model_test_accuracy": 0.99}))
    assert_one_line_error(verify(runs), f"{runs}/no_sync/report.json: accuracy not its matrix's", code=1)
    shutil.copy(vector_runs[0] / "no_sync" / "report.json", runs / "no_sync" / "report.json")
    checkpoint = torch.load(runs / "every" / "model.pt", weights_only=True)
    del checkpoint["model"]["2.bias"]
    torch.save(checkpoint, runs / "every" / "model.pt")
    line = assert_one_line_error(verify(runs), f"{runs}/every/model.pt: not this task's checkpoint", code=1)
    assert line.endswith('Missing key(s) in state_dict: "2.bias".)')


def test_verify_notes_a_copy_of_the_task_other_than_the_one_that_trained(
    vector_runs, task_on_path, tmp_path, monkeypatch
):
    """verify.py imports the task found first on its path: another copy than the one that trained is noted."""
    copy = tmp_path / "elsewhere" / "vector_task.py"
    copy.parent.mkdir()
    copy.write_text((TASKS_DIR / "vector_task.py").read_text() + "\n# another copy\n")
    monkeypatch.syspath_prepend(str(copy.parent))
    result = verify(vector_runs[0], "--pictures", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    trained_by = registry.code_sha256(TASKS_DIR / "vector_task.py")
    assert (
        f"note: the runs trained with another copy of {copy} (sha256 {trained_by}): its checks are this one's"
        in result.stdout.splitlines()
    )


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


def test_a_task_whose_window_plan_is_not_the_labs_is_refused_at_start_up(task_on_path):
    """verify.py holds a task of your own to experiment.epoch_plan: train.py refuses another plan before training
    (a loader giving one batch more, or divisors of the task's own), and lets the lab's through."""
    config = {"train_size": 160, "world_size": 2, "batch_size": 4, "accum_steps": 4, "partial_window": "error"}
    config["task"] = NAME
    labs = experiment.epoch_plan(config)  # 20 micro-batches in 5 windows of 4
    task = registry.find_task(NAME)
    registry.check_window_plan(task, labs, config)
    halved = [dataclasses.replace(step, loss_divisor=step.loss_divisor * 2) for step in labs]
    longer = experiment.window_plan(24, 4, "error")
    for plan, length in ((halved, 20), (longer, 24)):
        with pytest.raises(LabError) as refused:
            registry.check_window_plan(task, plan, config)
        assert str(refused.value).startswith(
            f"task {NAME}: its window plan ({length} micro-batches) is not the lab's (20, experiment.epoch_plan)"
        )
    registry.check_window_plan(registry.TASKS["text"], longer, config)  # the lab's tasks keep their own plans
