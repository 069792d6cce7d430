"""Errors and command-line helpers shared by the scripts: one line that names the input and the remedy, no
traceback; argparse with such lines; progress on stderr.
"""

import argparse
import os
import sys
import time


class LabError(Exception):
    """A mistake in the input or the environment: reported as one line that names the remedy, no traceback.

    kind, when given, is the exception name the document's troubleshooting uses for this case
    ("ValueError: expected world_size=2, got 1"), kept so that the message can be searched for.
    broken_process: torch's own state in this process is broken (an internal assert): it ends at once, without
    running destructors that would abort it.
    """

    exit_code = 2

    def __init__(self, message, kind=None, broken_process=False):
        super().__init__(message)
        self.kind = kind
        self.broken_process = broken_process

    def line(self, script):
        return f"{self.kind}: {self}" if self.kind else f"{script}: error: {self}"


def exit_with(error, script, show=True, at_once=False):
    """The error's line, then its exit code; at once (os._exit, output flushed) for a broken process or when
    asked: without the interpreter's finalization."""
    if show:
        print(error.line(script), file=sys.stderr, flush=True)
    if error.broken_process or at_once:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(error.exit_code)
    sys.exit(error.exit_code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: the problem and where to look, without the usage block."""

    def usage_error(self, message):
        return LabError(f"{message} (see: python {self.prog} --help)")

    def error(self, message):
        # A script under torchrun (the benchmarks) parses the same options in every process: one line per node.
        exit_with(self.usage_error(message), self.prog, show=os.environ.get("LOCAL_RANK", "0") == "0")


def whole_number(text, least):
    """argparse's type for a whole number of at least `least` (0 or 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {'positive ' * least}whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text):
    return whole_number(text, 1)


def non_negative_int(text):
    return whole_number(text, 0)


def non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def positive_float(text):
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


class Progress:
    """Rank 0's progress on stderr, one line at most every `interval` seconds; stdout keeps the JSON lines."""

    def __init__(self, enabled, interval):
        self.enabled = enabled
        self.interval = interval
        self.prefix = ""

    def start(self, label, total, unit):
        self.label, self.total, self.unit = f"{self.prefix}{label}", total, unit
        self.started = self.last_line = time.perf_counter()

    def update(self, done, samples):
        now = time.perf_counter()
        if not self.enabled or now - self.last_line < self.interval:
            return
        self.last_line = now
        elapsed = now - self.started
        left = elapsed / done * (self.total - done)
        print(
            f"{self.label}: {done}/{self.total} {self.unit}, {samples / elapsed:.0f} samples/s per rank, "
            f"about {left:.0f} s left",
            file=sys.stderr,
            flush=True,
        )
