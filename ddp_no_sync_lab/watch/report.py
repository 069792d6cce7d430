"""The watcher's verdict as it is printed: the ten items' findings, what the loop was found to be, the notes, and
the last line (AUDIT PASSED, FAILED, INCOMPLETE, or NOTHING AUDITED); the document's items as a foreign loop keeps
them."""

from dataclasses import dataclass, field

from ddp_no_sync_lab.checks.certify import ITEMS

# The document's items as a foreign loop keeps them (its Romanian text is certify.ITEMS').
GLOSSES = (
    "one process per rank (per GPU on CUDA)",
    "each rank its own samples; a shuffling sampler's epoch set at each pass",
    "every sample a step trains on reaches its loss",
    "each window's losses weigh one mean over the window and the ranks",
    "the window's other micro-batches: forward and backward without a sync",
    "the window's last micro-batch synchronized: the ranks' mean gradient",
    "zero_grad() only after the step; the gradients untouched between backwards",
    "one optimizer step per window",
    "one sync per window",
    "the lab's own artifacts (report.json)",
)
# The order a refusal is looked for in: a cause before the items its effects would break.
REFUSAL_ORDER = (1, 2, 8, 7, 5, 6, 4, 3, 9)
PASS, FAIL, UNSEEN = "✓", "✗", "—"


@dataclass
class Finding:
    mark: str
    seen: str
    refusal: str | None = None


@dataclass
class Verdict:
    """The ten items as judged, what the loop was found to be, the notes, and the line that ends the report."""

    findings: dict = field(default_factory=dict)  # item number: Finding
    found: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    nothing: str | None = None  # why nothing could be judged
    unobserved: str | None = None  # which items could not be observed, and why

    @property
    def refusal(self):
        for number in REFUSAL_ORDER:
            finding = self.findings.get(number)
            if finding is not None and finding.refusal is not None:
                return f"{finding.refusal} [checklist item {number}: {GLOSSES[number - 1]}]"
        return None

    @property
    def passed(self):
        return self.nothing is None and self.refusal is None and self.unobserved is None

    def last_line(self):
        """AUDIT FAILED where an item observed was broken; else AUDIT INCOMPLETE where items went unobserved (nothing
        unchecked is passed); else AUDIT PASSED."""
        if self.nothing is not None:
            return f"NOTHING AUDITED: {self.nothing}"
        if self.refusal is not None:
            return f"AUDIT FAILED: {self.refusal}"
        return f"AUDIT INCOMPLETE: {self.unobserved}" if self.unobserved is not None else "AUDIT PASSED"

    def report(self, script):
        lines = [f"The document's checklist on {script}, as its ranks ran it (ddp_no_sync_lab.watch; docs/watch.md):"]
        lines += [f"  {line}" for line in self.found]
        if self.findings:
            lines += ["| # | item (document) | on this loop | | seen |", "|---:|---|---|:---:|---|"]
            for number, ((text, _), gloss) in enumerate(zip(ITEMS, GLOSSES), start=1):
                finding = self.findings[number]
                lines.append(f"| {number} | {text} | {gloss} | {finding.mark} | {finding.seen} |")
        lines += [f"note: {note}" for note in self.notes]
        lines.append(self.last_line())
        return "\n".join(lines)


def human_bytes(count):
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.3g} {unit}" if unit != "B" else f"{count:.0f} B"
        count /= 1000
    return None
