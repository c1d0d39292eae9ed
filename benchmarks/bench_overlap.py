"""The share of DDP's gradient all-reduce time hidden behind the backward, read from the traces
that train_ddp.py --profile writes (gloo, on CPUs).

    python benchmarks/bench_overlap.py                     # the demo: 4 ranks, hooks none and fp16
    python benchmarks/bench_overlap.py --nproc 2 --comm-hooks none bf16 --repeats 3 --timeline
    python benchmarks/bench_overlap.py profile/            # the traces of a run already made

Without trace paths it runs `bash launch.sh N` (the demo's model and batch) once per --comm-hooks
entry and --repeats, interleaved, each for one short epoch of 8 steps (steps 4 to 6 traced), and
reads their traces. Per rank and traced step, on the main thread: the backward of the step's last
micro-batch, from its first op to its last; on gloo's threads: the gradient all-reduces, the
gloo:all_reduce events that start from then to the optimizer step (the stop agreement's start
before the forward, a log line's after the optimizer step). Their time is the length of their
union; the hidden part, what of it falls within the backward; the exposed rest is what the
optimizer step waits for. The table shows medians over the traced steps, per rank and over all.
"""
import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BACKWARD_OP = "autograd::engine::evaluate_function: "
STEPS = 8  # per epoch: the traced steps 4 to 6 are neither the first nor the last
RUN_TIMEOUT = 900


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="*", type=Path,
                   help="*.pt.trace.json files or directories of them; default: run the demo")
    p.add_argument("--nproc", type=int, default=4, help="processes (default 4, as the demo's)")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--batch-size", type=int, default=16, help="per process (default 16)")
    # Not powersgd: its plain all-reduce warm-up (train_ddp.py's lr warm-up) spans the traced steps.
    p.add_argument("--comm-hooks", nargs="+", default=["none", "fp16"],
                   choices=["none", "fp16", "bf16"])
    p.add_argument("--repeats", type=int, default=1, help="runs of each hook, interleaved")
    p.add_argument("--timeline", action="store_true",
                   help="also draw a step of the lowest rank: its median by the hidden share")
    args = p.parse_args()
    if min(args.nproc, args.batch_size, args.repeats) < 1:
        p.error("--nproc, --batch-size and --repeats must be positive integers")
    return args


