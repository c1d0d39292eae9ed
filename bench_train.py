"""Training speed: one process without DDP against N processes with DDP, side by side.

    python bench_train.py                          # CPU: ResNet50 at 64 px, 2 x 1 thread vs 1 x 1 thread
    python bench_train.py --device cuda --image-size 224 --batches 256 --nproc 1 --amp bf16 --channels-last
    python bench_train.py --batches 32 --accum-steps 4 --configs single "ddp default"   # all-reduce every 4th

For each per-process batch size it runs every configuration in turn, each in fresh processes
(torchrun for DDP), on synthetic data already in memory, and times each optimizer step after
the warm-up steps; every configuration runs --repeats times, interleaved. The table shows the
median images/s per process over those runs (each run's own in brackets) and the scaling
efficiency: DDP images/s per process / single-process images/s (1.00 means communication costs
nothing), and the same against independent processes, which leaves out what sharing the
machine costs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

from train_ddp import amp_context, memory_format, register_comm_hook

# name -> worker flags. "single" is one process without DDP. "independent" runs --nproc
# processes without DDP (the "--nproc" marker is not passed on): what sharing the machine costs
# with no communication at all. The rest run --nproc processes with DDP; "ddp, all-reduce
# skipped" keeps all of DDP but its all-reduce, to split DDP's cost into bookkeeping and
# communication (its replicas drift apart: a measurement, not a way to train).
CONFIGS = {
    "single": ["--no-ddp"],
    "independent": ["--no-ddp", "--nproc"],
    "ddp default": [],
    "ddp, all-reduce skipped": ["--hook", "skip"],
    "ddp bucket 100 MB": ["--bucket-cap-mb", "100"],
    "ddp gradient_as_bucket_view": ["--gradient-as-bucket-view"],
    "ddp tuned": ["--bucket-cap-mb", "100", "--gradient-as-bucket-view", "--static-graph"],
    "ddp + fp16 hook": ["--hook", "fp16"],
    "ddp + bf16 hook": ["--hook", "bf16"],
    "ddp + powersgd": ["--hook", "powersgd"],
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--nproc", type=int, default=2, help="DDP processes (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64], help="per-process batch sizes")
    p.add_argument(
        "--accum-steps",
        type=int,
        default=1,
        help="micro-batches per optimizer step, as in train_ddp.py: DDP all-reduces on the last only",
    )
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=2, help="runs of every configuration, interleaved")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    # Worker-only flags, set by the driver.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--no-ddp", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bucket-cap-mb", type=float, default=25, help=argparse.SUPPRESS)
    p.add_argument("--gradient-as-bucket-view", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--static-graph", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--hook", choices=["none", "fp16", "bf16", "powersgd", "skip"], default="none", help=argparse.SUPPRESS
    )
    args = p.parse_args()
    if min(args.accum_steps, args.steps, args.nproc, args.threads, *args.batches) < 1:
        p.error("--accum-steps, --steps, --nproc, --threads and --batches must be positive integers")
    return args


def skip_all_reduce(state, bucket):
    """A DDP comm hook that hands back the local gradients as they are."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def worker(args):
    """Time `--steps` training steps after `--warmup`; rank 0 prints the step times as JSON."""
    torch.set_num_threads(args.threads)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # as train_ddp.py's setup_device: time its configuration
    torch.manual_seed(0)
    layout = memory_format(args)
    model = torchvision.models.get_model(args.arch, num_classes=1000).to(device, memory_format=layout)
    if not args.no_ddp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        model = DDP(
            model,
            device_ids=[local_rank] if device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_cap_mb,
            gradient_as_bucket_view=args.gradient_as_bucket_view,
            static_graph=args.static_graph,
        )
        if args.hook == "skip":
            model.register_comm_hook(None, skip_all_reduce)
        else:
            register_comm_hook(model, args.hook, warmup_steps=2)
    ddp_model = model  # no_sync() lives on the DDP wrapper, not on a compiled one
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    images = images.contiguous(memory_format=layout)
    labels = torch.randint(0, 1000, (args.batch,), device=device)
    autocast = amp_context(args, device)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for micro in range(args.accum_steps):
            last = micro == args.accum_steps - 1
            with nullcontext() if last or args.no_ddp else ddp_model.no_sync():
                with autocast:
                    loss = F.cross_entropy(model(images), labels) / args.accum_steps
                scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step is done when the GPU is, not when Python returns
        times.append(time.perf_counter() - start)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps({"step_seconds": times[args.warmup :]}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def run(args, batch, flags):
    """Start one configuration's processes and return its median step time in seconds."""
    common = [
        "--worker", "--batch", str(batch), "--device", args.device, "--threads", str(args.threads),
        "--arch", args.arch, "--image-size", str(args.image_size), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--amp", args.amp, "--accum-steps", str(args.accum_steps),
    ] + ["--channels-last"] * args.channels_last + ["--compile"] * args.compile  # fmt: skip
    if flags == ["--no-ddp"]:
        launcher = [sys.executable, __file__]
    else:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            __file__,
        ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    flags = [f for f in flags if f != "--nproc"]
    proc = subprocess.run(launcher + common + flags, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"bench_train: {' '.join(flags) or 'ddp default'} failed:\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    return statistics.median(json.loads(line)["step_seconds"])


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    print(
        f"{args.arch} at {args.image_size} px on {args.device}, amp {args.amp}, "
        f"channels_last {args.channels_last}, compile {args.compile}, "
        f"{args.threads} thread(s) per process, DDP on {args.nproc} processes, "
        f"{args.accum_steps} micro-batch(es) per step, "
        f"median of {args.steps} steps after {args.warmup} warm-up, torch {torch.__version__}"
    )
    print("| batch per process | configuration | images/s per process (runs) | vs single | vs independent |")
    print("|---|---|---|---|---|")
    for batch in args.batches:
        runs = {name: [] for name in args.configs}
        for _ in range(args.repeats):  # interleaved, so that drift in machine speed hits every configuration
            for name in args.configs:
                runs[name].append(batch * args.accum_steps / run(args, batch, CONFIGS[name]))
        speed = {name: statistics.median(r) for name, r in runs.items()}
        for name in args.configs:
            ratios = [f"{speed[name] / speed[base]:.2f}" if base in speed and base != name else "-"
                      for base in ("single", "independent")]  # fmt: skip
            spread = ", ".join(f"{r:.1f}" for r in runs[name])
            print(f"| {batch} | {name} | {speed[name]:.1f} ({spread}) | {' | '.join(ratios)} |", flush=True)


if __name__ == "__main__":
    main()
