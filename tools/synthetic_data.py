"""Small, learnable stand-ins for CIFAR-10 in both on-disk layouts train.py reads (no network needed).

    python tools/synthetic_data.py --out data/synthetic --train-source 2000 --test 500
    python tools/synthetic_data.py --out /tmp/cifar --layout torchvision

Each class has its own colour and stripe direction, under noise: a working pipeline learns it within a few optimizer
steps and beats the majority baseline; a broken one (shuffled labels, lost gradients) does not. Layouts:
`image-folders` writes train/<class>/*.png and test/<class>/*.png; `torchvision` writes cifar-10-batches-py/ in the
pickle format of the official archive (data_batch_1..5, test_batch, batches.meta). Either way the root holds
synthetic.json (ddp_no_sync_lab/tasks/data.py's SYNTHETIC_MARKER): runs on these data record that they are synthetic,
and verify.py's strict audit refuses them as the documented experiment.
"""

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from ddp_no_sync_lab.cli import ArgumentParser, LabError, exit_with, non_negative_int, positive_int
from ddp_no_sync_lab.tasks.data import SYNTHETIC_MARKER, TORCHVISION_FOLDER
from model import CLASSES, IMAGE_SIZE

LAYOUTS = ("image-folders", "torchvision")
TRAIN_BATCHES = 5

# Five colours times two stripe directions make the ten classes.
PALETTE = np.array([(170, 90, 90), (90, 150, 95), (95, 105, 170), (165, 155, 90), (150, 95, 160)], dtype=np.float32)


def make_images(count, seed):
    """`count` images (uint8, N x 32 x 32 x 3) and labels, the classes in turn so every class is present."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % len(CLASSES)
    rng.shuffle(labels)
    coordinate = np.arange(IMAGE_SIZE, dtype=np.float32)
    images = np.empty((count, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.float32)
    for index, label in enumerate(labels):
        phase = rng.uniform(0, 2 * np.pi)
        wave = 30 * np.sin(coordinate * (np.pi / 2) + phase)
        stripes = wave[:, None] if label % 2 == 0 else wave[None, :]  # rows or columns
        brightness = rng.uniform(0.6, 1.0)
        images[index] = PALETTE[label // 2] * brightness + stripes[..., None]
    images += rng.normal(0, 70, images.shape)
    return np.clip(images, 0, 255).astype(np.uint8), labels.tolist()


def write_image_folders(root, split, images, labels):
    for name in CLASSES:
        (root / split / name).mkdir(parents=True, exist_ok=True)
    for index, (image, label) in enumerate(zip(images, labels)):
        Image.fromarray(image).save(root / split / CLASSES[label] / f"{index:05d}.png")


def write_torchvision_batches(root, train, test):
    """The official archive's format: pickled dicts of uint8 rows (3072 = 3 x 32 x 32, channel-major)."""
    folder = root / TORCHVISION_FOLDER
    folder.mkdir(parents=True, exist_ok=True)

    def dump(name, images, labels):
        rows = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
        with open(folder / name, "wb") as handle:
            pickle.dump({"batch_label": name, "labels": list(labels), "data": rows}, handle, protocol=2)

    train_images, train_labels = train
    for batch, indices in enumerate(np.array_split(np.arange(len(train_images)), TRAIN_BATCHES), start=1):
        dump(f"data_batch_{batch}", train_images[indices], [train_labels[i] for i in indices])
    dump("test_batch", *test)
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump({"label_names": list(CLASSES), "num_vis": IMAGE_SIZE * IMAGE_SIZE * 3}, handle, protocol=2)


def write_dataset(root, layout, train_source_size, test_size, seed=0):
    """Write the dataset into a new folder `root`, all at once: into a hidden sibling, then renamed."""
    root = Path(root)
    if root.exists():
        raise LabError(f"--out {root} already exists; remove it or pass a new folder")
    partial = root.parent / f".{root.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    train = make_images(train_source_size, seed)
    test = make_images(test_size, seed + 1)
    if layout == "image-folders":
        write_image_folders(partial, "train", *train)
        write_image_folders(partial, "test", *test)
    else:
        write_torchvision_batches(partial, train, test)
    marker = {
        "written_by": "tools/synthetic_data.py",
        "train_source": train_source_size,
        "test": test_size,
        "seed": seed,
    }
    (partial / SYNTHETIC_MARKER).write_text(json.dumps(marker) + "\n")
    partial.rename(root)
    return train, test


def main():
    parser = ArgumentParser(prog="synthetic_data.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write (created)")
    parser.add_argument("--layout", choices=LAYOUTS, default="image-folders")
    parser.add_argument("--train-source", type=positive_int, default=2000, help="images split into train/validation")
    parser.add_argument("--test", type=positive_int, default=500)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    args = parser.parse_args()
    try:
        write_dataset(args.out, args.layout, args.train_source, args.test, args.seed)
    except LabError as error:
        exit_with(error, "synthetic_data.py")
    print(f"wrote {args.train_source} + {args.test} synthetic images ({args.layout}) to {args.out}")


if __name__ == "__main__":
    main()
