"""verify.py's check of the document's checklist, item by item, against what the witnesses of checklist.py
saw in each epoch; the strict audit's hold on every documented key; the checklist table verify.py prints.
A refusal is one line naming the file, the epoch, the micro-batch or step, what was seen, and the item.
"""

import functools

import torch

from ddp_no_sync_lab import experiment, packed
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.records import REPORT_FILE, RUN_RECORD_FILE, AuditError, check, is_int, is_number
from ddp_no_sync_lab.scale import loss_scale_bounds

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
    """Every checklist item of one epoch row as every rank's witnesses saw it (checklist.py), against what
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
                check(isinstance(runs, list) and all(isinstance(r, list) and len(r) == 2 and all(map(is_int, r))
                      for r in runs), path, f"epoch row {number}: {name} must be [value, count] runs, got {runs!r}")  # fmt: skip
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


def check_rank(path, number, who, seen, row, config, plan):
    """One rank's observations of one epoch (check_epoch)."""
    world_size = config["world_size"]

    def at(where):
        return f", {who}, {where}" if where else f", {who}"

    # 2. Its micro-batches and examples, counted at the model's forward.
    sizes = experiment.micro_batch_sizes(config)
    for key, expected, what in (
        ("micro_batches", len(sizes), "micro-batches"),
        ("samples", sum(sizes), "examples"),
        ("backwards", len(sizes), "backwards"),
    ):
        if seen[key] != expected:
            refuse(path, number, at(""), f"{seen[key]} {what} ran (expected {expected})", 2)

    # 4. The loss scale seen at the logits: the window's divisor at every micro-batch, within the bound.
    divisors = []
    for entry in seen["loss_divisors"]:
        check(
            isinstance(entry, list) and len(entry) == 3 and is_int(entry[0]) and is_int(entry[1]),
            path,
            f"epoch row {number}: loss_divisors must be [start, stop, divisor] runs, got {entry!r}",
        )
        divisors += [(index, entry[2]) for index in range(entry[0], entry[1])]
    planned = [(index, micro_step.loss_divisor) for index, micro_step in enumerate(plan)]
    if config.get("task") != "text":  # per sample in a window of unequal micro-batches: recorded to 6 decimals
        divisors = [
            (index, want) if isinstance(have, float) and abs(have - want) <= 1e-6 * want else (index, have)
            for (index, have), (_, want) in zip(divisors, planned)
        ] + divisors[len(planned) :]
    if config.get("task") == "text":
        check_token_divisors(path, number, at, seen, config, plan, divisors)
    difference = None if config.get("task") == "text" else first_difference(divisors, planned)
    if difference is not None:
        _, have, want = difference
        where = have[0] if isinstance(have, tuple) else want[0]
        seen_divisor = have[1] if isinstance(have, tuple) else "no backward"
        want = f"{want[1]:.7g}" if isinstance(want, tuple) else "none"
        refuse(path, number, at(f"micro-batch {where}"), f"its mean loss was divided by {seen_divisor} (read at the "
               f"loss), the window's divisor is {want} (its length; per sample where its micro-batches are unequal: "
               f"the window's samples over the micro-batch's)", 4)  # fmt: skip
    gradient_dtype = torch.bfloat16 if config.get("precision") == "bf16" else torch.float32
    deviation_bound, residual_bound = loss_scale_bounds(gradient_dtype)
    deviation, residual = seen.get("loss_scale_deviation"), seen.get("loss_scale_residual")
    if not (is_number(deviation) and deviation <= deviation_bound):
        refuse(path, number, at(""), f"the gradient at the logits is {deviation!r} off the divisor read at the loss "
               f"(bound {deviation_bound:.3g} for {config.get('precision')}): the loss was scaled between the logits "
               f"and the criterion's value", 4)  # fmt: skip
    if not (is_number(residual) and residual <= residual_bound):
        refuse(path, number, at(""), f"the gradient at the logits is not the loss's own cross-entropy gradient "
               f"(relative residual {residual!r}, bound {residual_bound:.3g})", 4)  # fmt: skip

    # 5 and 7. Resets only at the windows' starts; every other backward adds onto what the last one left.
    starts = [window[0] for window in experiment.window_indices(plan)]
    backward_starts = experiment.from_progressions(seen["backward_starts"])
    difference = first_difference(backward_starts, list(range(len(plan))))
    if difference is not None:
        refuse(path, number, at(""), f"backward {difference[0] + 1} started at micro-batch {difference[1]}, "
               f"expected {difference[2]}", 2)  # fmt: skip
    if seen["steps_before_backward"]:
        refuse(path, number, at(f"micro-batch {seen['steps_before_backward'][0]}"), "the optimizer stepped between "
               "its forward and its backward", 7)  # fmt: skip
    fresh = experiment.from_progressions(seen["fresh_at_backward"])
    difference = first_difference(fresh, starts)
    if difference is not None:
        _, have, want = difference
        if have != "none" and (want == "none" or have < want):
            refuse(path, number, at(f"micro-batch {have}"), "its backward started on reset gradients inside a "
                   "window (zero_grad or a reset before the window's synchronized micro-batch)", 7)  # fmt: skip
        refuse(path, number, at(f"micro-batch {want}"), "its backward added onto the previous window's gradients "
               "(no reset after the step)", 7)  # fmt: skip
    fresh_at_step = experiment.from_progressions(seen["fresh_at_step"])
    if fresh_at_step:
        refuse(path, number, at(f"micro-batch {fresh_at_step[0]}"), "the optimizer stepped on reset gradients "
               "(zero_grad before step)", 7)  # fmt: skip
    if seen["altered_at"]:
        where = experiment.from_progressions(seen["altered_at"])[0]
        refuse(path, number, at(f"micro-batch {where}"), "the gradients were not what the backward before left "
               "(changed between backwards, or not accumulated)", 5)  # fmt: skip

    # 3. The samples behind each step, summed over the ranks, all of them in the loss.
    if seen["loss_short_of_samples"]:
        refuse(path, number, at(f"micro-batch {seen['loss_short_of_samples'][0]}"), "its loss took fewer samples "
               "than its forward", 3)  # fmt: skip
    windows = experiment.window_indices(plan)
    expected_samples = [world_size * sum(sizes[index] for index in window) for window in windows]
    expected_forwards = [world_size * len(window) for window in windows]
    for key, expected, what in (
        ("step_samples", expected_samples, "samples"),
        ("step_micro_batches", expected_forwards, "micro-batches"),
    ):
        got = [value for value, count in seen[key] for _ in range(count)]
        difference = first_difference(got, expected)
        if difference is not None:
            refuse(path, number, at(f"optimizer step {difference[0] + 1}"), f"{difference[1]} {what} over all ranks "
                   f"went into it, expected {difference[2]}", 3)  # fmt: skip

    # 6. The synchronized gradient is the mean of the ranks' local (accumulated) gradients, at every step.
    off = seen.get("first_average_off")
    if off is not None:
        check(isinstance(off, dict), path, f"epoch row {number}: first_average_off must be an object, got {off!r}")
        refuse(path, number, at(f"optimizer step {off.get('optimizer_step')}"), f"the synchronized gradient's "
               f"projection {off.get('synced')!r} is not the mean of the ranks' local ones {off.get('mean_of_ranks')!r} "
               f"(bound {off.get('bound')!r}): the reduction (all-reduce, or FSDP's reduce-scatter) did not average", 6)  # fmt: skip
    if seen["averages_checked"] != row["optimizer_steps"]:
        refuse(path, number, at(""), f"{seen['averages_checked']} averages checked for {row['optimizer_steps']} "
               "steps", 6)  # fmt: skip

    # 8. The optimizer's own count of its updates.
    if seen["optimizer_state_steps"] != row["optimizer_steps"]:
        refuse(path, number, at(""), f"the optimizer's state counted {seen['optimizer_state_steps']} updates, its "
               f"step hooks {row['optimizer_steps']} (an update inside step() run twice, or skipped)", 8)  # fmt: skip


