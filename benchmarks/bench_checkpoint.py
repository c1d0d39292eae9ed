"""What a periodic checkpoint (train_ddp.py --save-every N) costs a training step on the CPU, against no save.

    python benchmarks/bench_checkpoint.py                        # ResNet-50, batch 16 at 32 px, 2 threads: 2 min on 2 idle cores
    python benchmarks/bench_checkpoint.py --arch resnet18 --rounds 2 --every 4   # quicker

One process, a process group of one (as train_ddp.py without a launcher), ResNet-50 (10 classes: its weights and SGD
momentum make a checkpoint of about 190 MB), train_ddp.py's own model, DDP wrapper, optimizer and Training, a last.pt
in a temporary directory, and one synthetic batch made once. train_ddp.save_checkpoint gathers the RNG states,
copies the state to host memory, and hands it to a writer thread (torch.save, fsync, rename);
a save first waits for the write before it. The step pays the copy and the gather; the write overlaps the steps after.

Each round runs a window of --every (K) steps of each variant in turn, so that drift in machine speed (other work on
the same cores) hits all alike: no save; a save every step (async, as train_ddp.py); a save at the first step of the
window (--save-every K); a save every step that then waits for its write (synchronous, for reference). A window ends
waiting for the write it started (timed), which in a run the next save would wait for. The table shows the median
over all steps of their own times, and the median over rounds of each window's mean step time (the cost spread over
K steps), each against no save; below it, the median time of the save_checkpoint call (with the writer idle: the
copy and gather) and of write_atomically alone, on the main thread with nothing else running.
"""
import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train_ddp.py, gather_utils.py

import guard
import train_ddp

VARIANTS = ["no save", "save every step (async)", "save every K steps (async)", "save every step, synchronous"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7, help="windows of every variant, interleaved (default 7)")
    p.add_argument("--every", type=int, default=10, help="K: steps per window, and --save-every (default 10)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    args = p.parse_args()
    if min(args.batch_size, args.image_size, args.rounds, args.every, args.threads) < 1:
        p.error("--batch-size, --image-size, --rounds, --every and --threads must be positive integers")
    return args


def bench(args, train_args, device):
    """{variant: seconds of each step}, {variant: each round's window mean}, the median seconds of a save_checkpoint
    call with the writer idle and of a write, and the checkpoint's bytes."""
    model, _ = train_ddp.build_model(train_args, None)
    ddp, _ = train_ddp.wrap_ddp(model, train_args, device)
    optimizer, scaler = train_ddp.build_optimizer(ddp, train_args)
    run = train_ddp.Training(ddp, ddp, ddp.module, optimizer, scaler, steps_per_epoch=10**9,
                             images_per_step=args.batch_size)
    data = train_ddp.SyntheticImages(args.batch_size, 10, args.image_size, seed=0, split="train")
    images, labels = zip(*(data[i] for i in range(args.batch_size)))
    batch = train_ddp.ModelInput(train_args, device)(torch.stack(images), torch.tensor(labels))
    path = guard.last_checkpoint(train_args)

    def step():  # as train_one_epoch's, for one micro-batch and no autocast
        loss = F.cross_entropy(run.model(batch[0]), batch[1])
        run.scaler.scale(loss).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        run.step, run.samples = run.step + 1, run.samples + args.batch_size

    def save():
        began = time.perf_counter()
        train_ddp.save_checkpoint(run, train_args)
        return time.perf_counter() - began

    def window(variant):
        """K steps of `variant`: the time of each, and the window's (with the wait for its last write)."""
        times, calls = [], []
        window_began = time.perf_counter()
        for k in range(args.every):
            began = time.perf_counter()
            step()
            if variant in (VARIANTS[1], VARIANTS[3]) or (variant == VARIANTS[2] and k == 0):
                calls.append(save())
            if variant == VARIANTS[3]:
                run.writer.written.result()
            times.append(time.perf_counter() - began)
        run.writer.written.result()
        return times, time.perf_counter() - window_began, calls

    window(VARIANTS[2])  # warm-up: the allocator, the optimizer's momentum, a first write
    size = path.stat().st_size
    steps = {variant: [] for variant in VARIANTS}
    windows = {variant: [] for variant in VARIANTS}
    idle_calls, writes = [], []
    for r in range(args.rounds):
        for variant in VARIANTS[r % 4:] + VARIANTS[:r % 4]:  # each first in turn: none always follows the write
            times, seconds, calls = window(variant)
            steps[variant] += times
            windows[variant].append(seconds / args.every)
            if variant in (VARIANTS[2], VARIANTS[3]):  # the writer was idle at each of these calls
                idle_calls += calls
        state = guard.on_host({"model": run.model.module.state_dict(), "optimizer": run.optimizer.state_dict()})
        began = time.perf_counter()
        guard.write_atomically(state, path)
        writes.append(time.perf_counter() - began)
        del state
    run.writer.shutdown()
    return steps, windows, statistics.median(idle_calls), statistics.median(writes), size


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint.") as directory:
        train_args = train_ddp.parse_args(["--arch", args.arch, "--batch-size", str(args.batch_size), "--image-size",
                                           str(args.image_size), "--checkpoint-dir", directory])
        with train_ddp.process_group(train_args, device):
            steps, windows, call, write, size = bench(args, train_args, device)
    print(f"{datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, {os.cpu_count()} CPUs ({cpu_model()}, "
          f"{platform.machine()}), {args.threads} torch thread(s), {args.arch}, batch {args.batch_size} at "
          f"{args.image_size} px, world of one (gloo), checkpoint {size / 1e6:.0f} MB in {tempfile.gettempdir()}, "
          f"{args.rounds} rounds of {args.every}-step windows")
    print("| variant | median step, ms | vs no save | mean step over a window, ms (each round's) | vs no save |")
    print("|---|---|---|---|---|")
    base_step, base_window = (statistics.median(times[VARIANTS[0]]) for times in (steps, windows))
    for variant in VARIANTS:
        step, window = statistics.median(steps[variant]), statistics.median(windows[variant])
        rounds = ", ".join(f"{1000 * seconds:.0f}" for seconds in windows[variant])
        print(f"| {variant.replace('K', str(args.every))} | {1000 * step:.1f} | {step / base_step:.2f} | "
              f"{1000 * window:.1f} ({rounds}) | {window / base_window:.2f} |")
    print(f"\nsave_checkpoint call, writer idle (state_dict, gather, copy to host): median {1000 * call:.1f} ms")
    print(f"write_atomically alone (torch.save, flush, fsync, rename of {size / 1e6:.0f} MB): median "
          f"{1000 * write:.1f} ms")


def cpu_model():
    """The CPU's name, from /proc/cpuinfo on Linux; elsewhere platform's word for it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "CPU"


if __name__ == "__main__":
    main()
