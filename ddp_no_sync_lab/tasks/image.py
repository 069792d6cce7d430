"""The image task (the document's): CIFAR-10 through data.py and loaders.py, model.py's CNN and its cross-entropy
divided per sample, and its results: the report with its confusion matrix and the pairs most confused, the
checkpoint, a test image and the confusion matrix drawn; verify's checks of them are in checks/task_results.py."""

import json

from PIL import Image
from torch import nn

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.files import (
    CONFUSION_FILE,
    MODEL_FILE,
    REPORT_FILE,
    SAMPLE_FILE,
    json_bytes,
    png_bytes,
    run_record,
    torch_bytes,
)
from ddp_no_sync_lab.options import TrainOptions
from ddp_no_sync_lab.report import pictures
from ddp_no_sync_lab.tasks import data, loaders
from model import CLASSES, CifarCNN


class ImageTask:
    """The document's task (tasks/registry.py's Task): its evaluation is train.py's own, the lesson's."""

    name = "cifar10"
    documented = experiment.DOCUMENTED
    evaluate = None

    def prepare_data(self, options):
        data.prepare_data(options.data_dir)

    def load_source(self, options):
        return data.load_data(options.data_dir)

    def source_place(self, options):
        return f"{options.data_dir}/", "give every node the same copy of the dataset"

    def make_split(self, source, seed, rank, world_size):
        return data.make_split(source, seed, rank, world_size)

    def build_loaders(self, options, source, split, rank, world_size, device):
        batch = options.batch_size
        return loaders.build_loaders(
            options.loader, source, split, batch, rank, world_size, device, options.seed + rank
        )

    def build_model(self, options):
        return CifarCNN(activation_checkpointing=options.activation_checkpointing)

    def criterion(self):
        return nn.CrossEntropyLoss()

    def window_plan(self, plan, options, config):
        if options.loss_normalization != "tokens":  # recorded where not the default: the document's runs stay
            config.update(loss_normalization=options.loss_normalization)
        return experiment.sample_plan(plan, config)  # a short micro-batch's window: per sample

    def run_config(self, options):
        return {"augmentation": loaders.AUGMENTATION}

    def epoch_plan(self, plan, split, options, place, epoch):
        return plan

    def write_results(self, folder, options, config, setup, model, test, weights, run_id, started_at):
        majority = data.majority_class([setup.source.train_labels[index] for index in setup.split.train])
        sample = setup.source.test_images[0]
        return write_results(folder, options, config, test[2], majority, weights, sample, test[:2], run_id, started_at)


def write_results(
    folder, options: TrainOptions, config, confusion, majority, weights, test_image, test_metrics, run_id, started_at
):
    """Rank 0: report, checkpoint and pictures into the run's partial folder. Returns the report and the run
    record whose publish (RunFolder.publish) makes them the run."""
    matrix = confusion.tolist()
    test_size = config["test_size"]
    report = {
        "mode": options.mode,
        "baseline_class": CLASSES[majority],
        "baseline_accuracy": sum(matrix[majority]) / test_size,
        "model_test_loss": test_metrics[0],
        "model_test_accuracy": test_metrics[1],
        "confusion_matrix": matrix,
        "top_confusions": top_confusions(matrix),
        "run_id": run_id,
        "config": config,
    }
    checkpoint = {
        "model": weights,
        "classes": CLASSES,
        "seed": options.seed,
        "run_id": run_id,
        "mode": options.mode,
        "precision": config["precision"],
    }
    folder.write(MODEL_FILE, torch_bytes(checkpoint))
    folder.write(REPORT_FILE, json_bytes(report))
    folder.write(SAMPLE_FILE, png_bytes(Image.fromarray(test_image), {"run_id": run_id}))
    image, data = pictures.confusion_matrix_image(matrix, CLASSES, f"{options.mode}: test confusion matrix")
    folder.write(CONFUSION_FILE, png_bytes(image, {"run_id": run_id, "data": json.dumps(data)}))
    return report, run_record(options, config, run_id, started_at, str(options.data_dir))


def top_confusions(matrix, limit=5):
    """The most frequent off-diagonal (true, predicted, count) pairs: count descending, then class order."""
    pairs = [
        (count, true, predicted)
        for true, row in enumerate(matrix)
        for predicted, count in enumerate(row)
        if true != predicted and count > 0
    ]
    pairs.sort(key=lambda pair: (-pair[0], pair[1], pair[2]))
    return [
        {"true": CLASSES[true], "predicted": CLASSES[predicted], "count": count}
        for count, true, predicted in pairs[:limit]
    ]