def check_token_divisors(path, number, at, seen, config, plan, divisors):
    """The text task's loss scale, read exactly from the gradient that reached each loss's value (the witness at
    the criterion): each micro-batch's divisor, times the world size and its own tokens, must be its window's
    target tokens over every rank (the average witness's sum) under `tokens`, or the world size x the window's
    length x its own tokens under `micro-batch`; the tokens are those the loss took, and each window's must be
    what the packing gives for the run's seed and epoch (recomputed when this Python and torch packed the run)."""
    tokens, totals = experiment.from_runs(seen["micro_batch_tokens"]), experiment.from_runs(seen["step_tokens"])
    windows = experiment.window_indices(plan)
    if len(tokens) != len(plan) or len(totals) != len(windows):
        refuse(path, number, at(""), f"the witness saw {len(tokens)} micro-batches' and {len(totals)} windows' tokens, "
               f"the plan has {len(plan)} and {len(windows)}", 3)  # fmt: skip
    packing = packed_window_tokens(config, plan, number - 1)
    if packing is not None and packing != totals:
        step, have, want = first_difference(totals, packing)
        refuse(path, number, at(f"optimizer step {step + 1}"), f"{have} target tokens over all ranks went into it, "
               f"the packing gives {want}", 3)  # fmt: skip
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
        refuse(path, number, at(f"micro-batch {where}"), f"its loss was divided as if its window held {seen_divisor} "
               f"target tokens over all ranks ({config['loss_normalization']} normalization expects "
               f"{want[1] if isinstance(want, tuple) else 'none'})", 4)  # fmt: skip


