"""verify.py's check of the document's checklist, item by item, against what the witnesses of audit/checklist.py
saw in each epoch; the strict audit's hold on every documented key; the checklist table verify.py prints.
A refusal is one line naming the file, the epoch, the micro-batch or step, what was seen, and the item.
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.audit.scale import loss_scale_bounds
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.files import AuditError, check, is_int, is_number
from ddp_no_sync_lab.tasks import packed

# The document's checklist (its last section), in its order: the Romanian text and an English gloss.
ITEMS = (
    ("Jobul rulează cu exact două procese și câte un proces pe GPU.", "two processes, one per device"),
    (
        "Fiecare rang primește 20.000 de exemple și 400 de micro-batch-uri pe epocă.",
        "each rank: 20,000 examples, 400 micro-batches per epoch",
    ),
    ("Batch-ul efectiv este 400 de imagini.", "the effective batch is 400 images"),
    ("Pierderea fiecărui micro-batch este împărțită la patru înainte de backward().", "each loss divided by 4"),
    (
        "Forward-ul și backward-ul intermediar sunt ambele în contextul no_sync().",
        "intermediate forward and backward inside no_sync()",
    ),
    ("Ultimul micro-batch al ferestrei rulează în afara contextului.", "the window's last micro-batch outside it"),
    (
        "optimizer.step() și zero_grad() apar numai după micro-batch-ul sincronizat.",
        "step() and zero_grad() only after the synchronized micro-batch",
    ),
    ("Fiecare epocă are 100 de pași ai optimizatorului.", "100 optimizer steps per epoch"),
    ("Modul every raportează 400 de sincronizări, iar no_sync raportează 100.", "every 400 syncs, no_sync 100"),
    (
        "Baseline-ul, acuratețea pe test și confuziile provin din report.json.",
        "baseline, test accuracy and confusions from report.json",
    ),
)
# What shows each item in verify.py's table (docs/audit.md says more).
WITNESSES = (
    "the ranks gathered: each its own process id and GPU UUID",
    "training forwards and their samples, per rank; the sampler's shards",
    "samples through the forward and the loss per step, over ranks",
    "the divisor read at each loss; gradient at the logits vs the mean loss's, recomputed",
    "hook calls per backward; each backward added onto the last",
    "sync positions; synced gradient = mean of the ranks' local gradients",
    "optimizer step hooks; gradient resets seen at each backward and step",
    "optimizer step hooks and its state's step counter",
    "hook calls; bytes handed to the collective",
    "report.json against its own confusion matrix",
)


def item(number):
    """The suffix every refusal carries: which item of the document's checklist it breaks."""
    return f" [checklist item {number}: {ITEMS[number - 1][1]}]"


def refuse(path, number, where, message, checklist_item):
    raise AuditError(f"{path}: epoch {number}{where}: {message}{item(checklist_item)}")


def first_difference(seen, expected):
    """The first index where two lists differ (their lengths included), with both values there."""
    for index in range(max(len(seen), len(expected))):
        have = seen[index] if index < len(seen) else "none"
        want = expected[index] if index < len(expected) else "none"
        if have != want:
            return index, have, want
    return None


RANK_FIELDS = {
    "backward_starts": list,
    "fresh_at_backward": list,
    "fresh_at_step": list,
    "altered_at": list,
    "loss_divisors": list,
    "loss_short_of_samples": list,
    "step_samples": list,
    "step_micro_batches": list,
    "steps_before_backward": list,
}
RANK_COUNTS = ("micro_batches", "samples", "backwards", "averages_checked", "optimizer_state_steps")
TEXT_RANK_FIELDS = ("micro_batch_tokens", "step_tokens")  # [value, count] runs of whole numbers


