"""verify.py's checks of what each task decides, found by the task a run recorded (its config's "task"; the
document's runs record none): its model (the communication sizes come from its parameters), its documented
configuration, its results per run (report, checkpoint, pictures), and what it holds across the pair. The lab's
tasks' checks are here (tasks/registry.py's TaskResults); a task of your own (MODULE:CLASS) names its own as its
`results`."""

from pathlib import Path

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.checks import certify, facts, strict_audit
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.files import CONFUSION_FILE, MODEL_FILE, REPORT_FILE, RUN_RECORD_FILE, SAMPLE_FILE, AuditError
from ddp_no_sync_lab.tasks import language, registry
from model import IMAGE_SIZE, CifarCNN

__all__ = ["TASK_RESULTS", "task_results"]


class ImageResults:
    """The document's task: the report's confusion matrix (item 10), the model learned (strict), the checkpoint
    trained by every forward, the sample and the confusion matrix drawn by the run."""

    name = "cifar10"

    def model(self):
        return CifarCNN()

    def documented(self, config):
        return experiment.DOCUMENTED

    def prepare(self, artifacts: Path, config: dict, strict: bool):
        pass

    def check_run(self, folder: Path, mode: str, record: dict, strict: bool) -> dict:
        try:
            report = facts.check_report(folder / REPORT_FILE, mode, record)
        except AuditError as error:
            raise AuditError(f"{error}{certify.item(10)}", error.kind) from None
        if strict:  # the documented experiment's model learned
            strict_audit.check_learned(folder, report)
        training_forwards = len(experiment.epoch_plan(record["config"])) * record["config"]["epochs"]
        facts.check_model(folder / MODEL_FILE, mode, record, training_forwards)
        facts.check_png(folder / SAMPLE_FILE, record, size=(IMAGE_SIZE, IMAGE_SIZE))
        facts.check_png(folder / CONFUSION_FILE, record)
        return report

    def check_pair(self, artifacts: Path, config: dict, runs: dict, strict: bool):
        pass


class TextResults:
    """The text task (docs/packed.md): its packing made again here (refused in the strict audit where this Python
    or torch cannot), each report against it, the per-token normalization and the model learned (strict)."""

    name = "text"

    def __init__(self):
        self.packing = None

    def model(self):
        return language.ByteTransformer()

    def documented(self, config):
        # The text task's sizes follow from the corpus (held to its packing); its normalization is held once the
        # audit has measured what it did (strict_audit.check_token_normalization).
        return {**config, **experiment.TEXT_DOCUMENTED, "loss_normalization": config["loss_normalization"]}

    def prepare(self, artifacts: Path, config: dict, strict: bool):
        self.packing = certify.check_text_data(artifacts / "every" / RUN_RECORD_FILE, config, strict)

    def check_run(self, folder: Path, mode: str, record: dict, strict: bool) -> dict:
        report = language.check_report(folder / REPORT_FILE, mode, record)
        language.check_model(folder / MODEL_FILE, mode, record)
        return report

    def check_pair(self, artifacts: Path, config: dict, runs: dict, strict: bool):
        for mode, (_, report, _) in runs.items() if self.packing else ():  # the test's tokens and baseline
            language.check_report_against_packing(artifacts / mode / REPORT_FILE, report, self.packing)
        if strict:
            strict_audit.check_token_normalization(artifacts / "every" / RUN_RECORD_FILE, runs, config)
            for mode, (_, report, _) in runs.items():
                language.check_learned(artifacts / mode / REPORT_FILE, report)


TASK_RESULTS = {results.name: results for results in (ImageResults, TextResults)}


def task_results(config: dict, path: Path) -> registry.TaskResults:
    """The checks of the task the runs recorded, made for this audit (they keep what a pair's check needs): the
    lab's by name, a task of your own (MODULE:CLASS) by its `results`, imported as train.py imported it."""
    name = config.get("task")
    name = ImageResults.name if name is None else name  # the document's runs record no task
    if isinstance(name, str) and name in TASK_RESULTS:
        return TASK_RESULTS[name]()
    if not isinstance(name, str) or ":" not in name:
        raise AuditError(
            f"{path}: the runs' task {name!r} is none verify.py knows ({', '.join(TASK_RESULTS)}, or MODULE:CLASS); "
            f"audit them with the lab that made them"
        )
    try:
        task = registry.find_task(name)
    except LabError as error:
        raise AuditError(f"{path}: the runs' {error}") from None
    task_file = registry.task_file(task)
    trained_by = config.get("code", {}).get("task code sha256")
    if trained_by != registry.code_sha256(task_file):
        print(
            f"note: the runs trained with another copy of {task_file} (sha256 {trained_by}): its checks are this one's"
        )
    return task.results()
