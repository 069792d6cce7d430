"""Classify PNG/JPEG images with a checkpoint written by train.py.

    python infer.py --checkpoint artifacts/no_sync/model.pt --image artifacts/no_sync/sample_test.png
    python infer.py --checkpoint artifacts/no_sync/model.pt --image photos/ cat.jpg --top-k 3

One image file prints the document's JSON: the class, its confidence and all ten probabilities. Several
files or folders (searched recursively for .png, .jpg, .jpeg) print one JSON object per line, each with its
path; a file that is not a readable image gets a line {"path", "error"} and the others go on; the exit code is
1 if any failed. Any picture works: it is made RGB and resized to 32x32, then normalized as in training.
The checkpoint is loaded with weights_only=True: tensors and plain data only, never pickled code.

--numerics float32 (the default, as the document's infer.py) runs the model in float32; --numerics evaluation
runs it as train.py's evaluation does (channels_last, in the precision the run recorded in model.pt, or
--precision), so that its classes are the ones the test metrics and the confusion matrix counted. The docs say
how often the two disagree.
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
from PIL import Image

from ddp_no_sync_lab.cli import ArgumentParser, LabError, exit_with, positive_int
from ddp_no_sync_lab.precision import PRECISIONS, choose_precision
from ddp_no_sync_lab.tasks.data import IMAGE_ERRORS, IMAGE_SUFFIXES
from model import CLASSES, MEMORY_FORMAT, CheckpointError, inference_transform, load_checkpoint

SCRIPT = "infer.py"
BATCH_SIZE = 256


def top_k_value(text):
    value = positive_int(text)
    if value > len(CLASSES):
        raise argparse.ArgumentTypeError(f"must be at most {len(CLASSES)} (the number of classes), got {value}")
    return value


def parse_args():
    parser = ArgumentParser(prog=SCRIPT, description="Classify PNG/JPEG images with a saved CifarCNN.")
    parser.add_argument("--checkpoint", type=Path, required=True, help="model.pt written by train.py")
    parser.add_argument("--image", type=Path, nargs="+", required=True, help="image files and/or folders")
    parser.add_argument("--top-k", type=top_k_value, help="also list the K most likely classes")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--numerics",
        choices=("float32", "evaluation"),
        default="float32",
        help="float32: the document's infer.py; evaluation: as train.py evaluates (channels_last, the run's precision)",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="with --numerics evaluation: the precision to evaluate in (default: the one the run trained and "
        "evaluated in, recorded in model.pt)",
    )
    args = parser.parse_args()
    if args.precision and args.numerics != "evaluation":
        parser.error("--precision applies to --numerics evaluation (--numerics float32 is float32 by definition)")
    return args


def evaluation_precision(requested, checkpoint, device):
    """--numerics evaluation's Precision: --precision, else the run's own (checkpoints written before the lab
    recorded it were trained in BF16 autocast)."""
    return choose_precision(requested or checkpoint.get("precision", "bf16"), device)


def choose_device(requested):
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise LabError("--device cuda: no CUDA device is visible (check nvidia-smi), or pass --device cpu")
    return torch.device(requested)


def collect_images(paths):
    """(path, error or None) for every image to classify, folders expanded, in the order given."""
    items = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            items.extend((p, None) for p in found)
            if not found:
                items.append((path, "no PNG or JPEG images in this folder"))
        elif path.is_file():
            items.append((path, None))
        else:
            items.append((path, "no such file or folder"))
    return items


def read_image(path):
    """The image as a normalized 3 x 32 x 32 tensor; one of IMAGE_ERRORS with the reason if it cannot be."""
    if path.stat().st_size == 0:
        raise ValueError("the file is empty")
    with warnings.catch_warnings():
        # Pillow only warns between 89 and 179 million pixels; refuse those too rather than decode them.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(path) as image:
                return inference_transform(image.convert("RGB"))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            raise ValueError(f"refused, too many pixels: {error}") from None


def prediction(probabilities, top_k):
    predicted = int(probabilities.argmax())
    result = {
        "class": CLASSES[predicted],
        "confidence": float(probabilities[predicted]),
        "probabilities": {name: float(probabilities[index]) for index, name in enumerate(CLASSES)},
    }
    if top_k:
        values, indices = probabilities.topk(top_k)
        result["top_k"] = [{"class": CLASSES[int(i)], "probability": float(v)} for v, i in zip(values, indices)]
    return result


def classify(model, tensors, device, precision):
    """Probabilities per image: in float32 (precision None), or as train.py evaluates in `precision`."""
    inputs = torch.stack(tensors).to(device)
    with torch.inference_mode():
        if precision is not None:
            with precision.autocast(device.type):
                logits = model(inputs.contiguous(memory_format=MEMORY_FORMAT))
        else:
            logits = model(inputs)
        return logits.float().softmax(dim=1).cpu()


def main():
    args = parse_args()
    try:
        model, checkpoint = load_checkpoint(args.checkpoint)
    except CheckpointError as error:
        raise LabError(str(error)) from None
    device = choose_device(args.device)
    precision = None
    if args.numerics == "evaluation":
        precision = evaluation_precision(args.precision, checkpoint, device)
        print(f"{SCRIPT}: precision: {precision.reason}", file=sys.stderr)
    model.to(device, memory_format=MEMORY_FORMAT if args.numerics == "evaluation" else torch.contiguous_format)

    if len(args.image) == 1 and not args.image[0].is_dir():
        # One file: the document's output form.
        path = args.image[0]
        if not path.is_file():
            raise LabError(f"image not found: {path}")
        try:
            tensor = read_image(path)
        except IMAGE_ERRORS as error:
            raise LabError(f"{path}: not a readable image ({error})") from None
        print(json.dumps(prediction(classify(model, [tensor], device, precision)[0], args.top_k), indent=2))
        return 0

    items = collect_images(args.image)
    if all(error for _, error in items):
        raise LabError(f"no PNG or JPEG images found in: {', '.join(map(str, args.image))}")
    failed = 0
    for start in range(0, len(items), BATCH_SIZE):
        lines, tensors, waiting = [], [], []
        for path, error in items[start : start + BATCH_SIZE]:
            if error is None:
                try:
                    tensors.append(read_image(path))
                    waiting.append(len(lines))
                except IMAGE_ERRORS as read_error:
                    error = f"not a readable image ({read_error})"
            lines.append({"path": str(path), "error": error})
        if tensors:
            for line_index, probabilities in zip(waiting, classify(model, tensors, device, precision)):
                lines[line_index] = {"path": lines[line_index]["path"], **prediction(probabilities, args.top_k)}
        for line in lines:
            failed += "error" in line
            print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LabError as error:
        exit_with(error, SCRIPT)
