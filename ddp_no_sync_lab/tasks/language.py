"""The text task (train.py --task text; TextTask, tasks/registry.py's Task): its data, split, loaders and per-epoch
token divisors from tasks/packed.py, a small causal byte-level transformer over its rows, its per-token loss,
evaluation in loss per token and perplexity, a greedy continuation, and its checkpoint.

    ByteTransformer   256-byte embedding (tied to the output), learned positions, 2 pre-norm blocks of width 128
                      (4 heads, an MLP of 512), about 0.43 M parameters; attention within each document only
    TokenCrossEntropy the mean cross-entropy over a micro-batch's target tokens (the padding and the targets
                      after a separator skipped); train.py divides it per --loss-normalization
"""

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ddp_no_sync_lab import files
from ddp_no_sync_lab.experiment import IGNORE_INDEX, TEXT_DOCUMENTED
from ddp_no_sync_lab.options import TrainOptions
from ddp_no_sync_lab.tasks import packed
from ddp_no_sync_lab.tasks.packed import CORPUS, ROW_LENGTH, SEPARATOR, VOCABULARY

WIDTH, HEADS, LAYERS = 128, 4, 2
PROMPT = "The for statement"  # the report's greedy continuation starts here
CONTINUATION_BYTES = 120


def same_document(tokens):
    """B x 1 x L x L: position i may attend to position j <= i of its own document (a separator ends its
    document, so the positions after it start the next)."""
    document = F.pad(tokens.eq(SEPARATOR).cumsum(dim=1), (1, -1))
    causal = torch.ones(tokens.size(1), tokens.size(1), dtype=torch.bool, device=tokens.device).tril()
    return (document[:, :, None] == document[:, None, :]).logical_and(causal).unsqueeze(1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.projection = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x, mask):
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(batch, length, 3, HEADS, WIDTH // HEADS).unbind(dim=2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, WIDTH))
        return x + self.mlp(self.mlp_norm(x))


class ByteTransformer(nn.Module):
    def __init__(self, activation_checkpointing=False):
        super().__init__()
        self.activation_checkpointing = activation_checkpointing
        self.embedding = nn.Embedding(VOCABULARY, WIDTH)
        self.position = nn.Parameter(torch.zeros(ROW_LENGTH, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        nn.init.normal_(self.embedding.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens):
        """B x L bytes -> B x L x 256 logits of the next byte."""
        x = self.embedding(tokens) + self.position[: tokens.size(1)]
        mask = same_document(tokens)
        for block in self.blocks:
            # Recomputed in the backward when asked (non-reentrant: DDP's hooks see every gradient once).
            x = checkpoint(block, x, mask, use_reentrant=False) if self.activation_checkpointing else block(x, mask)
        return self.norm(x) @ self.embedding.weight.t()


class TokenCrossEntropy(nn.Module):
    """The mean cross-entropy over the target tokens of a B x L batch (IGNORE_INDEX skipped)."""

    counts_tokens = True  # audit/checklist.py's witnesses read its targets as tokens

    def forward(self, logits, targets):
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)


def text_config(options: TrainOptions) -> dict:
    """What the text task adds to the run's configuration (train.py; both modes must share it)."""
    model = f"ByteTransformer: {LAYERS} blocks of width {WIDTH}, {HEADS} heads, rows of {ROW_LENGTH} bytes"
    return {"task": "text", "loss_normalization": options.loss_normalization, "model": model, "augmentation": "none"}


@torch.no_grad()
def evaluate(ddp_model, loader, criterion, device, autocast, progress, label, group=None):
    """Loss per target token, next-byte accuracy and the target tokens, summed over ranks."""
    ddp_model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, tokens
    progress.start(label, len(loader), "batches")
    for done, (inputs, targets) in enumerate(loader, start=1):
        tokens = targets.ne(IGNORE_INDEX).sum()
        with autocast():
            logits = ddp_model(inputs)
            loss = criterion(logits, targets)
        totals[0] += loss.double() * tokens
        totals[1] += logits.argmax(dim=-1).eq(targets).sum()
        totals[2] += tokens
        progress.update(done, done * inputs.size(0))
    dist.all_reduce(totals, group=group)
    loss_sum, correct, tokens = totals.tolist()
    return loss_sum / tokens, correct / tokens, int(tokens)


def unigram_loss(train_targets, test_targets):
    """The baseline: cross-entropy per token of the train part's byte frequencies (add-one) on the test tokens."""
    counts = torch.bincount(train_targets[train_targets.ne(IGNORE_INDEX)], minlength=VOCABULARY).double() + 1
    log_probability = (counts / counts.sum()).log()
    return -log_probability[test_targets[test_targets.ne(IGNORE_INDEX)]].mean().item()


@torch.no_grad()
def continue_text(model, prompt=PROMPT, length=CONTINUATION_BYTES):
    """The model's greedy continuation of `prompt`, byte by byte, as text."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = list(prompt.encode())
    for _ in range(length):
        window = torch.tensor([tokens[-ROW_LENGTH:]], device=device)
        next_byte = int(model(window)[0, -1].float().argmax())
        if next_byte == SEPARATOR:
            break
        tokens.append(next_byte)
    model.train(was_training)
    return bytes(tokens[len(prompt.encode()) :]).decode(errors="replace")


def write_results(folder, options, config, test_metrics, split, model, run_id, started_at):
    """Rank 0: the text report and checkpoint into the run's partial folder; returns them as image.write_results
    does (the report, and the run record whose publish makes them the run)."""
    loss, accuracy, tokens = test_metrics
    baseline_loss = unigram_loss(split.parts["train"].targets, split.parts["test"].targets)
    report = {
        "mode": options.mode,
        "task": "text",
        "model_test_loss": loss,
        "model_test_perplexity": math.exp(loss),
        "model_test_bits_per_byte": loss / math.log(2),
        "model_test_accuracy": accuracy,
        "test_tokens": tokens,
        "baseline": "unigram byte frequencies of the train part",
        "baseline_loss": baseline_loss,
        "continuation": {"prompt": PROMPT, "greedy": continue_text(model)},
        "run_id": run_id,
        "config": config,
    }
    checkpoint = {
        "model": model.state_dict(),
        "task": "text",
        "seed": options.seed,
        "run_id": run_id,
        "mode": options.mode,
        "precision": config["precision"],
    }
    folder.write(files.MODEL_FILE, files.torch_bytes(checkpoint))
    folder.write(files.REPORT_FILE, files.json_bytes(report))
    return report, files.run_record(options, config, run_id, started_at, data_dir=CORPUS)


# ----------------------------------------------------------------------------- verify.py's checks of a text run


def check_report(path, mode, record):
    """The text report: its run, its measures consistent with one another, a continuation."""
    report = files.read_json(path)
    files.check(isinstance(report, dict), path, "expected a JSON object")
    files.check(report.get("mode") == mode and report.get("task") == "text", path, f"expected a text {mode} report")
    files.check(
        report.get("run_id") == record["run_id"], path, f"run id {report.get('run_id')}, run.json {record['run_id']}"
    )
    files.check(report.get("config") == record["config"], path, "its config differs from run.json's")
    loss = report.get("model_test_loss")
    files.check(files.is_number(loss) and loss > 0, path, f"model_test_loss must be a positive number, got {loss!r}")
    for key, value in (("model_test_perplexity", math.exp(loss)), ("model_test_bits_per_byte", loss / math.log(2))):
        files.check(
            report.get(key) == value, path, f"{key} {report.get(key)!r} does not follow from the loss ({value})"
        )
    for key in ("model_test_accuracy", "baseline_loss"):
        files.check(files.is_number(report.get(key)), path, f"{key} must be a number, got {report.get(key)!r}")
    files.check(files.is_int(report.get("test_tokens")), path, "test_tokens must be a whole number")
    continuation = report.get("continuation")
    files.check(isinstance(continuation, dict) and isinstance(continuation.get("greedy"), str), path, "no continuation")
    return report


def check_report_against_packing(path, report, packing):
    """The report against the split packed again (certify.check_text_data): its test evaluation took every test
    token once, and its baseline is the one these parts give."""
    tokens = int(packing.parts["test"].tokens.sum())
    files.check(
        report["test_tokens"] == tokens,
        path,
        f"its test took {report['test_tokens']} target tokens, the "
        f"test part has {tokens}: the evaluation missed or repeated rows",
    )
    baseline = unigram_loss(packing.parts["train"].targets, packing.parts["test"].targets)
    same = abs(report["baseline_loss"] - baseline) <= 1e-12 * baseline  # summed in another order on other CPUs
    files.check(same, path, f"baseline_loss {report['baseline_loss']} is not the packing's {baseline}")


def check_learned(path, report):
    """The strict audit: the documented text run's model beats the unigram baseline on the test tokens."""
    files.check(
        report["model_test_loss"] < report["baseline_loss"],
        path,
        f"test loss per token {report['model_test_loss']:.4f} is not below the unigram baseline's "
        f"{report['baseline_loss']:.4f}: the model did not learn",
    )


def check_model(path, mode, record):
    """model.pt: the run's, a ByteTransformer's state dict, loaded safely (weights_only)."""
    files.require_file(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        ByteTransformer().load_state_dict(checkpoint["model"])
    except Exception as error:  # unreadable, refused, or not this model: each is the same failure here
        raise files.AuditError(f"{path}: not a text-task checkpoint ({' '.join(str(error).split())[:200]})") from None
    files.check(checkpoint.get("run_id") == record["run_id"], path, f"run id {checkpoint.get('run_id')}")
    files.check(checkpoint.get("mode") == mode, path, f"expected mode={mode}, got {checkpoint.get('mode')}")


class TextTask:
    """The second task (tasks/registry.py's Task): Python's documentation texts in packed rows of bytes, the byte
    transformer, each micro-batch's loss divided by its window's tokens (docs/packed.md)."""

    name = "text"
    documented = TEXT_DOCUMENTED
    evaluate = staticmethod(evaluate)

    def prepare_data(self, options):
        """Nothing to fetch: the corpus ships with Python."""

    def load_source(self, options):
        return packed.load_corpus()

    def source_place(self, options):
        return f"Python's {CORPUS}", "run every node on the same Python"

    def make_split(self, source, seed, rank, world_size):
        return packed.make_split(source, seed, rank, world_size)

    def build_loaders(self, options, source, split, rank, world_size, device):
        return packed.build_loaders(split, options.batch_size, rank, world_size, device)

    def build_model(self, options):
        return ByteTransformer(activation_checkpointing=options.activation_checkpointing)

    def criterion(self):
        return TokenCrossEntropy()

    def window_plan(self, plan, options, config):
        return plan  # each epoch's divisors from its windows' tokens: epoch_plan

    def run_config(self, options):
        return text_config(options)

    def epoch_plan(self, plan, split, options, place, epoch):
        return packed.loss_plan(plan, split, options, place, epoch)

    def write_results(self, folder, options, config, setup, model, test, weights, run_id, started_at):
        return write_results(folder, options, config, test, setup.split, model, run_id, started_at)
