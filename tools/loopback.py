"""Several torchrun nodes emulated on one machine, for the tests and the network benchmark: one process per
node, c10d rendezvous hosted by node 0, every connection on 127.0.0.1 (docs/across-machines.md has the commands
for real machines, where only the endpoint and each node's own address differ).
"""

import socket
import sys


def free_loopback_port():
    """A TCP port free on 127.0.0.1 now, for the rendezvous of a run emulated on one machine."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def loopback_node_command(node, nodes, port, script_args, restarts=0):
    """The torchrun command of node `node` of a multi-node run emulated on one machine (the tests, the
    network benchmark): one process per node, c10d rendezvous hosted by node 0, all traffic on 127.0.0.1;
    torchrun restarts a failed worker group `restarts` times.
    On real machines only the endpoint and the node's own address differ (docs/across-machines.md)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--node-rank={node}",
        "--nproc-per-node=1",
        f"--max-restarts={restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=lab-{port}",
        f"--rdzv-conf=is_host={int(node == 0)}",
        "--local-addr=127.0.0.1",
        *map(str, script_args),
    ]
