"""The control plane's cost per training step: the stop agreement of train_ddp.py against the design it replaced.

    python benchmarks/bench_control.py                          # 2, 4, 8 and 16 gloo ranks on this machine
    python benchmarks/bench_control.py --ranks 4 --steps 200 --repeats 9

Before every optimizer step the ranks agree whether to stop (a SIGTERM on one rank, an image one cannot read). The
design it replaced gathered every rank's (SIGTERM, problem) with all_gather_object before the step, blocking: its
latency, which gloo's ring makes grow with the ranks, added to every step. train_ddp.py's StopAgreement all-reduces
two flags, sent before the step ahead computes and read after it, so that the step hides their latency.

For each number of ranks, one torchrun launch: each rank trains a tiny DDP model (so that the control plane, not the
compute, dominates) for --steps steps with no agreement, with the old one and with the new one, in turn, --repeats
times, interleaved. The table shows rank 0's median time per step of each (each repeat's own in brackets), what each
agreement adds to a step, and the new design's addition as a share of the old one's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train_ddp.py, gather_utils.py

import gather_utils
import guard
import train_ddp

DESIGNS = ["no agreement", "all_gather_object before the step", "flags sent ahead"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16], help="world sizes (default 2 4 8 16)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per design and repeat (default 100)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of every design, interleaved (default 5)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def worker(args):
    """Rank 0 prints each design's seconds per step, one list of repeats each, as JSON."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(16, 32), torch.randint(0, 10, (16,))
    stop = guard.StopAgreement()
    steps_args = argparse.Namespace(accum_steps=1)

    def step(micro_batches):
        for images, labels in micro_batches:
            F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def run(design):
        batches = iter([batch] * (args.steps + 1))
        upcoming = train_ddp.next_step(batches, steps_args, stop) if design == DESIGNS[2] else None
        dist.barrier()
        began = time.perf_counter()
        for _ in range(args.steps):
            if design == DESIGNS[0]:
                step([next(batches)])
            elif design == DESIGNS[1]:  # as train_ddp.py did: every rank's notes, gathered before the step
                notes = gather_utils.all_gather_object((stop.requested, None))
                if any(requested for requested, _ in notes):
                    break
                step([next(batches)])
            else:  # as train_one_epoch does: the flags sent with the step ahead's batches, read before it
                if stop.agreed():
                    break
                micro_batches, upcoming = upcoming, train_ddp.next_step(batches, steps_args, stop)
                step(micro_batches)
        seconds = (time.perf_counter() - began) / args.steps
        if design == DESIGNS[2]:
            stop.agreed()  # the flags still on their way
        return seconds

    times = {design: [] for design in DESIGNS}
    for _ in range(args.repeats):  # interleaved, so that drift in machine speed hits every design
        for design in DESIGNS:
            times[design].append(run(design))
    if dist.get_rank() == 0:
        print(json.dumps(times), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    print(f"tiny DDP model (2 linear layers), 1 thread per rank, gloo, median of {args.repeats} repeats of "
          f"{args.steps} steps, torch {torch.__version__}, {os.cpu_count()} cores")
    print("| ranks | no agreement, ms/step | old: all_gather_object, ms/step (adds) | "
          "new: flags sent ahead, ms/step (adds) | new's addition / old's |")
    print("|---|---|---|---|---|")
    for ranks in args.ranks:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   __file__, "--worker", "--steps", str(args.steps), "--repeats", str(args.repeats)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if done.returncode != 0:
            sys.exit(f"bench_control.py: {ranks} ranks failed:\n{done.stderr[-3000:]}")
        times = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
        ms = {design: 1000 * statistics.median(times[design]) for design in DESIGNS}
        cells = [f"{ms[d]:.3f} ({', '.join(f'{1000 * t:.2f}' for t in times[d])})" for d in DESIGNS]
        old, new = (ms[d] - ms[DESIGNS[0]] for d in DESIGNS[1:])
        print(f"| {ranks} | {cells[0]} | {cells[1]} ({old:+.3f}) | {cells[2]} ({new:+.3f}) | "
              f"{new / old:.2f} |" if old > 0 else "- |", flush=True)


if __name__ == "__main__":
    main()
