"""A task of your own, outside the lab's package, through its public protocol (ddp_no_sync_lab.tasks.registry.Task):
a small MLP on synthetic vectors of ten classes. The recipe is docs/architecture.md's "Add a task".

    PYTHONPATH=tests/tasks torchrun --standalone --nproc-per-node=2 train.py --task vector_task:VectorTask \
        --mode every --output artifacts/vectors/every
    PYTHONPATH=tests/tasks python verify.py --artifacts artifacts/vectors --expect-from-config

train.py finds the task by --task MODULE:CLASS, records that name in the runs' configuration and hashes this file
with the lab's code (nodes must run it byte for byte); verify.py imports it by the same name and runs its
`results`, the checks of its report and checkpoint. Everything else (the window plan, DDP or FSDP, the checklist's
witnesses, the counts, the history, verify's audit) is the lab's, as for its own tasks.
"""

__all__ = ["VectorResults", "VectorTask"]

import hashlib
import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from ddp_no_sync_lab import experiment, files
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.tasks import data, loaders
from model import CLASSES

FEATURES, HIDDEN = 16, 32
TRAIN_SOURCE, TEST = 200, 100  # the train source is split 4:1 into train and validation (data.make_split)
DATA_SEED = 1234  # the data are the same whatever --seed (which seeds the split, the weights and the order)
NAME = "vector_task:VectorTask"  # --task's MODULE:CLASS, which the runs record
DOCUMENTED = {"epochs": 2, "batch_size": 4, "partial_window": "error"}  # train.py's defaults for the task


@dataclass
class Vectors:
    """The data in memory: each class a Gaussian around its own centre; the Source a Task's load_source returns."""

    train_vectors: torch.Tensor
    train_labels: list
    test_vectors: torch.Tensor
    test_labels: list
    layout = "synthetic vectors"
    synthetic = True

    @cached_property
    def fingerprint(self):
        digest = hashlib.sha256()
        for tensor in (self.train_vectors, self.test_vectors):
            digest.update(tensor.numpy().tobytes())
        digest.update(repr((self.train_labels, self.test_labels)).encode())
        return digest.hexdigest()[:16]

    def summary(self):
        return {"layout": self.layout, "train-source vectors": len(self.train_labels), "fingerprint": self.fingerprint}


def make_vectors():
    generator = torch.Generator().manual_seed(DATA_SEED)
    centres = torch.randn(len(CLASSES), FEATURES, generator=generator) * 2

    def draw(count):
        labels = torch.randint(len(CLASSES), (count,), generator=generator)
        return centres[labels] + torch.randn(count, FEATURES, generator=generator), labels.tolist()

    return Vectors(*draw(TRAIN_SOURCE), *draw(TEST))


class VectorLoader:
    """Batches of vectors in an order of indices into them (a sampler's, or every world_size-th)."""

    def __init__(self, vectors, labels, indices, order, batch_size):
        self.vectors, self.labels = vectors, torch.as_tensor(labels)
        self.indices, self.order, self.batch_size = indices, order, batch_size

    def __len__(self):
        return math.ceil(len(self.order) / self.batch_size)

    def __iter__(self):
        return self.batches(0)

    def batches(self, start):
        """The epoch's batches from batch `start` on (a resumed run's)."""
        epoch_order = torch.tensor([self.indices[position] for position in self.order], dtype=torch.int64)
        for batch in epoch_order.split(self.batch_size)[start:]:
            yield self.vectors[batch], self.labels[batch]


def mlp():
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, len(CLASSES)))


