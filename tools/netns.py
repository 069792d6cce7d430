"""A slow link between nodes emulated on one machine, without touching the machine's own network: a network
namespace of the process's own (unshare --net) whose loopback, brought up with an Ethernet-sized MTU, is the
whole test network, limited by `tc qdisc ... tbf rate R`. The loopback carries both directions through one
queue, so the emulated link is half-duplex. Used by benchmarks/bench_network.py (as root).
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ddp_no_sync_lab.cli import LabError

LINK_MTU = 1500  # Ethernet's; the loopback's own 64 KiB frames would not pass a small token bucket
NAMESPACE_FILE_VARIABLE = "BENCH_NAMESPACE_FILE"


def check_prerequisites():
    if os.geteuid() != 0:
        raise LabError("needs root to make a network namespace and shape its loopback; run it with sudo")
    for tool in ("tc", "ip", "unshare", "taskset"):
        if shutil.which(tool) is None:
            package = "util-linux" if tool in ("unshare", "taskset") else "iproute2"
            raise LabError(f"needs {tool}, which is not on PATH; install {package} (apt-get install {package})")
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise LabError(
            f"this machine does not allow network namespaces (unshare --net: {probe.stderr.strip() or probe.returncode}); "
            f"run it where unshare --net works (a VM, or a container started with CAP_SYS_ADMIN)"
        )


def processes_in_namespace(inode):
    """PIDs whose network namespace is `inode` (the namespace exists while one of them does)."""
    found = []
    for link in Path("/proc").glob("[0-9]*/ns/net"):
        try:
            if os.stat(link).st_ino == inode:
                found.append(int(link.parent.parent.name))
        except OSError:
            continue
    return found


def run_in_namespace(script, arguments):
    """Run `script arguments` inside a new network namespace; afterwards make sure nothing of it is left."""
    with tempfile.NamedTemporaryFile(prefix="bench-network-ns-") as namespace_file:
        command = ["unshare", "--net", "--", sys.executable, str(script), *arguments]
        child = subprocess.Popen(command, env={**os.environ, NAMESPACE_FILE_VARIABLE: namespace_file.name})
        try:
            returncode = child.wait()
        finally:
            if child.poll() is None:
                child.terminate()
                child.wait()
            text = Path(namespace_file.name).read_text().strip()
            if text:
                left = processes_in_namespace(int(text))
                for pid in left:
                    os.kill(pid, signal.SIGKILL)
                print(
                    f"clean-up: {len(left)} process(es) were left in the benchmark's namespace"
                    if left
                    else "clean-up: no process left in the benchmark's namespace (it is gone, with its qdisc)",
                    file=sys.stderr,
                )
    return returncode


def command(*args):
    subprocess.run(args, check=True, capture_output=True, text=True)


def set_link(rate):
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)  # absent the first time
    if rate is not None:
        # A bucket of about a millisecond at the rate (at least two frames) keeps bursts short; the queue
        # holds 100 ms, so TCP sees a slow link, not drops.
        burst = max(int(rate * 1e6 / 8 / 1000), 2 * LINK_MTU + 100)
        command(
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            f"{rate:g}mbit",
            "burst",
            str(burst),
            "latency",
            "100ms",
        )


def bring_up_loopback():
    """Inside the namespace: record its identity for run_in_namespace's clean-up, and bring up its loopback."""
    Path(os.environ[NAMESPACE_FILE_VARIABLE]).write_text(str(os.stat("/proc/self/ns/net").st_ino))
    command("ip", "link", "set", "lo", "mtu", str(LINK_MTU), "up")
