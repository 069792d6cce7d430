"""The image task's results (the document's): the report with its confusion matrix and the pairs most confused,
the checkpoint, a test image and the confusion matrix drawn; verify's checks of them are in checks/task_results.py."""

import json

from PIL import Image

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
from model import CLASSES


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
