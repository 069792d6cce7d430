"""CIFAR-10 as JPEG image folders, made from the official archive: the kind of copy the lab's figures were measured on.

    python tools/jpeg_copy.py --source data/cifar-10-python.tar.gz --out data/cifar10-jpeg
    python tools/jpeg_copy.py --read-quality data/cifar10-jpeg

The copy the figures used (docs/results.md#the-data) is CIFAR-10 re-encoded by Pillow at quality 75 with 4:2:0
chroma subsampling, its files train/<class>/NNNN.jpg and test/<class>/NNNN.jpg, numbered per class in the
archive's order. This tool writes the same kind of copy from `cifar-10-python.tar.gz` (or its unpacked
`cifar-10-batches-py/`): pixels differ slightly from the official ones, so accuracies are close to, not equal
to, a run on the archive. --read-quality reads a folder's JPEG quality from its files' quantization tables: the
quality whose IJG tables, as Pillow writes them, equal the file's.
"""

import io
import pickle
import shutil
import tarfile
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

from ddp_no_sync_lab.cli import ArgumentParser, LabError, exit_with, positive_int
from ddp_no_sync_lab.tasks.data import IMAGE_ERRORS, SYNTHETIC_MARKER, TORCHVISION_FOLDER
from model import CLASSES, IMAGE_SIZE

QUALITY = 75  # read from the figures' copy with --read-quality
SUBSAMPLING = "4:2:0"
BATCHES = {"train": [f"data_batch_{n}" for n in range(1, 6)], "test": ["test_batch"]}
BATCH_NAMES = {name for names in BATCHES.values() for name in names}


def read_batches(source):
    """{split: (images N x 32 x 32 x 3 uint8, labels)} from the archive or its unpacked folder."""
    source = Path(source)
    folder = source / TORCHVISION_FOLDER if (source / TORCHVISION_FOLDER).is_dir() else source
    archive = source / "cifar-10-python.tar.gz" if source.is_dir() else source
    if not (folder / "test_batch").is_file() and not (archive.is_file() and tarfile.is_tarfile(archive)):
        raise LabError(
            f"--source {source} is neither cifar-10-python.tar.gz nor a folder with {TORCHVISION_FOLDER}/; pass one"
        )
    splits = {}
    try:
        if (folder / "test_batch").is_file():
            contents = {name: (folder / name).read_bytes() for names in BATCHES.values() for name in names}
        else:
            with tarfile.open(archive) as tar:
                members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
                contents = {name: tar.extractfile(members[name]).read() for name in members if name in BATCH_NAMES}
        for split, names in BATCHES.items():
            batches = [pickle.loads(contents[name], encoding="latin1") for name in names]  # Python 2's str as str
            rows = np.concatenate([batch["data"] for batch in batches])
            images = rows.reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE).transpose(0, 2, 3, 1)
            splits[split] = images, [label for batch in batches for label in batch["labels"]]
    except (KeyError, ValueError, OSError, EOFError, tarfile.TarError, zlib.error, pickle.UnpicklingError) as error:
        raise LabError(
            f"--source {source}: CIFAR-10's batches missing or damaged ({type(error).__name__}: {error}); "
            "download the archive again"
        ) from None
    return splits


def write_copy(source, out, quality):
    """Every image as train|test/<class>/NNNN.jpg, into a hidden sibling renamed at the end: never half written."""
    out = Path(out)
    if out.exists():
        raise LabError(f"--out {out} already exists; remove it or pass a new folder")
    splits = read_batches(source)
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    for split, (images, labels) in splits.items():
        numbers = Counter()
        for name in CLASSES:
            (partial / split / name).mkdir(parents=True)
        for image, label in zip(images, labels):
            path = partial / split / CLASSES[label] / f"{numbers[label]:04d}.jpg"
            Image.fromarray(image).save(path, quality=quality, subsampling=SUBSAMPLING)
            numbers[label] += 1
    source = Path(source)  # a synthetic source stays known as synthetic: its marker beside the batches or above them
    for marker in (source / SYNTHETIC_MARKER, source.parent / SYNTHETIC_MARKER):
        if marker.is_file():
            shutil.copy(marker, partial / SYNTHETIC_MARKER)
            break
    partial.rename(out)
    return {split: len(labels) for split, (_, labels) in splits.items()}


def pillow_tables(quality):
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "JPEG", quality=quality, subsampling=SUBSAMPLING)
    return Image.open(buffer).quantization


def read_quality(folder):
    """Counter of each file's quality (None where no Pillow quality gives its tables) over a folder's JPEGs."""
    by_tables = {str(pillow_tables(q)): q for q in range(1, 101)}
    qualities = Counter()
    files = sorted(Path(folder).rglob("*.jpg"))
    if not files:
        raise LabError(f"--read-quality {folder} holds no .jpg files; pass the copy's folder")
    for path in files:
        try:
            with Image.open(path) as image:
                if image.format != "JPEG":
                    raise ValueError(f"a {image.format} file")
                qualities[by_tables.get(str(image.quantization))] += 1
        except IMAGE_ERRORS as error:
            raise LabError(f"{path}: not a readable JPEG ({error}); make the copy again") from None
    return qualities


def main():
    parser = ArgumentParser(prog="jpeg_copy.py", description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="cifar-10-python.tar.gz or the folder holding cifar-10-batches-py/")
    parser.add_argument("--out", type=Path, help="folder to write (created)")
    parser.add_argument("--quality", type=positive_int, default=QUALITY, help="1 to 100")
    parser.add_argument("--read-quality", type=Path, metavar="FOLDER", help="print a JPEG folder's quality instead")
    args = parser.parse_args()
    if args.quality > 100:
        parser.error(f"argument --quality: must be at most 100, got {args.quality}")
    if not args.read_quality and not (args.source and args.out):
        parser.error("pass --source and --out to make a copy, or --read-quality FOLDER")
    try:
        if args.read_quality:
            for quality, count in read_quality(args.read_quality).most_common():
                print(f"{count} files at quality {quality if quality else 'other than Pillow quality 1 to 100'}")
        else:
            counts = write_copy(args.source, args.out, args.quality)
            print(f"wrote {counts['train']} + {counts['test']} images at JPEG quality {args.quality} to {args.out}")
    except LabError as error:
        exit_with(error, "jpeg_copy.py")


if __name__ == "__main__":
    main()