def union(spans):
    """The spans (start, end) merged where they overlap, in order."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def length(spans):
    return sum(end - start for start, end in spans)


def within(spans, start, end):
    return [(max(a, start), min(b, end)) for a, b in spans if a < end and b > start]


def read_trace(path):
    """(rank, [step_figures of each traced step])."""
    try:
        trace = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"bench_overlap.py: {path}: {e}; expected a *.pt.trace.json file")
    events = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])
    spans = [(e["name"], e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events]
    main = {tid for name, tid, *_ in spans if name.startswith("ProfilerStep#")}
    all_reduces = [(a, b) for name, tid, a, b in spans
                   if name == "gloo:all_reduce" and tid not in main]
    if len(main) != 1 or not all_reduces:
        sys.exit(f"bench_overlap.py: {path}: no ProfilerStep or no gloo:all_reduce; expected a "
                 "trace of train_ddp.py --profile on gloo")
    on_main = [s for s in spans if s[1] in main]
    return trace["distributedInfo"]["rank"], [
        step_figures(step, [s for s in on_main if step[2] <= s[2] < step[3]], all_reduces)
        for step in on_main if step[0].startswith("ProfilerStep#")]


def step_figures(step, in_step, all_reduces):
    """The figures of the header above, in ms, and the spans that --timeline draws."""
    name, _, step_start, step_end = step
    forwards = [s[2:] for s in in_step if s[0] == "DistributedDataParallel.forward"]
    backward_ops = [s[2:] for s in in_step if s[0].startswith(BACKWARD_OP)]
    optimizer = [s[2:] for s in in_step if s[0].startswith("Optimizer.step#")]
    last = [(a, b) for a, b in backward_ops if a > forwards[-1][1]]  # the last micro-batch's
    window = (last[0][0], last[-1][1])
    waited_for = optimizer[0][0] if optimizer else step_end  # a skipped step (--amp fp16) has none
    gradients = union((a, b) for a, b in all_reduces if window[0] <= a < waited_for)
    hidden = length(within(gradients, *window))
    return {"name": name, "start": step_start, "step": (step_end - step_start) / 1e3,
            "backward": (window[1] - window[0]) / 1e3, "all-reduce": length(gradients) / 1e3,
            "exposed": (length(gradients) - hidden) / 1e3,
            "hidden": hidden / length(gradients) if gradients else float("nan"),
            "spans": {"forward": forwards, "backward": union(backward_ops),
                      "all-reduce": gradients, "optimizer": optimizer}}


def trace_files(paths):
    files = [f for p in paths for f in (sorted(p.glob("*.pt.trace.json")) if p.is_dir() else [p])]
    if not files:
        sys.exit(f"bench_overlap.py: no *.pt.trace.json in {' '.join(map(str, paths))}")
    return files


def add(by_config, config, paths):
    """The steps of the traces under `paths`, to by_config[config][rank]."""
    for rank, steps in map(read_trace, trace_files(paths)):
        by_config.setdefault(config, {}).setdefault(rank, []).extend(steps)


def run_demo(args, hook, directory):
    """One `bash launch.sh N` run of one short epoch with --profile; its trace directory."""
    traces = directory / "traces"
    command = ["bash", str(ROOT / "launch.sh"), str(args.nproc), "--arch", args.arch,
               "--batch-size", str(args.batch_size), "--comm-hook", hook, "--epochs", "1",
               "--train-samples", str(args.nproc * args.batch_size * STEPS), "--val-samples", "64",
               "--checkpoint-dir", str(directory), "--profile", str(traces)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # launch.sh passes it on to its workers and stops
        out, _ = proc.communicate(timeout=60)
        sys.exit(f"bench_overlap.py: timed out after {RUN_TIMEOUT} s: {' '.join(command)}\n{out}")
    if proc.returncode != 0:
        sys.exit(f"bench_overlap.py: exit {proc.returncode}: {' '.join(command)}\n{out}")
    return traces


def median(steps, key):
    return statistics.median(step[key] for step in steps)


def print_table(by_config):
    columns = ["step", "backward", "all-reduce", "exposed"]
    print(f"{'hook':<10}{'rank':>5}{'steps':>6}" + "".join(f"{c + ' ms':>15}" for c in columns)
          + f"{'hidden':>9}")
    for config, by_rank in by_config.items():
        rows = [*sorted(by_rank.items()), ("all", [s for steps in by_rank.values() for s in steps])]
        for rank, steps in rows:
            print(f"{config:<10}{rank:>5}{len(steps):>6}"
                  + "".join(f"{median(steps, c):>15.1f}" for c in columns)
                  + f"{median(steps, 'hidden'):>9.0%}")
    if len(by_config) > 1:
        (base, first), *others = [(c, [s for steps in r.values() for s in steps])
                                  for c, r in by_config.items()]
        for config, steps in others:
            print(f"{config} against {base}, medians over all ranks: all-reduce x"
                  f"{median(steps, 'all-reduce') / median(first, 'all-reduce'):.2f}, exposed x"
                  f"{median(steps, 'exposed') / median(first, 'exposed'):.2f}, step x"
                  f"{median(steps, 'step') / median(first, 'step'):.2f}")


def draw(step, rank, width=72):
    """One step as text: a row per kind of span, a column per step / width."""
    scale = width / (step["step"] * 1e3)
    print(f"\nrank {rank}, {step['name']} ({step['step']:.0f} ms; a column is "
          f"{step['step'] / width:.1f} ms; all-reduce: gloo's threads, the rest the main thread)")
    for row, spans in step["spans"].items():
        line = [" "] * width
        for start, end in spans:
            first = int((start - step["start"]) * scale)
            for column in range(first, max(first + 1, round((end - step["start"]) * scale))):
                line[min(column, width - 1)] = "=" if row == "all-reduce" else "#"
        print(f"{row:<11}|{''.join(line)}|")


def main():
    args = parse_args()
    by_config = {}
    if args.traces:
        add(by_config, "traces", args.traces)
    else:
        print(f"bench_overlap.py: bash launch.sh {args.nproc} --arch {args.arch} --batch-size "
              f"{args.batch_size} --epochs 1, {STEPS} steps, steps 4-6 traced; {args.repeats} "
              f"run(s) per hook; torch {torch.__version__}, {datetime.date.today()}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):
                for hook in args.comm_hooks:
                    add(by_config, hook, [run_demo(args, hook, Path(tmp) / f"{hook}-{repeat}")])
    print_table(by_config)
    if args.timeline:
        by_rank = next(iter(by_config.values()))
        steps = sorted(by_rank[min(by_rank)], key=lambda step: step["hidden"])
        draw(steps[len(steps) // 2], min(by_rank))


if __name__ == "__main__":
    main()