def check_epoch(path, number, row, config, mode, plan):
    """Every checklist item of one epoch row as every rank's witnesses saw it (audit/checklist.py), against what
    the run's configuration implies; a refusal names the item, the epoch, the rank, the micro-batch or step,
    and what was seen."""
    seen = row.get("checklist")
    check(
        isinstance(seen, dict)
        and all(is_int(seen.get(key)) for key in ("processes", "devices"))
        and isinstance(seen.get("ranks"), list)
        and all(
            isinstance(rank, dict)
            and all(isinstance(rank.get(name), kind) for name, kind in RANK_FIELDS.items())
            and all(is_int(rank.get(name)) for name in RANK_COUNTS)
            for rank in seen["ranks"]
        ),
        path,
        f"epoch row {number}: checklist must hold the witnesses' observations (processes, devices, and per rank "
        f"{', '.join([*RANK_FIELDS, *RANK_COUNTS])}), got {seen!r}",
    )
    if config.get("task") == "text":
        for rank in seen["ranks"]:
            for name in TEXT_RANK_FIELDS:
                runs = rank.get(name)
                check(
                    isinstance(runs, list)
                    and all(isinstance(r, list) and len(r) == 2 and all(map(is_int, r)) for r in runs),
                    path,
                    f"epoch row {number}: {name} must be [value, count] runs, got {runs!r}",
                )
    world_size = config["world_size"]
    # 1. The processes: as many as the run's world, each rank its own, on CUDA each its own GPU.
    if len(seen["ranks"]) != world_size:
        refuse(path, number, "", f"{len(seen['ranks'])} ranks reported, the run's world has {world_size}", 1)
    if seen["processes"] != world_size:
        refuse(path, number, "", f"{world_size} ranks ran in {seen['processes']} processes", 1)
    for rank, observed in enumerate(seen["ranks"]):
        check_rank(path, number, f"rank {rank}", observed, row, config, plan)
    # After every rank's items: ranks sharing a GPU (gpu_check.sh's job over gloo) are refused only once the
    # epoch's every other item held.
    if seen.get("device_type") == "cuda" and seen["devices"] != world_size:
        refuse(path, number, "", f"{world_size} ranks shared {seen['devices']} GPUs: one process per GPU", 1)


@dataclass(frozen=True)
class RankEpoch:
    """One rank's observations of one epoch (its witnesses' row), what the run implies for it, and its refusal."""

    path: Path
    number: int
    who: str
    seen: dict
    row: dict
    config: dict
    plan: list

    def refuse(self, checklist_item, where, message):
        refuse(self.path, self.number, f", {self.who}, {where}" if where else f", {self.who}", message, checklist_item)


def check_rank(path, number, who, seen, row, config, plan):
    """One rank's observations of one epoch (check_epoch): each item's check in turn, the first refusal named."""
    rank = RankEpoch(path, number, who, seen, row, config, plan)
    for check_item in RANK_ITEMS:
        check_item(rank)


def check_examples(rank):
    """2. Its micro-batches and examples, counted at the model's forward (its batch; its loss's targets where the
    forward's arguments show none)."""
    sizes = experiment.micro_batch_sizes(rank.config)
    for key, expected, what in (
        ("micro_batches", len(sizes), "micro-batches"),
        ("samples", sum(sizes), "examples"),
        ("backwards", len(sizes), "backwards"),
    ):
        if rank.seen[key] != expected:
            rank.refuse(2, "", f"{rank.seen[key]} {what} ran (expected {expected})")


def read_divisors(rank):
    """The divisor read at each micro-batch's loss, as (index, divisor); per sample in a window of unequal
    micro-batches (the image task) recorded to 6 decimals, so taken as planned within that."""
    divisors = []
    for entry in rank.seen["loss_divisors"]:
        check(
            isinstance(entry, list) and len(entry) == 3 and is_int(entry[0]) and is_int(entry[1]),
            rank.path,
            f"epoch row {rank.number}: loss_divisors must be [start, stop, divisor] runs, got {entry!r}",
        )
        divisors += [(index, entry[2]) for index in range(entry[0], entry[1])]
    if rank.config.get("task") == "text":
        return divisors
    planned = [(index, micro_step.loss_divisor) for index, micro_step in enumerate(rank.plan)]
    return [
        (index, want) if isinstance(have, float) and abs(have - want) <= 1e-6 * want else (index, have)
        for (index, have), (_, want) in zip(divisors, planned)
    ] + divisors[len(planned) :]


