"""The text task's data (train.py --task text): real text that ships with Python, packed into rows as language
model training does it, and the tokens each micro-batch and window hold.

    corpus        the standard library's pydoc_data.topics: Python's own reference texts (79 documents, 465,000
                  characters, 202 to 62,522 each, in Python 3.11), nothing downloaded; it differs between
                  Python versions, so its hash is the run's data fingerprint and nodes on other Pythons are refused
    tokens        UTF-8 bytes (256 of them); byte 0, which no document holds, ends each document
    split         by document, seeded: a tenth of the documents for validation, a tenth for test, the rest train
    packing       each document and its separator placed whole into the current row of ROW_LENGTH + 1 tokens when
                  it fits, else the row is padded and closed (a document longer than a row fills rows of its own,
                  each starting on the last token of the one before, so that no target is lost); a row's inputs
                  are its first ROW_LENGTH tokens, its targets the ROW_LENGTH after them
    boundaries    masked in both: the attention sees only the same document (tasks/language.py), and the loss skips
                  the target after a separator (the next document's first byte) and the padding

So micro-batches and ranks hold unequal numbers of target tokens, which is what per-token normalization is for
(docs/packed.md). Each rank knows every rank's rows of every window before the window's first backward, from the
seed and the epoch (DistributedSampler's order), so the window's global token count costs no collective.
"""

import hashlib
import platform
from dataclasses import dataclass, replace

import torch
from torch.utils.data.distributed import DistributedSampler

from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.experiment import IGNORE_INDEX, window_indices
from ddp_no_sync_lab.tasks.data import Split
from ddp_no_sync_lab.tasks.loaders import Loaders, rank_share

CORPUS = "pydoc_data.topics"
SEPARATOR = 0  # ends each document; also the padding's input token
VOCABULARY = 256
ROW_LENGTH = 128
HELD_OUT_FRACTION = 10  # a tenth of the documents for validation, a tenth for test


@dataclass
class TextSource:
    """The corpus as byte documents, in the order of their names."""

    names: list
    documents: list  # bytes, one per document
    layout: str = CORPUS
    synthetic = False  # real text (the run's configuration records it, as the image task's)

    @property
    def fingerprint(self):
        digest = hashlib.sha256(f"python {platform.python_version()}\n".encode())
        for name, document in zip(self.names, self.documents):
            digest.update(f"{name}\n{len(document)}\n".encode() + document)
        return digest.hexdigest()[:16]

    def summary(self):
        """What every rank compares with rank 0's before training (the Python version is in the hash)."""
        return {
            "layout": self.layout,
            "documents": len(self.documents),
            "bytes": sum(map(len, self.documents)),
            "fingerprint of Python and its documents": self.fingerprint,
        }


def load_corpus():
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise LabError(
            f"the text task reads {CORPUS}, which this Python does not have (some distributions ship it in a "
            f"separate package, e.g. Debian's python3-doc); install it, or use a python.org or conda Python"
        ) from None
    names = sorted(topics)
    return TextSource(names, [topics[name].encode() for name in names])