def packed_window_tokens(config, plan, epoch):
    """Each window's target tokens over every rank, from the packing of this Python's corpus for the run's seed
    and epoch; None when this Python or torch could not have packed the run (recomputed_packing)."""
    packing = recomputed_packing(
        config.get("data_fingerprint"), config.get("torch"), config["seed"], config["world_size"]
    )
    if isinstance(packing, str):
        return None
    counts = packed.window_tokens(packing.parts["train"].tokens, plan, config["seed"], epoch, config["world_size"],
                                  config["batch_size"])  # fmt: skip
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
    packed.py does it: every target is the next row position's input; each part's targets are its
    documents' bytes but their first, and one separator each; the run's sizes are the parts' rows. Where this
    Python or torch could not have packed the run, the strict audit refuses and the other says so in a note."""
    packing = recomputed_packing(
        config.get("data_fingerprint"), config.get("torch"), config["seed"], config["world_size"]
    )
    if isinstance(packing, str):
        if strict:
            raise AuditError(f"{path}: {packing}: run verify.py with the Python and torch that trained")
        print(f"note: {packing}: the packing, the windows' tokens and the report's test tokens and baseline were "
              f"not checked against the corpus (the witnesses' counts stand)")  # fmt: skip
        return None
    for name, part in packing.parts.items():
        documents = packing.documents[name]
        valid, inside = part.targets.ne(experiment.IGNORE_INDEX), part.targets[:, :-1].ne(experiment.IGNORE_INDEX)
        check(torch.equal(part.targets[:, :-1][inside], part.inputs[:, 1:][inside]), path,
              f"the {name} rows' targets are not their next inputs")  # fmt: skip
        expected = [torch.tensor([*document[1:], packed.SEPARATOR]) for document in documents]
        histogram = torch.bincount(torch.cat(expected), minlength=packed.VOCABULARY)
        check(torch.equal(torch.bincount(part.targets[valid], minlength=packed.VOCABULARY), histogram), path,
              f"the {name} rows' targets are not its documents' bytes (after each first) and separators")  # fmt: skip
        check(config[f"{name}_size"] == len(part.inputs), path,
              f"config {name}_size={config[f'{name}_size']}, the packing gives {len(part.inputs)} rows")  # fmt: skip
    return packing


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


def token_weights(row, config):
    """Per micro-batch of every rank: how much each of its tokens weighed in its window's update against its share
    (1 / the window's tokens over every rank): the window's tokens over the divisor read at its loss."""
    windows, weights = experiment.window_indices(experiment.epoch_plan(config)), []
    for rank in row["checklist"]["ranks"]:
        divisors = {index: divisor for start, stop, divisor in rank["loss_divisors"] for index in range(start, stop)}
        totals = experiment.from_runs(rank["step_tokens"])
        weights += [total / divisors[index] for window, total in zip(windows, totals) for index in window]
    return weights


def check_token_normalization(path, runs, config):
    """The strict audit of the text task: per-token normalization, or a refusal naming how unequally the run's
    tokens weighed (the loss-scale witness's divisors against the windows' tokens)."""
    if config["loss_normalization"] != experiment.TEXT_DOCUMENTED["loss_normalization"]:
        weights = [
            weight for history, _, _ in runs.values() for row in history for weight in token_weights(row, config)
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


PLATFORM_CHOICES = ("device", "backend", "precision", "loader", "activation_checkpointing", "nodes")


def print_checklist(runs, config):
    """The document's ten items, each with the witness that showed it, for each mode (every check has held)."""
    print()
    print("The document's checklist, observed (checklist.py; docs/audit.md):")
    print("| # | item (document) | in English | " + " | ".join(runs) + " | seen by |")
    print("|---:|---|---|" + ":---:|" * len(runs) + "---|")
    for number, ((text, gloss), witness) in enumerate(zip(ITEMS, WITNESSES), start=1):
        print(f"| {number} | {text} | {gloss} | " + " | ".join("✓" for _ in runs) + f" | {witness} |")
    if config.get("task") == "text":
        print("The text task: items 2 and 3 count rows and target tokens, item 4 divides each loss by its window's "
              "tokens over all ranks (x ranks / its own tokens), item 10 is report.json's loss per token against "
              "its perplexity and the unigram baseline.")  # fmt: skip


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
