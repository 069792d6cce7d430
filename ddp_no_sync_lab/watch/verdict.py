"""The document's checklist judged on a script the lab did not write, from what its ranks' witnesses saw
(watch/observe.py): the windows are inferred from the optimizer's steps, the syncs from DDP's hook, the divisors
from the losses, never from a configuration. Each item is judged on its own; the first refusal, in the order a
cause shows before its effects (the processes, the samples, the steps, the resets, the syncs, the divisors), is
the one named.
"""

from collections import Counter
from dataclasses import dataclass, field

from ddp_no_sync_lab.watch.items import ITEM_JUDGES, Refusal, step_targets
from ddp_no_sync_lab.watch.report import FAIL, GLOSSES, UNSEEN, Finding, Verdict, human_bytes

READ_AT_THE_LOSS = (3, 4, 5, 6, 7, 9)  # items whose witnesses begin at a backward seen from the loss it reads
COUNTED_SYNCS = (5, 6, 9)  # items judged from the syncs counted for the model
STEPPED = (6, 8)  # items judged from the updates made: the average taken, the optimizer's count
ALONE = (8, 7, 5)  # the items one rank judges from its own windows as each ends (--fail-fast), in refusal order


@dataclass
class RankLoop:
    """One rank's loop as its witnesses saw it: its windows (micro-batches between steps), syncs and losses."""

    rank: int
    seen: dict

    def __post_init__(self):
        self.windows, start = [], 0
        for position in self.seen["step_positions"]:
            self.windows.append(list(range(start, position + 1)))
            start = position + 1
        self.trailing = list(range(start, self.seen["micro_batches"]))
        if self.seen["losses"]:  # where losses were read, a window is its backwards (a logging forward is none)
            backwards = {index for index, _, _ in self.seen["losses"]}
            self.windows = [[index for index in window if index in backwards] for window in self.windows]
            self.trailing = [index for index in self.trailing if index in backwards]
        self.syncs = set(self.seen["sync_positions"])
        self.flags_at_forward = self.seen["flags_at_forward"]
        self.flags_at_backward = dict(
            zip([index for index, _, _ in self.seen["losses"]], self.seen["flags_at_backward"])
        )
        self.losses = {index: (read, items) for index, read, items in self.seen["losses"]}

    def where(self, micro_batch):
        """'rank r, window w, micro-batch m of n' (1-based) for a micro-batch of this rank."""
        for number, window in enumerate(self.windows, 1):
            if micro_batch in window:
                return (
                    f"rank {self.rank}, window {number}, micro-batch {window.index(micro_batch) + 1} of {len(window)}"
                )
        position = f"micro-batch {micro_batch - self.trailing[0] + 1}" if micro_batch in self.trailing else ""
        return f"rank {self.rank}, after the last step, {position}".rstrip(", ")

    def refuse(self, micro_batch, message):
        raise Refusal(f"{self.where(micro_batch)}: {message}")


def judge(observed):
    """The verdict on what the watcher exchanged at the script's teardown (observe.Watch.close)."""
    verdict = Verdict()
    models = observed["models"]
    verdict.notes += observed["ranks"][0]["declined"]
    if not models:
        verdict.nothing = "the script made no DistributedDataParallel model the watcher could watch"
        return verdict
    if len(models) > 1:
        verdict.notes.append(f"{len(models)} DDP models were made: the first is judged here")
    model = models[0]
    loops = [RankLoop(rank, seen) for rank, seen in enumerate(model["ranks"])]
    if not any(loop.windows for loop in loops):
        if any(loop.seen["weights_changed"] for loop in loops):
            verdict.nothing = (
                "the model's weights changed with no torch optimizer's step: its windows are read at steps"
            )
        elif not any(loop.seen["backwards"] for loop in loops):
            verdict.nothing = "no optimizer step on the DDP model's parameters was seen: nothing was trained"
        else:
            stepless(verdict, loops)
        return verdict
    world_size = observed["world_size"]
    context = Context(observed, model, loops, world_size)
    unread = context.losses_unread()
    unattributed = observed["ranks"][0].get("syncs_unattributed")
    unjudged = []
    for number, judge_item in ITEM_JUDGES.items():
        if unread is not None and number in READ_AT_THE_LOSS:
            verdict.findings[number] = Finding(UNSEEN, unread)
            continue
        if unattributed is not None and number in COUNTED_SYNCS:
            verdict.findings[number] = Finding(UNSEEN, unattributed)
            continue
        try:
            mark, seen = judge_item(context)
            verdict.findings[number] = Finding(mark, seen)
        except Refusal as refusal:
            verdict.findings[number] = Finding(FAIL, str(refusal).split(": ", 1)[-1], str(refusal))
        except Exception as error:  # noqa: BLE001 - an item the watcher failed to judge is said, never passed
            verdict.findings[number] = Finding(UNSEEN, f"not judged: the watcher failed on it ({error!r})")
            unjudged.append(str(number))
    if all(loop.seen["skipped_steps"] == len(loop.windows) for loop in loops):  # no step took a gradient
        why = f"every one of the {len(loops[0].windows)} steps was skipped by GradScaler (inf or NaN gradients)"
        for number in STEPPED:
            verdict.findings[number] = Finding(UNSEEN, why)
        verdict.unobserved = f"items {', '.join(map(str, STEPPED))} were not observed: {why}"
    elif unread is not None:
        verdict.unobserved = f"items {', '.join(map(str, READ_AT_THE_LOSS))} were not observed: {unread}"
    elif unattributed is not None:
        verdict.unobserved = f"items {', '.join(map(str, COUNTED_SYNCS))} were not observed: {unattributed}"
    elif unjudged:
        verdict.unobserved = f"items {', '.join(unjudged)} were not judged (the watcher failed on them)"
    verdict.found = context.found()
    verdict.notes += context.notes
    return verdict