@dataclass
class PackedRows:
    """One part of the split packed: inputs and targets, rows x ROW_LENGTH int64; and each row's target tokens."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def tokens(self):
        return self.targets.ne(IGNORE_INDEX).sum(dim=1)


def pack(documents, row_length=ROW_LENGTH):
    """Documents (bytes) packed into rows of row_length + 1 tokens (the module's docstring says how)."""
    width, rows, row = row_length + 1, [], []
    for document in documents:
        tokens = list(document) + [SEPARATOR]
        if row and len(row) + len(tokens) > width:
            rows.append(row)
            row = []
        while len(tokens) > width:  # a long document: rows of its own, each starting on the last token before
            rows.append(tokens[:width])
            tokens = tokens[width - 1 :]
        row += tokens
    rows.append(row)
    inputs = torch.full((len(rows), row_length), SEPARATOR, dtype=torch.int64)
    targets = torch.full((len(rows), row_length), IGNORE_INDEX, dtype=torch.int64)
    for index, tokens in enumerate(rows):
        values = torch.tensor(tokens, dtype=torch.int64)
        inputs[index, : len(tokens) - 1] = values[:-1]
        targets[index, : len(tokens) - 1] = values[1:]
    targets[inputs.eq(SEPARATOR)] = IGNORE_INDEX  # the target after a separator is another document's
    keep = targets.ne(IGNORE_INDEX).any(dim=1)  # a row of a lone separator teaches nothing
    return PackedRows(inputs[keep], targets[keep])


def split_documents(count, seed):
    """The seeded permutation of the documents: a tenth validation, a tenth test, the rest train."""
    permutation = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = max(1, count // HELD_OUT_FRACTION)
    return permutation[2 * held_out :], permutation[:held_out], permutation[held_out : 2 * held_out]


@dataclass
class TextSplit(Split):
    """The split's rows (Split's indices are rows of each part) and the packed parts themselves."""

    parts: dict = None  # the packed rows of each part
    documents: dict = None  # each part's documents (bytes), in the order packed


def make_split(source, seed, rank, world_size):
    """Each part packed from its documents (in the seeded order); this rank's sampler over the train rows."""
    names = ("train", "validation", "test")
    documents = {
        name: [source.documents[index] for index in indices]
        for name, indices in zip(names, split_documents(len(source.documents), seed))
    }
    parts = {name: pack(part) for name, part in documents.items()}
    rows = {name: list(range(len(part.inputs))) for name, part in parts.items()}
    if min(map(len, rows.values())) < world_size:
        counts = ", ".join(f"{name} {len(part)}" for name, part in rows.items())
        raise LabError(f"the corpus packs into too few rows for {world_size} ranks ({counts}); run fewer ranks")
    sampler = train_sampler(len(rows["train"]), seed, rank, world_size)
    return TextSplit(rows["train"], rows["validation"], rows["test"], sampler, parts, documents)


def train_sampler(rows, seed, rank, world_size):
    return DistributedSampler(range(rows), num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False)


class RowLoader:
    """Batches of packed rows on the device in the sampler's order; from any batch on (a resumed epoch)."""

    def __init__(self, part, order, batch_size, device):
        self.inputs, self.targets = part.inputs.to(device), part.targets.to(device)
        self.order, self.batch_size = order, batch_size

    def __len__(self):
        return -(-len(self.order) // self.batch_size)

    def __iter__(self):
        return self.batches(0)

    def batches(self, start):
        rows = torch.tensor(list(self.order), dtype=torch.int64, device=self.inputs.device)
        for batch in rows.split(self.batch_size)[start:]:
            yield self.inputs[batch], self.targets[batch]


def build_loaders(split, batch_size, rank, world_size, device):
    return Loaders(
        RowLoader(split.parts["train"], split.train_sampler, batch_size, device),
        RowLoader(split.parts["validation"], rank_share(len(split.validation), rank, world_size), batch_size, device),
        RowLoader(split.parts["test"], rank_share(len(split.test), rank, world_size), batch_size, device),
    )


# ----------------------------------------------------------------------------- the tokens of each window


def rank_micro_batch_tokens(row_tokens, seed, epoch, rank, world_size, batch_size):
    """Rank `rank`'s target tokens per micro-batch in epoch `epoch` (0-based, the sampler's), from its order."""
    sampler = train_sampler(len(row_tokens), seed, rank, world_size)
    sampler.set_epoch(epoch)
    order = torch.tensor(list(sampler), dtype=torch.int64)
    return [int(part.sum()) for part in row_tokens[order].split(batch_size)]


def window_tokens(row_tokens, plan, seed, epoch, world_size, batch_size):
    """Per micro-batch of the epoch: the target tokens of its whole window over every rank (each rank computes
    all ranks' from the seed and the epoch: the same number everywhere, before the window's first backward)."""
    per_rank = [rank_micro_batch_tokens(row_tokens, seed, epoch, r, world_size, batch_size) for r in range(world_size)]
    if any(len(tokens) != len(plan) for tokens in per_rank):
        raise LabError(
            f"the packing gives {len(per_rank[0])} micro-batches per rank, the run's plan {len(plan)}: its configured "
            f"sizes are not this corpus's (rerun it, or verify it with the Python and torch that trained it)"
        )
    counts = []
    for window in window_indices(plan):
        counts += [sum(tokens[i] for tokens in per_rank for i in window)] * len(window)
    return counts


def loss_plan(plan, split, options, place, epoch):
    """The epoch's window plan with the text task's loss divisors. Under `tokens` a micro-batch's mean token loss
    is divided by T / (W n): T its window's target tokens over every rank, W the world size, n its own tokens;
    the window's gradient, which DDP averages over the ranks, is then the mean over every token of the window.
    Under `micro-batch` the plan's own divisor stays (the window's length: tokens weigh unequally)."""
    if options.loss_normalization != "tokens":
        return plan
    row_tokens, batch = split.parts["train"].tokens, options.batch_size
    totals = window_tokens(row_tokens, plan, options.seed, epoch, place.world_size, batch)
    own = rank_micro_batch_tokens(row_tokens, options.seed, epoch, place.rank, place.world_size, batch)
    return [
        replace(micro_step, loss_divisor=total / (place.world_size * tokens))
        for micro_step, total, tokens in zip(plan, totals, own, strict=True)
    ]