def check_loss_scale(rank):
    """4. The loss scale seen at the logits: the window's divisor at every micro-batch, within the bound."""
    divisors = read_divisors(rank)
    if rank.config.get("task") == "text":
        check_token_divisors(rank, divisors)
    else:
        planned = [(index, micro_step.loss_divisor) for index, micro_step in enumerate(rank.plan)]
        difference = first_difference(divisors, planned)
        if difference is not None:
            _, have, want = difference
            where = have[0] if isinstance(have, tuple) else want[0]
            seen_divisor = have[1] if isinstance(have, tuple) else "no backward"
            want = f"{want[1]:.7g}" if isinstance(want, tuple) else "none"
            rank.refuse(
                4,
                f"micro-batch {where}",
                f"its mean loss was divided by {seen_divisor} (read at the loss), the window's divisor is {want} (its "
                f"length; per sample where its micro-batches are unequal: the window's samples over the micro-batch's)",
            )
    precision = rank.config.get("precision")
    deviation_bound, residual_bound = loss_scale_bounds(torch.bfloat16 if precision == "bf16" else torch.float32)
    deviation, residual = rank.seen.get("loss_scale_deviation"), rank.seen.get("loss_scale_residual")
    if not (is_number(deviation) and deviation <= deviation_bound):
        rank.refuse(
            4,
            "",
            f"the gradient at the logits is {deviation!r} off the divisor read at the loss (bound "
            f"{deviation_bound:.3g} for {precision}): the loss was scaled between the logits and the criterion's value",
        )
    if not (is_number(residual) and residual <= residual_bound):
        rank.refuse(
            4,
            "",
            f"the gradient at the logits is not the loss's own cross-entropy gradient (relative residual {residual!r}, "
            f"bound {residual_bound:.3g})",
        )


def check_resets(rank):
    """5 and 7. Resets only at the windows' starts; every other backward adds onto what the last one left."""
    seen, plan = rank.seen, rank.plan
    difference = first_difference(experiment.from_progressions(seen["backward_starts"]), list(range(len(plan))))
    if difference is not None:
        index, have, want = difference
        rank.refuse(2, "", f"backward {index + 1} started at micro-batch {have}, expected {want}")
    if seen["steps_before_backward"]:
        where = f"micro-batch {seen['steps_before_backward'][0]}"
        rank.refuse(7, where, "the optimizer stepped between its forward and its backward")
    starts = [window[0] for window in experiment.window_indices(plan)]
    difference = first_difference(experiment.from_progressions(seen["fresh_at_backward"]), starts)
    if difference is not None:
        _, have, want = difference
        if have != "none" and (want == "none" or have < want):
            rank.refuse(
                7,
                f"micro-batch {have}",
                "its backward started on reset gradients inside a window (zero_grad or a reset before the window's "
                "synchronized micro-batch)",
            )
        rank.refuse(
            7,
            f"micro-batch {want}",
            "its backward added onto the previous window's gradients (no reset after the step)",
        )
    fresh_at_step = experiment.from_progressions(seen["fresh_at_step"])
    if fresh_at_step:
        rank.refuse(
            7, f"micro-batch {fresh_at_step[0]}", "the optimizer stepped on reset gradients (zero_grad before step)"
        )
    if seen["altered_at"]:
        rank.refuse(
            5,
            f"micro-batch {experiment.from_progressions(seen['altered_at'])[0]}",
            "the gradients were not what the backward before left (changed between backwards, or not accumulated)",
        )


def check_samples_in_loss(rank):
    """3. The samples behind each step, summed over the ranks, all of them in the loss."""
    seen, world_size = rank.seen, rank.config["world_size"]
    if seen["loss_short_of_samples"]:
        where = f"micro-batch {seen['loss_short_of_samples'][0]}"
        rank.refuse(3, where, "its loss took fewer samples than its forward")
    sizes, windows = experiment.micro_batch_sizes(rank.config), experiment.window_indices(rank.plan)
    expected_samples = [world_size * sum(sizes[index] for index in window) for window in windows]
    expected_forwards = [world_size * len(window) for window in windows]
    for key, expected, what in (
        ("step_samples", expected_samples, "samples"),
        ("step_micro_batches", expected_forwards, "micro-batches"),
    ):
        got = [value for value, count in seen[key] for _ in range(count)]
        difference = first_difference(got, expected)
        if difference is not None:
            step, have, want = difference
            rank.refuse(3, f"optimizer step {step + 1}", f"{have} {what} over all ranks went into it, expected {want}")