def judge_alone(seen, rank, world_size):
    """The first refusal among the items a rank judges from its own windows so far (--fail-fast), or None: its
    steps once a window's length repeats (the window found), its resets and syncs where its losses were read."""
    loop = RankLoop(rank, seen)
    model = {"ranks": [seen], "processes": 1, "devices": 1, "device_type": "cpu"}
    context = Context({"world_size": world_size, "backend": "", "ranks": []}, model, [loop], world_size)
    repeated = max(Counter(len(window) for window in loop.windows).values(), default=0) > 1
    read = seen["backwards"] and not seen["unreadable_losses"]
    for number in ALONE:
        if (number == 8 and not repeated) or (number != 8 and not read):
            continue
        try:
            ITEM_JUDGES[number](context)
        except Refusal as refusal:
            return f"{refusal} [checklist item {number}: {GLOSSES[number - 1]}]"
    return None


# Where a framework, not the script, skips every step: what it does.
FRAMEWORK_STEPS = {
    "Accelerate": "Accelerate's optimizer steps only where accumulate() found a window's end: enter "
    "`with accelerator.accumulate(model):` around each batch, not around the loop (accelerate#1211)",
}


def stepless(verdict, loops):
    """Backwards, no optimizer step, the weights as they began: nothing was updated (item 8); the items a window's
    end decides, unseen."""
    loop = loops[0]
    framework = loop.seen.get("made_by")
    why = f": {FRAMEWORK_STEPS[framework]}" if framework in FRAMEWORK_STEPS else " (a step() never called, or skipped)"
    refusal = (
        f"rank {loop.rank}: {loop.seen['backwards']} backwards and no optimizer step on the DDP model's parameters: "
        f"nothing was updated{why}"
    )
    for number in ITEM_JUDGES:
        verdict.findings[number] = Finding(UNSEEN, "no window: no optimizer step was seen")
    verdict.findings[8] = Finding(FAIL, refusal.split(": ", 1)[-1], refusal)


@dataclass
class Context:
    observed: dict
    model: dict
    loops: list
    world_size: int
    notes: list = field(default_factory=list)

    @property
    def length(self):
        """The window found: the commonest length of the windows (an epoch's short last one is rarer)."""
        lengths = [len(window) for loop in self.loops for window in loop.windows if window]
        return Counter(lengths).most_common(1)[0][0] if lengths else 0

    def losses_unread(self):
        """Why the backwards went unseen, where they did: the witnesses see a backward begin at the gradient of a
        loss they read (torch's cross_entropy, a plain mean or sum)."""
        unreadable = sum(loop.seen["unreadable_losses"] for loop in self.loops)
        if unreadable:
            return (
                f"{unreadable} losses were not a plain cross-entropy (weighted, smoothed, or over probabilities): "
                f"the backwards, syncs and divisors are read at the loss"
            )
        if any(loop.seen["backwards"] == 0 for loop in self.loops):
            if any(rank["compiled_loss"] for rank in self.observed["ranks"]):
                return (
                    "the loss is computed inside a compiled region (torch.compile), where it is traced, not read: "
                    "compute it outside the compiled model to have the backwards, syncs and divisors read at it"
                )
            return "no loss computed by torch's cross_entropy: the backwards, syncs and divisors are read at it"
        return None

    @property
    def every_backward_synced(self):
        """The loop never asked DDP to skip a sync: every forward and backward with its flag on, each synchronized."""
        return all(
            all(loop.flags_at_forward)
            and all(loop.flags_at_backward.values())
            and loop.syncs >= set(loop.flags_at_backward)
            for loop in self.loops
        )

    def asked_sync(self, loop, index):
        """The micro-batch synchronized as the loop asked: its forward and its backward with DDP's sync on."""
        return index in loop.syncs and loop.flags_at_forward[index] and loop.flags_at_backward.get(index, False)

    def bytes_per_sync(self):
        first = self.loops[0].seen
        return first["bytes_handed"] / first["syncs"] if first["syncs"] else 0

    def found(self):
        first = self.loops[0]
        steps, forwards = len(first.windows), first.seen["micro_batches"]
        last = len(first.windows[-1])
        lines = [
            f"{self.world_size} ranks ({self.observed['backend']}, {self.model['device_type']}); per rank "
            f"{forwards} training forwards, {steps} optimizer steps",
            f"window: {self.length} micro-batches per step"
            + (f" (the last {last})" if last != self.length else "")
            + f"; {step_targets(first)} loss targets per step over all ranks",
            f"syncs: {first.seen['syncs']} on rank 0 ({first.seen['syncs'] / steps:.3g} per window), "
            f"{human_bytes(self.bytes_per_sync())} handed to the "
            f"{'reduce-scatters' if first.seen['sharded'] else 'all-reduce'} per sync",
        ]
        if first.seen["sharded"]:
            lines.append("the model under FSDP2's fully_shard: its reduce-scatters are the syncs, its shards averaged")
        if first.seen.get("made_by"):
            lines.append(f"the DDP model made by {first.seen['made_by']}, whose loop ran the windows")
        if first.seen.get("script_hook"):
            lines.append(f"the script's communication hook {first.seen['script_hook']} ran inside the watcher's count")
        return lines
