"""The strict audit (verify.py without --expect-from-config): the runs are the documented experiment key by key
(platform choices printed, not compared), on real data, and learned; the text task's per-token normalization, or
the bias its runs' tokens measured."""

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.audit import scale
from ddp_no_sync_lab.files import REPORT_FILE, RUN_RECORD_FILE, AuditError, check

# What verify.py prints beside the documented keys: where and how the runs ran, not what they computed.
PLATFORM_CHOICES = ("device", "backend", "precision", "loader", "activation_checkpointing", "nodes")


def check_documented(path, config):
    """The strict audit: the run is the document's experiment (or the text task's documented one), key by key
    (the first that differs is named); platform choices are printed by verify.py, not compared. The text task's
    normalization is held after the audit, by check_token_normalization, which names the bias it measured."""
    for key, value in experiment.documented(config.get("task")).items():
        if config.get(key) != value and key != "loss_normalization":
            raise AuditError(
                f"{path}: config {key}={config.get(key)!r} is not the documented experiment's {value!r}: run the "
                f"documented experiment, or audit these runs against their own configuration with --expect-from-config"
            )


def check_token_normalization(path, runs, config):
    """The strict audit of the text task: per-token normalization, or a refusal naming how unequally the run's
    tokens weighed (the loss-scale witness's divisors against the windows' tokens)."""
    if config["loss_normalization"] != experiment.TEXT_DOCUMENTED["loss_normalization"]:
        weights = [
            weight for history, _, _ in runs.values() for row in history for weight in scale.token_weights(row, config)
        ]
        measured = (
            f"the runs' tokens weighed {min(weights):.3f}x to {max(weights):.3f}x their share of their window's update "
            f"(measured at each loss)"
        )
        if min(weights) == max(weights) == 1:  # no window of these runs held micro-batches of unequal tokens
            measured = "it weighs tokens unequally wherever a window's micro-batches hold unequal numbers of them"
        raise AuditError(
            f"{path}: config loss_normalization={config['loss_normalization']!r}: {measured}; the documented text task "
            f"normalizes by tokens: rerun with --loss-normalization tokens, or audit these runs against their own "
            f"configuration with --expect-from-config"
        )


def check_labs_task(path, config):
    """The strict audit holds the lab's documented experiments: a task of your own is audited against its runs'
    own configuration."""
    name = config.get("task", "cifar10")
    check(
        name in experiment.TASKS,
        path,
        f"the strict audit holds the lab's documented experiments ({', '.join(experiment.TASKS)}), and these runs "
        f"trained the task {name}: audit them with --expect-from-config",
    )


def check_real_data(folder, record):
    """The strict audit: the documented experiment ran on real data, not tools/synthetic_data.py's."""
    check(
        record["config"].get("data_synthetic") is False,
        folder / RUN_RECORD_FILE,
        f"the run trained on synthetic data (tools/synthetic_data.py wrote {record.get('data_dir')}), not CIFAR-10: "
        f"run the documented experiment on CIFAR-10, or audit these runs with --expect-from-config",
    )


def check_learned(folder, report):
    """The strict audit: the documented run's model learned (test accuracy at least
    experiment.DOCUMENTED_ACCURACY_FLOOR); every count can hold for a run whose gradients never reached its
    weights."""
    floor = experiment.DOCUMENTED_ACCURACY_FLOOR
    check(
        report["model_test_accuracy"] >= floor,
        folder / REPORT_FILE,
        f"test accuracy {report['model_test_accuracy']:.4f} is below {floor} (the majority baseline is "
        f"{report['baseline_accuracy']:.4f}): the model did not learn",
    )