def check_average(rank):
    """6. The synchronized gradient is the mean of the ranks' local (accumulated) gradients, at every step."""
    off, steps = rank.seen.get("first_average_off"), rank.row["optimizer_steps"]
    if off is not None:
        check(
            isinstance(off, dict),
            rank.path,
            f"epoch row {rank.number}: first_average_off must be an object, got {off!r}",
        )
        rank.refuse(
            6,
            f"optimizer step {off.get('optimizer_step')}",
            f"the synchronized gradient's projection {off.get('synced')!r} is not the mean of the ranks' local ones "
            f"{off.get('mean_of_ranks')!r} (bound {off.get('bound')!r}): the reduction (all-reduce, or FSDP's "
            f"reduce-scatter) did not average",
        )
    if rank.seen["averages_checked"] != steps:
        rank.refuse(6, "", f"{rank.seen['averages_checked']} averages checked for {steps} steps")


def check_optimizer_updates(rank):
    """8. The optimizer's own count of its updates."""
    counted, steps = rank.seen["optimizer_state_steps"], rank.row["optimizer_steps"]
    if counted != steps:
        rank.refuse(
            8,
            "",
            f"the optimizer's state counted {counted} updates, its step hooks {steps} (an update inside step() run "
            f"twice, or skipped)",
        )


# In the order a refusal is looked for: the first that fails is the one named.
RANK_ITEMS = (
    check_examples,
    check_loss_scale,
    check_resets,
    check_samples_in_loss,
    check_average,
    check_optimizer_updates,
)


def check_token_divisors(rank, divisors):
    """The text task's loss scale, read exactly from the gradient that reached each loss's value (the witness at
    the criterion): each micro-batch's divisor, times the world size and its own tokens, must be its window's
    target tokens over every rank (the average witness's sum) under `tokens`, or the world size x the window's
    length x its own tokens under `micro-batch`; the tokens are those the loss took, and each window's must be
    what the packing gives for the run's seed and epoch (recomputed when this Python and torch packed the run)."""
    seen, config, plan = rank.seen, rank.config, rank.plan
    tokens, totals = experiment.from_runs(seen["micro_batch_tokens"]), experiment.from_runs(seen["step_tokens"])
    windows = experiment.window_indices(plan)
    if len(tokens) != len(plan) or len(totals) != len(windows):
        rank.refuse(
            3,
            "",
            f"the witness saw {len(tokens)} micro-batches' and {len(totals)} windows' tokens, the plan has "
            f"{len(plan)} and {len(windows)}",
        )
    packing = packed_window_tokens(config, plan, rank.number - 1)
    if packing is not None and packing != totals:
        step, have, want = first_difference(totals, packing)
        rank.refuse(
            3,
            f"optimizer step {step + 1}",
            f"{have} target tokens over all ranks went into it, the packing gives {want}",
        )
    expected = []
    for window, total in zip(windows, totals):
        for index in window:
            per_micro_batch = config["world_size"] * plan[index].loss_divisor * tokens[index]
            expected.append((index, total if config["loss_normalization"] == "tokens" else per_micro_batch))
    difference = first_difference(divisors, expected)
    if difference is not None:
        _, have, want = difference
        where = have[0] if isinstance(have, tuple) else want[0]
        seen_divisor = have[1] if isinstance(have, tuple) else "no backward"
        rank.refuse(
            4,
            f"micro-batch {where}",
            f"its loss was divided as if its window held {seen_divisor} target tokens over all ranks "
            f"({config['loss_normalization']} normalization expects {want[1] if isinstance(want, tuple) else 'none'})",
        )


