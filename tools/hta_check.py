"""A profiled run's traces read by HolisticTraceAnalysis (HTA), the standard analyser of distributed PyTorch
traces: one Chrome trace per rank (train.py --profile-windows K writes them, each naming its rank in
distributedInfo), loaded together, and what HTA can say of them.

    pip install HolisticTraceAnalysis==0.5.0     # an optional check: not among the lab's requirements
    python tools/hta_check.py artifacts/no_sync

HTA's analyses (temporal breakdown, communication/computation overlap, idle time, kernel breakdown) read the
GPU streams' kernels. On GPUs, the overlap of communication and computation per rank is no_sync's story in
HTA's own terms: `every` syncs after each micro-batch, `no_sync` once per window. A CPU run's traces hold no
GPU kernels: HTA loads them, and this script says that its GPU analyses have nothing to read.
"""

import json
import shutil
import tempfile
from pathlib import Path

from ddp_no_sync_lab.cli import ArgumentParser, LabError, exit_with
from ddp_no_sync_lab.files import PROFILE_TRACE_FILE, RUN_RECORD_FILE

SCRIPT = "hta_check.py"


def rank_traces(run_folder):
    """The run's per-rank trace files, checked to name their ranks."""
    record_path = run_folder / RUN_RECORD_FILE
    if not record_path.is_file():
        raise LabError(f"{record_path} is missing: pass a run folder written by train.py (e.g. artifacts/no_sync)")
    world_size = json.loads(record_path.read_text())["config"]["world_size"]
    traces = [run_folder / PROFILE_TRACE_FILE.format(rank=rank) for rank in range(world_size)]
    missing = [str(trace) for trace in traces if not trace.is_file()]
    if missing:
        raise LabError(
            f"{run_folder} holds no profiler traces ({', '.join(missing)}): run train.py with --profile-windows K"
        )
    for rank, trace in enumerate(traces):
        named = json.loads(trace.read_bytes()).get("distributedInfo", {}).get("rank")
        if named != rank:
            raise LabError(f"{trace}: its distributedInfo names rank {named!r}, not {rank}")
    return traces


def has_gpu_kernels(trace_file):
    return any(event.get("cat") == "kernel" for event in json.loads(trace_file.read_bytes()).get("traceEvents", []))


def main():
    parser = ArgumentParser(prog=SCRIPT, description=__doc__.splitlines()[0])
    parser.add_argument("run_folder", type=Path, help="a run folder of train.py --profile-windows K")
    args = parser.parse_args()
    try:
        traces = rank_traces(args.run_folder)
        try:
            from hta.trace_analysis import TraceAnalysis
        except ImportError:
            raise LabError("HolisticTraceAnalysis is not installed: pip install HolisticTraceAnalysis==0.5.0") from None
    except LabError as error:
        exit_with(error, SCRIPT)
    with tempfile.TemporaryDirectory(prefix="hta-") as folder:  # HTA reads every trace file of one folder
        for trace in traces:
            shutil.copy(trace, folder)
        analyzer = TraceAnalysis(trace_dir=folder)
        ranks = sorted(analyzer.t.get_ranks())
        print(f"HTA loaded the traces of ranks {ranks} from {args.run_folder}")
        if not any(has_gpu_kernels(trace) for trace in traces):
            print(
                "no GPU kernels in these traces (a CPU run): HTA's analyses read the GPU streams and have nothing to read here"
            )
            return
        print("temporal breakdown per rank (idle, compute, non-compute time of the GPU):")
        print(analyzer.get_temporal_breakdown(visualize=False).to_string())
        print("communication/computation overlap per rank (the share of communication time overlapped by compute):")
        print(analyzer.get_comm_comp_overlap(visualize=False).to_string())


if __name__ == "__main__":
    main()