class VectorResults:
    """verify.py's checks of the task's results (checks/task_results.py's TaskResults): the report's accuracy from
    its own confusion matrix over every test vector, the checkpoint the MLP's weights of this run."""

    name = NAME

    def model(self):
        return mlp()

    def documented(self, config):
        return {**config, **DOCUMENTED}

    def prepare(self, artifacts, config, strict):
        pass

    def check_run(self, folder, mode, record, strict):
        path = folder / files.REPORT_FILE
        report = files.read_json(path)
        files.check(report.get("mode") == mode and report.get("run_id") == record["run_id"], path, "another run's")
        files.check(report.get("config") == record["config"], path, "its config differs from run.json's")
        matrix = torch.tensor(report.get("confusion_matrix"))
        files.check(matrix.shape == (len(CLASSES), len(CLASSES)), path, "confusion_matrix is not 10x10")
        files.check(matrix.sum().item() == record["config"]["test_size"], path, "the matrix misses test vectors")
        accuracy = matrix.diagonal().sum().item() / matrix.sum().item()
        files.check(math.isclose(report["model_test_accuracy"], accuracy), path, "accuracy not its matrix's")
        path = folder / files.MODEL_FILE
        try:
            checkpoint = torch.load(path, weights_only=True)
            mlp().load_state_dict(checkpoint["model"])  # every weight of the MLP, none else
        except (OSError, RuntimeError, KeyError, TypeError) as error:
            raise files.AuditError(f"{path}: not this task's checkpoint ({' '.join(str(error).split())})") from None
        files.check(checkpoint.get("run_id") == record["run_id"], path, "another run's")
        return report

    def check_pair(self, artifacts, config, runs, strict):
        pass


class VectorTask:
    """The Task: its data, split, loaders, model and loss; train.py's own evaluation (ten classes, a confusion
    matrix); its results written by write_results and checked by VectorResults."""

    name = NAME
    documented = DOCUMENTED
    evaluate = None
    results = VectorResults

    def prepare_data(self, options):
        """Nothing to fetch: the vectors are drawn from DATA_SEED."""

    def load_source(self, options):
        return make_vectors()

    def source_place(self, options):
        return "vector_task.make_vectors()", "run every node with the same vector_task.py"

    def make_split(self, source, seed, rank, world_size):
        return data.make_split(source, seed, rank, world_size)

    def build_loaders(self, options, source, split, rank, world_size, device):
        if options.loader != "tensor" or device.type != "cpu":
            raise LabError(f"{self.name} has one loader on the CPU: drop --loader, pass --device cpu")
        validation_order = loaders.rank_share(len(split.validation), rank, world_size)
        test_order = loaders.rank_share(len(split.test), rank, world_size)
        train_part = (source.train_vectors, source.train_labels)
        return loaders.Loaders(
            VectorLoader(*train_part, split.train, split.train_sampler, options.batch_size),
            VectorLoader(*train_part, split.validation, validation_order, options.batch_size),
            VectorLoader(source.test_vectors, source.test_labels, split.test, test_order, options.batch_size),
        )

    def build_model(self, options):
        if options.activation_checkpointing:
            raise LabError(f"{self.name}: the MLP has no stages to recompute; drop --activation-checkpointing")
        return mlp()

    def criterion(self):
        return nn.CrossEntropyLoss()

    def window_plan(self, plan, options, config):
        if options.loss_normalization != "tokens":  # recorded where not the default, as the lab's image task does
            config.update(loss_normalization=options.loss_normalization)
        return experiment.sample_plan(plan, config)  # the lab's plan: a short micro-batch's window per sample

    def run_config(self, options):
        return {"augmentation": "none", "model": "MLP 16-32-10"}

    def epoch_plan(self, plan, split, options, place, epoch):
        return plan

    def write_results(self, folder, options, config, setup, model, test, weights, run_id, started_at):
        loss, accuracy, confusion = test
        report = {
            "mode": options.mode,
            "task": self.name,
            "model_test_loss": loss,
            "model_test_accuracy": accuracy,
            "confusion_matrix": confusion.tolist(),
            "run_id": run_id,
            "config": config,
        }
        folder.write(files.MODEL_FILE, files.torch_bytes({"model": weights, "run_id": run_id, "mode": options.mode}))
        folder.write(files.REPORT_FILE, files.json_bytes(report))
        return report, files.run_record(options, config, run_id, started_at, "vector_task.make_vectors()")