def packed_window_tokens(config, plan, epoch):
    """Each window's target tokens over every rank, from the packing of this Python's corpus for the run's seed
    and epoch; None when this Python or torch could not have packed the run (recomputed_packing)."""
    packing = recomputed_packing(
        config.get("data_fingerprint"), config.get("torch"), config["seed"], config["world_size"]
    )
    if isinstance(packing, str):
        return None
    counts = packed.window_tokens(
        packing.parts["train"].tokens, plan, config["seed"], epoch, config["world_size"], config["batch_size"]
    )
    return [counts[window[0]] for window in experiment.window_indices(plan)]


@functools.cache
def recomputed_packing(fingerprint, torch_version, seed, world_size):
    """The run's split and packing made again here, or why not (a string): the corpus of another Python, or
    another torch (the split's and the samplers' permutations are torch's)."""
    try:
        source = packed.load_corpus()
    except LabError as error:
        return str(error)
    if source.fingerprint != fingerprint:
        return (
            f"the run's corpus (fingerprint {fingerprint}) is not this Python's {packed.CORPUS} ({source.fingerprint})"
        )
    if torch_version != torch.__version__:
        return f"the run's torch {torch_version} is not this one ({torch.__version__}), whose permutations split it"
    return packed.make_split(source, seed, 0, world_size)


def check_text_data(path, config, strict):
    """The text task: its packing recomputed here and checked by what packing must keep, independently of how
    tasks/packed.py does it: every target is the next row position's input; each part's targets are its
    documents' bytes but their first, and one separator each; the run's sizes are the parts' rows. Where this
    Python or torch could not have packed the run, the strict audit refuses and the other says so in a note."""
    packing = recomputed_packing(
        config.get("data_fingerprint"), config.get("torch"), config["seed"], config["world_size"]
    )
    if isinstance(packing, str):
        if strict:
            raise AuditError(f"{path}: {packing}: run verify.py with the Python and torch that trained")
        print(
            f"note: {packing}: the packing, the windows' tokens and the report's test tokens and baseline were "
            f"not checked against the corpus (the witnesses' counts stand)"
        )
        return None
    for name, part in packing.parts.items():
        documents = packing.documents[name]
        valid, inside = part.targets.ne(experiment.IGNORE_INDEX), part.targets[:, :-1].ne(experiment.IGNORE_INDEX)
        check(
            torch.equal(part.targets[:, :-1][inside], part.inputs[:, 1:][inside]),
            path,
            f"the {name} rows' targets are not their next inputs",
        )
        expected = [torch.tensor([*document[1:], packed.SEPARATOR]) for document in documents]
        histogram = torch.bincount(torch.cat(expected), minlength=packed.VOCABULARY)
        check(
            torch.equal(torch.bincount(part.targets[valid], minlength=packed.VOCABULARY), histogram),
            path,
            f"the {name} rows' targets are not its documents' bytes (after each first) and separators",
        )
        check(
            config[f"{name}_size"] == len(part.inputs),
            path,
            f"config {name}_size={config[f'{name}_size']}, the packing gives {len(part.inputs)} rows",
        )
    return packing


def print_checklist(runs, config):
    """The document's ten items, each with the witness that showed it, for each mode (every check has held)."""
    print()
    print("The document's checklist, observed (ddp_no_sync_lab/audit/checklist.py; docs/audit.md):")
    print("| # | item (document) | in English | " + " | ".join(runs) + " | seen by |")
    print("|---:|---|---|" + ":---:|" * len(runs) + "---|")
    for number, ((text, gloss), witness) in enumerate(zip(ITEMS, WITNESSES), start=1):
        print(f"| {number} | {text} | {gloss} | " + " | ".join("✓" for _ in runs) + f" | {witness} |")
    if config.get("task") not in (None, *experiment.TASKS):
        print(f"A task of your own ({config['task']}): item 10 is its own checks of its results (its `results`).")
    if config.get("task") == "text":
        print(
            "The text task: items 2 and 3 count rows and target tokens, item 4 divides each loss by its window's "
            "tokens over all ranks (x ranks / its own tokens), item 10 is report.json's loss per token against "
            "its perplexity and the unigram baseline."
        )
