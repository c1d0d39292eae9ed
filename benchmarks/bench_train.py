"""Training speed: one process without DDP against N processes with DDP, side by side.

    python benchmarks/bench_train.py                          # CPU: ResNet50 at 64 px, 2 x 1 thread vs 1 x 1 thread
    python benchmarks/bench_train.py --device cuda --image-size 224 --batches 256 --nproc 1 --amp bf16 --channels-last
    python benchmarks/bench_train.py --batches 32 --accum-steps 4 --configs single "ddp default"   # all-reduce every 4th
    python benchmarks/bench_train.py --compile --configs single "ddp default"   # each configuration eager and compiled
    python benchmarks/bench_train.py --hosts 1gbit 10gbit --batches 32 --configs single "ddp default" "ddp + powersgd"

With --hosts RATE..., the DDP processes run one per host on hosts.py's network namespaces, over links capped at
each RATE (tc's token bucket; needs root), against the single process on this machine: where communication
hooks pay. The loss column is the mean training loss of the timed steps, on train_ddp.py's synthetic images.

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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train_ddp.py, gather_utils.py

from tools import hosts
from train_ddp import ModelInput, SyntheticImages, amp_context, memory_format, register_comm_hook

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
    p.add_argument("--compile", action="store_true", help="also run each configuration with torch.compile")
    p.add_argument("--hosts", nargs="+", metavar="RATE", help="run DDP on --nproc hosts over links of these rates")
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
    ddp_model = model  # no_sync() lives on the DDP wrapper
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = synthetic_batches(args, device)
    autocast = amp_context(args, device)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        images, labels = batches[step % len(batches)]
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
        losses.append(loss.detach() * args.accum_steps)
    if int(os.environ.get("RANK", 0)) == 0:
        loss = torch.stack(losses[args.warmup :]).mean().item()
        print(json.dumps({"step_seconds": times[args.warmup :], "loss": loss}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def synthetic_batches(args, device):
    """Eight batches of train_ddp.py's synthetic images, already on the device, each rank its own."""
    images = SyntheticImages(10**9, 10, args.image_size, seed=0, split="train")
    first = 8 * args.batch * int(os.environ.get("RANK", 0))
    to_input, batches = ModelInput(args, device), []
    for k in range(8):
        pairs = [images[first + k * args.batch + i] for i in range(args.batch)]
        images_and_labels = torch.stack([image for image, _ in pairs]), torch.tensor([label for _, label in pairs])
        batches.append(to_input(*images_and_labels))
    return batches


def run(args, batch, flags, compiled, rate):
    """Run one configuration's processes: its median step time in seconds, and its loss."""
    common = [
        "--worker", "--batch", str(batch), "--device", args.device, "--threads", str(args.threads),
        "--arch", args.arch, "--image-size", str(args.image_size), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--amp", args.amp, "--accum-steps", str(args.accum_steps),
    ] + ["--channels-last"] * args.channels_last + ["--compile"] * compiled  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    command = [*common, *[f for f in flags if f != "--nproc"]]
    if flags == ["--no-ddp"]:
        outputs = [subprocess.run([sys.executable, __file__, *command], capture_output=True, text=True, env=env,
                                  timeout=1800)]
    elif rate:  # one process on each host, which reach each other over links of that rate
        with hosts.Hosts(args.nproc, rate=rate) as on:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nproc), "--master-addr",
                        on.address(0), "--master-port", "29500", "--nproc-per-node", "1"]
            host_env = dict(env, GLOO_SOCKET_IFNAME="eth0")
            procs = [on.start(i, [*launcher, "--node-rank", str(i), __file__, *command], host_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(args.nproc)]
            outputs = [subprocess.CompletedProcess(p.args, 0, *p.communicate(timeout=1800)) for p in procs]
            for output, proc in zip(outputs, procs):
                output.returncode = proc.returncode
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        outputs = [subprocess.run([*launcher, __file__, *command], capture_output=True, text=True, env=env,
                                  timeout=1800)]
    for output in outputs:
        if output.returncode != 0:
            sys.exit(f"bench_train: {' '.join(flags) or 'ddp default'} failed:\n{output.stderr[-3000:]}")
    result = json.loads([line for line in outputs[0].stdout.splitlines() if line.startswith("{")][-1])
    return statistics.median(result["step_seconds"]), result["loss"]


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    where = f"on {args.nproc} hosts" if args.hosts else f"on {args.nproc} processes"
    print(
        f"{args.arch} at {args.image_size} px on {args.device}, amp {args.amp}, "
        f"channels_last {args.channels_last}, {args.threads} thread(s) per process, DDP {where}, "
        f"{args.accum_steps} micro-batch(es) per step, "
        f"median of {args.steps} steps after {args.warmup} warm-up, torch {torch.__version__}"
    )
    print("| link | batch per process | configuration | images/s per process (runs) | vs single | vs independent "
          "| loss |")
    print("|---|---|---|---|---|---|---|")
    variants = [(name, compiled) for name in args.configs for compiled in [False, True][: 1 + args.compile]]
    for rate in args.hosts or [None]:
        for batch in args.batches:
            runs = {variant: [] for variant in variants}
            losses = {variant: [] for variant in variants}
            for _ in range(args.repeats):  # interleaved, so that drift in machine speed hits every configuration
                for name, compiled in variants:
                    seconds, loss = run(args, batch, CONFIGS[name], compiled, rate if name != "single" else None)
                    runs[name, compiled].append(batch * args.accum_steps / seconds)
                    losses[name, compiled].append(loss)
            speed = {variant: statistics.median(r) for variant, r in runs.items()}
            for name, compiled in variants:
                ratios = [f"{speed[name, compiled] / speed[base, compiled]:.2f}"
                          if (base, compiled) in speed and base != name else "-" for base in ("single", "independent")]
                spread = ", ".join(f"{r:.1f}" for r in runs[name, compiled])
                print(f"| {rate or 'this machine'} | {batch} | {name}{', compiled' * compiled} | "
                      f"{speed[name, compiled]:.1f} ({spread}) | {' | '.join(ratios)} | "
                      f"{statistics.median(losses[name, compiled]):.3f} |", flush=True)


if __name__ == "__main__":
    main()
