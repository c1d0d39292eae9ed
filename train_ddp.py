"""Train an image classifier with DistributedDataParallel, on GPUs (NCCL) or on CPUs (gloo).

    bash launch.sh 4                                        # 4 processes, a free port, a dry run
    torchrun --standalone --nproc-per-node 4 train_ddp.py   # the same by hand
    python train_ddp.py                                     # one process, no launcher

Without --data it trains on synthetic images made in memory. main() is the table of contents;
guard.py beside it holds the checks and the safety nets a reader can skip (docs/training.md).
"""
import signal

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # SLURM's and Kubernetes', a terminal's Ctrl-C
if __name__ == "__main__":  # one during the slow imports waits for main() to act on it
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)  # not the ignore that torchrun may pass on

import argparse
import datetime
import gc
import json
import math
import os
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import v2

import gather_utils
import guard

# On 2 CPU cores `bash launch.sh 4` takes minutes (docs/training.md); on GPUs, a real ResNet-50.
DEVICE_DEFAULTS = {
    "cpu": dict(image_size=32, train_samples=2048, val_samples=500, batch_size=16, workers=0,
                lr=0.005),
    "cuda": dict(image_size=224, train_samples=64000, val_samples=10000, batch_size=64, workers=6,
                 lr=0.1),
}
ARCHS = torchvision.models.list_models(module=torchvision.models)
# Synthetic images: a pattern per class of about 7 gray levels under noise of 48. One image is
# ambiguous, the class shows only over many pixels: accuracy climbs for epochs and stays below 100%.
SYNTHETIC_PATTERN, SYNTHETIC_NOISE = 9.6, 48
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # torchvision's weights'
SMALL_IMAGE_MAX_SIZE = 64  # up to it (CIFAR) images train whole: not random-resized crops of 8%
COMPILE_TIMEOUT = 1800  # what collectives wait for the ranks' compilation: see train_one_epoch

def main(argv=None):
    args = parse_args(argv)  # 1. arguments
    # Read before the process group forms: a bad file fails fast, and every rank with it.
    resume_from, checkpoint = load_checkpoint(args)  # --resume, or this job's last.pt
    # Training notes a SIGTERM or Ctrl-C, also one held since the first line, and stops at its next
    # step, saved; a dry run or --evaluate, with nothing to save, ends at once.
    stop = None if args.evaluate or args.dry_run else guard.StopAgreement()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if args.dry_run:
        return
    device = setup_device(args)  # 2. device
    with process_group(args, device):  # 3. process group; 8. clean-up when the block ends
        train_or_evaluate(args, device, resume_from, checkpoint, stop)
    if stop is not None:  # the exit code by which a launcher or scheduler goes on
        stop.exit(args)

# ------------------------------------------------------------------------------- 1. arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="DDP training of a torchvision classifier "
                                            "(docs/training.md lists every flag).")
    p.error = guard.fail  # one line, not argparse's usage, from every rank
    p.add_argument("--local-rank", "--local_rank", type=int, default=guard.env_local_rank(),
                   help="set by torch.distributed.launch (default: LOCAL_RANK, else SLURM_LOCALID)")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    p.add_argument("--init-timeout", type=float, default=60, help="seconds for all ranks to join")
    p.add_argument("--collective-timeout", type=float, default=600, help="seconds one may wait")
    p.add_argument("--data", help="ImageFolder root with train/ and val/; default: synthetic data")
    p.add_argument("--train-samples", type=int, help="synthetic train images (CPU 2048, GPU 64000)")
    p.add_argument("--val-samples", type=int, help="synthetic val images (CPU 500, GPU 10000)")
    p.add_argument("--num-classes", type=int, default=10, help="synthetic classes")
    p.add_argument("--image-size", type=int, help="crop size (CPU 32, GPU 224)")
    p.add_argument("--workers", type=int, help="DataLoader workers per process (CPU 0, GPU 6)")
    p.add_argument("--no-flip", action="store_true", help="no horizontal flip")
    p.add_argument("--arch", default="resnet50", choices=ARCHS, metavar="NAME",
                   help="a torchvision classification model (default resnet50)")
    p.add_argument("--weights", help="a torchvision name for --arch's weights (IMAGENET1K_V2, "
                                     "DEFAULT), or a file: a state dict or a last.pt")
    p.add_argument("--compile", action="store_true", help="torch.compile the model after DDP")
    p.add_argument("--sync-bn", action="store_true", help="batch-norm statistics over all ranks")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off", help="autocast dtype")
    p.add_argument("--comm-hook", choices=["none", "fp16", "bf16", "powersgd"], default="none")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, help="per process (CPU 16, GPU 64)")
    p.add_argument("--accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, help="peak learning rate (CPU 0.005, GPU 0.1)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=float, default=1, help="linear warm-up, then cosine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="optimizer steps between log lines")
    p.add_argument("--checkpoint-dir", default="checkpoints", help="where rank 0 writes last.pt")
    p.add_argument("--save-every", type=int, help="also save every N optimizer steps")
    p.add_argument("--resume", help="checkpoint to continue from")
    p.add_argument("--evaluate", action="store_true", help="validate --resume or --weights, exit")
    p.add_argument("--metrics-file", help="rank 0 appends one JSON line per epoch here")
    p.add_argument("--profile", metavar="DIR", help="trace steps 4-6 of the first epoch, per rank")
    p.add_argument("--dry-run", action="store_true", help="check arguments and files, then exit")
    p.set_defaults(resize=None, interpolation="bilinear")  # validation's resize, before its crop
    # This device's defaults, or --weights' recipe; then every check that needs no process group.
    return guard.settle_args(p.parse_args(argv), DEVICE_DEFAULTS)

# ---------------------------------------------------------------------------------- 2. device
def setup_device(args):
    # Before any CUDA work: otherwise every rank makes its context and tensors on GPU 0.
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = guard.gpu_index(args.local_rank)  # the local rank's, or the one GPU an srun task sees
    torch.cuda.set_device(index)
    torch.backends.cudnn.benchmark = True  # fixed input sizes: time the conv kernels once
    guard.raise_nccl_timeouts(args)  # read as NCCL starts
    return torch.device("cuda", index)

# --------------------------------------------------------------------------- 3. process group
@contextmanager
def process_group(args, device):
    init_distributed(args, device)
    try:
        yield
        # A compiled model leaves reference cycles that hold the group past its end: freed at
        # Python's exit instead, the group's threads would abort it (docs/troubleshooting.md).
        gc.collect()
        # Every rank reaches the end on each backend (NCCL, gloo): a group destroyed early can hang.
        # Both issued before either is waited for, as the old torch's exit hang needs (testing.md).
        barrier = dist.barrier(async_op=True)
        reduced = dist.all_reduce(torch.zeros(1), async_op=True)
        barrier.wait()
        reduced.wait()
    except RuntimeError as e:  # a rank gone (gloo's connections closed or timed out, NCCL's error)
        guard.collective_failed(e, args)  # one line per rank; any other error goes on up
    finally:
        dist.destroy_process_group()

def init_distributed(args, device):
    """The ranks meet within --init-timeout (rendezvous and connections), or each says why."""
    rank, world_size = guard.world_from_env()
    # On GPUs one group, two backends: NCCL for CUDA tensors, gloo for the small CPU ones.
    backend = "cpu:gloo,cuda:nccl" if args.backend == "nccl" else args.backend
    bind = {"device_id": device} if device.type == "cuda" else {}  # NCCL's communicator, at once
    timeout = datetime.timedelta(seconds=args.init_timeout)
    try:
        # The launcher's store, as init_method="env://" would make it, but one per restart attempt.
        if world_size == 1 and "MASTER_ADDR" not in os.environ:  # no launcher: one in memory
            store = dist.HashStore()
        else:
            store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
            store = guard.store_of_this_attempt(store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout, **bind)
        dist.barrier()
        gather_utils.all_gather_object(None)  # on GPUs gloo's first collective: its problems now
    except (RuntimeError, ValueError) as e:
        guard.rank_error(guard.init_failure(e, args, world_size))
    guard.set_collective_timeout(args.collective_timeout)

# --------------------------------------------------------------- 4. to 7., in the process group
def train_or_evaluate(args, device, resume_from, checkpoint, stop):
    """A function of its own: the DDP model is freed before process_group() ends the group."""
    guard.check_same_start(checkpoint)
    train_set, val_set = build_datasets(args)  # 4. data
    global_batch = args.batch_size * args.accum_steps * dist.get_world_size()
    steps = steps_per_epoch(train_set, global_batch, args)
    model, new_layers = build_model(args, checkpoint)  # 5. model, the same on every rank
    torch.manual_seed(args.seed + dist.get_rank())  # from here, one random stream per rank
    to_input = ModelInput(args, device)
    if args.evaluate:
        model = model.to(device, memory_format=memory_format(args))
        metrics = validate(model, val_set, args, to_input)
        append_metrics(args, {"epoch": checkpoint["epoch"] if checkpoint else 0, **metrics})
        return log(json.dumps(metrics))
    ddp, trained = wrap_ddp(model, args, device)
    optimizer, scaler = build_optimizer(ddp, args)
    run = Training(trained, ddp, ddp.module, optimizer, scaler, steps_per_epoch=steps,
                   images_per_step=global_batch)
    if checkpoint:
        restore_training_state(checkpoint, run)
        log_resume(resume_from, checkpoint, args, run)
        checkpoint.clear()  # the model and optimizer have what they need: free the rest
    register_comm_hook(ddp, args, run)
    log_start(args, device, train_set, val_set, run, new_layers)
    with run.writer:  # its end waits for the last checkpoint write, also on an error
        fit(run, train_set, val_set, args, to_input, stop)

# ------------------------------------------------------------------------------------ 4. data
class SyntheticImages(Dataset):
    """A learnable stand-in for ImageNet: a smooth pattern per class under noise, as uint8 images.
    Image i is made on demand from (seed, split, i): every rank and every run sees the same data."""

    def __init__(self, num_samples, num_classes, image_size, seed, split):
        coarse = torch.randn(num_classes, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
        self.patterns = F.interpolate(coarse, size=image_size, mode="bilinear", align_corners=False)
        self.num_samples = num_samples
        self.noise_seed = (seed * 2 + (split == "val") + 1) << 32

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        label = index % len(self.patterns)  # labels cycle through the classes
        generator = torch.Generator().manual_seed(self.noise_seed + index)
        noise = torch.randn(self.patterns.shape[1:], generator=generator)
        image = 128 + SYNTHETIC_PATTERN * self.patterns[label] + SYNTHETIC_NOISE * noise
        return image.round_().clamp_(0, 255).to(torch.uint8), label

def build_datasets(args):
    """uint8 images, as the loader's workers hand them over; ModelInput makes them the model's."""
    if not args.data:
        return [SyntheticImages(size, args.num_classes, args.image_size, args.seed, split)
                for size, split in [(args.train_samples, "train"), (args.val_samples, "val")]]
    size = args.image_size
    if size <= SMALL_IMAGE_MAX_SIZE:  # the whole image (squared), padded by 1/8 and cropped back
        val = [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
        train = val + [v2.RandomCrop(size, padding=size // 8)]
    else:  # ImageNet's recipe
        interpolation = v2.InterpolationMode(args.interpolation)
        train = [v2.RandomResizedCrop(size, interpolation=interpolation, antialias=True)]
        val = [v2.Resize(args.resize, interpolation=interpolation, antialias=True),
               v2.CenterCrop(size)]
    train += [] if args.no_flip else [v2.RandomHorizontalFlip()]
    # allow_empty: a class without val images keeps its label (check_image_folder matched them).
    return [torchvision.datasets.ImageFolder(Path(args.data) / split, v2.Compose(transforms),
                                             loader=guard.read_image, allow_empty=True)
            for split, transforms in [("train", train), ("val", val)]]

def steps_per_epoch(train_set, global_batch, args):
    """Optimizer steps per epoch: equal on every rank, as DistributedSampler's shards are."""
    per_rank = math.ceil(len(train_set) / dist.get_world_size())  # a shard, padded by repeats
    steps = per_rank * dist.get_world_size() // global_batch
    if steps == 0:
        guard.fail(f"the train set ({len(train_set)} images over {dist.get_world_size()} ranks) "
                   f"is smaller than one step of --batch-size {args.batch_size} x --accum-steps "
                   f"{args.accum_steps} per rank")
    return steps

# ------------------------------------------------------------------------ 5. model, DDP, hooks
def build_model(args, checkpoint):
    """The model on the CPU, the same on every rank, and the layers --weights left new."""
    torch.manual_seed(args.seed)
    model = torchvision.models.get_model(args.arch, num_classes=guard.num_classes(args))
    if checkpoint:
        model.load_state_dict(checkpoint["model"])
    elif args.weights:
        path, problem = guard.weights_file(args)
        guard.stop_on_problems(problem)  # a rank that cannot have them stops every rank
        state, new_layers = guard.weights_for(model, path, args)
        model.load_state_dict(state)
        return model, new_layers
    return model, []

def wrap_ddp(model, args, device):
    """(DDP around the model, what a step calls: that DDP, or under --compile that DDP compiled)."""
    if args.sync_bn:  # on GPUs only: check_args refuses it without CUDA
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=memory_format(args))
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if not args.compile:
        return ddp, ddp
    # Compiled after DDP wraps it: the graph splits at the gradient buckets, whose all-reduces still
    # overlap the backward (docs/training.md). DDP warns of inductor's gradient strides.
    warnings.filterwarnings("ignore", "Grad strides do not match bucket view strides")
    return ddp, torch.compile(ddp)

def register_comm_hook(ddp, args, run):
    """Replace DDP's plain all-reduce of gradients by --comm-hook's (fp16, bf16, powersgd)."""
    if args.comm_hook in ("fp16", "bf16"):
        ddp.register_comm_hook(None, getattr(default_hooks, f"{args.comm_hook}_compress_hook"))
    elif args.comm_hook == "powersgd":
        # A plain all-reduce until the warm-up ends, as low-rank gradients slow it down, and always
        # for the 2 steps before DDP rebuilds its buckets. The error feedback, in the state, starts
        # again at zero on a resume.
        warmup_steps = round((args.warmup_epochs - epochs_done(run)) * run.steps_per_epoch)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=max(2, warmup_steps))
        ddp.register_comm_hook(state, guard.powersgd_hook_for_gloo_too)

def build_optimizer(model, args):
    # On GPUs the fused kernel, which also does the GradScaler's inf check on the GPU, not the host.
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, fused=device.type == "cuda")
    guard.settle_momentum_buffers(optimizer)  # zeros, not what fused SGD makes if step 1 is skipped
    return optimizer, torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

# -------------------------------------------------------------------------- 6. train, validate
@dataclass
class Training:
    """What the loop carries; a checkpoint saves it. Training stands in epoch `epoch` (0-based),
    after the first `samples` images of its order (over all ranks), `step` steps at this layout."""
    model: torch.nn.Module  # what a step calls: ddp, or ddp compiled under --compile
    ddp: DDP  # whose no_sync() keeps a micro-batch's gradients out of the all-reduce
    model_without_ddp: torch.nn.Module  # the model itself: what validates and is saved
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # disabled unless --amp fp16
    steps_per_epoch: int  # at this world size and batch
    images_per_step: int  # the global batch: --batch-size x --accum-steps x world size
    epoch: int = 0
    samples: int = 0
    step: int = 0
    writer: guard.CheckpointWriter = field(default_factory=guard.CheckpointWriter)

def fit(run, train_set, val_set, args, to_input, stop):
    """Train from where `run` stands to the last epoch; after each, save last.pt and validate."""
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    epochs = range(run.epoch, args.epochs)
    for epoch in epochs:
        run.epoch = epoch
        epoch_start = time.perf_counter()
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        # Workers seeded by a generator of their own, not from the RNG that a resume restores.
        worker_seed = args.seed + epoch * dist.get_world_size() + dist.get_rank()
        # This rank's indices of the epoch as a list: all of them, or a resume's rest (whole steps).
        indices, run.step = rest_of_epoch(sampler, run)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=indices,
                            num_workers=args.workers, pin_memory=to_input.device.type == "cuda",
                            drop_last=True, generator=torch.Generator().manual_seed(worker_seed))
        first = epoch == epochs.start  # of this process: where --compile compiles
        with profile_steps(run, args, first) as profiler:
            train_stats, stopped = train_one_epoch(run, loader, args, to_input, stop, profiler,
                                                   first)
        if stopped:
            save_checkpoint(run, args)
            where = f"at epoch {epoch + 1} step {run.step}/{run.steps_per_epoch}"
            return log_stop(args, stop, where)
        run.epoch, run.samples, run.step = epoch + 1, 0, 0  # the next epoch's start
        # Batch norm's running statistics are training's, a blend of many weights: recomputed for
        # these weights, over every rank, before they are saved and validated (training.md).
        guard.recalibrate_batch_norm(run.model_without_ddp, train_set, sampler, args, to_input)
        # Saved before validating: a SIGTERM or a kill during validation loses no training.
        save_checkpoint(run, args)
        metrics = validate(run.model_without_ddp, val_set, args, to_input)
        record = {"epoch": epoch + 1, **train_stats, **metrics,
                  "epoch_seconds": time.perf_counter() - epoch_start}
        append_metrics(args, record)
        log(f"epoch {epoch + 1}/{args.epochs} train_loss {record['train_loss']:.4f} "
            f"val_loss {metrics['val_loss']:.4f} val_acc1 {metrics['val_acc1']:.2f}% "
            f"val_acc5 {metrics['val_acc5']:.2f}% ({metrics['val_samples']} images) "
            f"{record['images_per_sec']:.1f} img/s data {record['data_wait']:.0%} "
            f"{record['epoch_seconds']:.1f} s")
        if epoch + 1 < args.epochs and stop.agreed():  # a SIGTERM during validation
            return log_stop(args, stop, f"after epoch {epoch + 1}")

def rest_of_epoch(sampler, run):
    """This rank's indices for the rest of the epoch in whole steps, and the step they start after.
    DistributedSampler deals the epoch's order out in turn (rank r: entries r, r + world, ...), so
    the run.samples trained before, at any layout, are its first: each rank skips its share."""
    world, rank = sampler.num_replicas, sampler.rank
    per_rank_step = run.images_per_step // world
    skip = math.ceil((run.samples - rank) / world)  # this rank's entries before run.samples
    steps_left = max(0, len(sampler) - math.ceil(run.samples / world)) // per_rank_step  # rank 0's
    return list(sampler)[skip: skip + steps_left * per_rank_step], run.steps_per_epoch - steps_left

def train_one_epoch(run, loader, args, to_input, stop, profiler, first):
    """Train to the epoch's end, or until the ranks agree to stop: (the loss, data-wait share and
    images/s averaged over ranks, stopped). The host never waits for the GPU between log lines."""
    if run.step == run.steps_per_epoch:  # resumed at a larger step: less than one left
        return {"train_loss": math.nan, "data_wait": 0.0, "images_per_sec": 0.0}, False
    run.model.train()
    autocast = amp_context(args, to_input.device)
    batches = iter(loader)
    loss_sum = torch.zeros((), device=to_input.device)
    clock = StepClock(run.step, to_input.device, run.images_per_step)
    # Each rank compiles in its first two steps, minutes apart where their caches differ: till then
    # (or the epoch's end), the collectives wait the longer of COMPILE_TIMEOUT and their own.
    compiling = args.compile and first
    if compiling:
        guard.set_collective_timeout(max(COMPILE_TIMEOUT, args.collective_timeout))
    with clock.waiting():
        upcoming = next_step(batches, args, stop)
    while run.step < run.steps_per_epoch:
        if stop.agreed():
            return None, True
        micro_batches = upcoming
        if run.step + 1 < run.steps_per_epoch:
            with clock.waiting():
                upcoming = next_step(batches, args, stop)
        step_loss = torch.zeros((), device=to_input.device)
        for i, batch in enumerate(micro_batches):
            images, labels = to_input(*batch)
            # The earlier micro-batches' gradients only accumulate here: one all-reduce per step.
            with nullcontext() if i + 1 == args.accum_steps else run.ddp.no_sync():
                with autocast:
                    loss = F.cross_entropy(run.model(images), labels)
                run.scaler.scale(loss / args.accum_steps).backward()
            step_loss += loss.detach() / args.accum_steps
        lr = learning_rate(run, args)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        run.step += 1
        run.samples += run.images_per_step
        loss_sum += step_loss
        if compiling and run.step in (clock.first_step + 2, run.steps_per_epoch):
            guard.set_collective_timeout(args.collective_timeout)
        if run.step % args.log_every == 0 or run.step == run.steps_per_epoch:
            log_step(run, args, step_loss, lr, clock)
        if args.save_every and run.step % args.save_every == 0 and run.step < run.steps_per_epoch:
            save_checkpoint(run, args)  # the epoch's end saves anyway
        if profiler:  # --profile: a traced step ends here, its log line and save included
            profiler.step()
    stats = {"train_loss": loss_sum / (run.step - clock.first_step), **clock.epoch()}
    return mean_over_ranks(stats, to_input.device), False

def profile_steps(run, args, first_epoch):
    """--profile DIR: each rank traces steps 4 to 6 of the first epoch trained, after DDP's bucket
    rebuild and any compilation (a shorter epoch skips fewer), into a Chrome trace file in DIR."""
    left = run.steps_per_epoch - run.step
    if not (args.profile and first_epoch and left):  # none left: a resume at a larger batch
        return nullcontext()
    warmup = min(1, left - 1)  # a step that starts the profiler, not traced
    active = min(3, left - warmup)
    skip = min(2, left - warmup - active)
    first = run.step + skip + warmup + 1
    log(f"--profile: each rank traces steps {first}-{first + active - 1} of epoch {run.epoch + 1} "
        f"into {args.profile}/rank<N>.*.pt.trace.json; open one at https://ui.perfetto.dev")
    return torch.profiler.profile(  # by default the CPU's activity, and CUDA's where there is a GPU
        schedule=torch.profiler.schedule(wait=skip, warmup=warmup, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(args.profile,
                                                                f"rank{dist.get_rank()}"))

def next_step(batches, args, stop):
    """The next step's micro-batches; this rank's stop flags (and an unreadable image) go out."""
    micro_batches, problem = guard.read_or_problem(
        lambda: [next(batches) for _ in range(args.accum_steps)])
    stop.send(problem)
    return micro_batches

def epochs_done(run):
    """Where training stands, in epochs: placed by the images trained, not the steps, so that a
    resume at another world size or batch goes on along the same schedule."""
    return run.epoch + run.samples / (run.steps_per_epoch * run.images_per_step)

def learning_rate(run, args):
    """The next step's: a linear warm-up, then a cosine decay to 0."""
    done = epochs_done(run)
    if done < args.warmup_epochs:  # the first step at 1 / warm-up steps of --lr, none above
        return args.lr * min(1, (done + 1 / run.steps_per_epoch) / args.warmup_epochs)
    progress = (done - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
    return args.lr * 0.5 * (1 + math.cos(math.pi * progress))

class ModelInput:
    """A uint8 batch from the loader as the model takes it, on the device: batches cross shared
    memory, pinned memory and the copy to the GPU at a quarter of float32's bytes."""

    def __init__(self, args, device):
        self.device = device
        self.memory_format = memory_format(args)
        # On the device once: a tensor made from host data per batch would make the host wait.
        self.mean = 255 * torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
        self.std = 255 * torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)

    def __call__(self, images, labels):
        images = images.to(self.device, non_blocking=True)
        images = images.contiguous(memory_format=self.memory_format).float()
        return images.sub_(self.mean).div_(self.std), labels.to(self.device, non_blocking=True)

@torch.no_grad()
def validate(model, val_set, args, to_input):
    """Loss, top-1 and top-5 over every val image exactly once, equal on every rank: the sampler
    pads the shards with repeats, and gather_for_metrics drops them."""
    model.eval()
    autocast = amp_context(args, to_input.device)
    indices = list(DistributedSampler(val_set, shuffle=False))
    loader = DataLoader(val_set, batch_size=args.batch_size, sampler=indices,
                        num_workers=args.workers, pin_memory=to_input.device.type == "cuda",
                        generator=torch.Generator().manual_seed(args.seed))
    rows, problem = guard.read_or_problem(lambda: [val_rows(model, batch, autocast, to_input)
                                                   for batch in loader])
    guard.stop_on_problems(problem)  # all ranks reach the next gather, or all stop
    rows = gather_utils.gather_for_metrics(torch.cat(rows), torch.tensor(indices), len(val_set))
    loss, acc1, acc5 = rows.mean(dim=0).tolist()
    return {"val_loss": loss, "val_acc1": 100 * acc1, "val_acc5": 100 * acc5,
            "val_samples": len(rows)}

def val_rows(model, batch, autocast, to_input):
    """A row per image: its loss, whether the label is the top-1 guess, and in the top 5."""
    images, labels = to_input(*batch)
    with autocast:
        logits = model(images).float()
    hits = (logits.topk(min(5, logits.shape[1]), dim=1).indices == labels[:, None]).float()
    loss = F.cross_entropy(logits, labels, reduction="none")
    return torch.stack([loss, hits[:, 0], hits.amax(dim=1)], dim=1).double()

def amp_context(args, device):
    dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

def memory_format(args):
    return torch.channels_last if args.channels_last else torch.contiguous_format

# ---------------------------------------------------- the log lines of training and validation
def log(message):
    if dist.get_rank() == 0:
        print(message, flush=True)

def mean_over_ranks(figures, device):
    """{name: its mean over ranks} of detached tensors and numbers, as numbers: one all_reduce.
    Detached: reducing a live loss would put the collective into the autograd graph."""
    values = torch.stack([torch.as_tensor(value, dtype=torch.float64, device=device).detach()
                          for value in figures.values()])
    dist.all_reduce(values)
    return dict(zip(figures, (values / dist.get_world_size()).tolist()))

def log_step(run, args, step_loss, lr, clock):
    """The step's line, from figures averaged over ranks; a loss that is not finite stops all."""
    images_per_sec, data_share = clock.line(run.step)
    mean = mean_over_ranks({"loss": step_loss, "data": data_share}, step_loss.device)
    guard.check_finite(math.isfinite(mean["loss"]), f"the loss is {mean['loss']}", run, args)
    total, done = args.epochs * run.steps_per_epoch, run.epoch * run.steps_per_epoch + run.step
    eta = datetime.timedelta(seconds=round((total - done) * run.images_per_step / images_per_sec))
    log(f"epoch {run.epoch + 1}/{args.epochs} step {run.step}/{run.steps_per_epoch} "
        f"({done}/{total}) loss {mean['loss']:.4f} lr {lr:.4g} {images_per_sec:.1f} img/s "
        f"data {mean['data']:.0%} eta {eta}")

def log_stop(args, stop, where):
    last = guard.last_checkpoint(args)
    log(f"stopped by {stop.stopped_by} {where}; continue with --resume {last}")

def log_start(args, device, train_set, val_set, run, new_layers):
    start = ""
    if args.weights:
        start = f" from {args.weights}" + (f" (new {', '.join(new_layers)})" if new_layers else "")
    if args.compile:
        start += ", compiled (the first step compiles, which takes a while)"
    recipe = "synthetic data"
    if args.data:
        recipe = " > ".join(type(t).__name__ for t in train_set.transform.transforms)
    world = dist.get_world_size()
    log(f"{args.arch}{start} on {world} x {device.type} ({args.backend}), {len(train_set)} "
        f"train / {len(val_set)} val images at {args.image_size} px, {recipe}, batch "
        f"{args.batch_size} x {args.accum_steps} x {world}, {run.steps_per_epoch} steps per epoch")

def log_resume(path, checkpoint, args, run):
    """Where the run resumes, and what it changes: the batch over all ranks, the optimizer's."""
    saved_args = checkpoint["args"]
    saved = f"{saved_args['batch_size']} x {saved_args['accum_steps']} x {checkpoint['world_size']}"
    now = f"{args.batch_size} x {args.accum_steps} x {dist.get_world_size()}"
    changed = []
    if now != saved:
        changed.append(f"batch {now} (was {saved}; {run.samples} images of the epoch done)")
    for name in ["lr", "momentum", "weight_decay"]:
        if getattr(args, name) != saved_args[name]:
            changed.append(f"--{name.replace('_', '-')} {getattr(args, name):g} "
                           f"(was {saved_args[name]:g})")
    settings = f"; with {', '.join(changed)}" if changed else ""
    log(f"resumed from {path} at epoch {run.epoch + 1} step {checkpoint['step']}{settings}")

class StepClock:
    """Images/s and the share of time waiting for data, per log line and epoch. It waits for the
    device at log lines only; the data wait is the host's (a GPU with queued steps is not idle)."""

    def __init__(self, step, device, images_per_step):
        self.device = device
        self.images_per_step = images_per_step
        self.first_step = step
        self.waited = 0.0  # the seconds spent waiting for data so far
        self.start = (step, self.now(), 0.0)  # (step, time, waited) at the start
        self.last = self.start  # ... at the last log line
        self.first_line = None  # ... at the first log line

    def now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # kernels run asynchronously: time what they did
        return time.perf_counter()

    @contextmanager
    def waiting(self):
        began = time.perf_counter()
        yield
        self.waited += time.perf_counter() - began

    def line(self, step):
        """(images/s, the share of time waiting for data) since the line before; marks this one."""
        line_step, began, waited = self.last
        now = self.now()
        self.last = (step, now, self.waited)
        self.first_line = self.first_line or self.last
        return ((step - line_step) * self.images_per_step / (now - began),
                (self.waited - waited) / (now - began))

    def epoch(self):
        """The epoch's data-wait share, and its images/s from the first log line on (before it: the
        warm-up and any compilation), unless that was the last line."""
        _, began, _ = self.start
        last_step, last, _ = self.last
        timed_step, timed, _ = self.first_line if self.first_line != self.last else self.start
        return {"data_wait": self.waited / (last - began),
                "images_per_sec": (last_step - timed_step) * self.images_per_step / (last - timed)}

def append_metrics(args, record):
    """One JSON line; a figure of no step (a resume with less than a step left) is null, not NaN."""
    if dist.get_rank() == 0 and args.metrics_file:
        record = {key: None if isinstance(value, float) and math.isnan(value) else value
                  for key, value in record.items()}
        Path(args.metrics_file).parent.mkdir(parents=True, exist_ok=True)
        with open(args.metrics_file, "a") as f:
            f.write(json.dumps(record) + "\n")

# ----------------------------------------------------------------------------- 7. checkpoints
def save_checkpoint(run, args):
    """Rank 0's writer thread writes last.pt, with each rank's random streams, as training runs."""
    guard.check_finite_weights(run, args)  # training diverged since the last log line: no save
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    rng = gather_utils.all_gather_object({"torch": torch.get_rng_state(), "cuda": cuda})
    if dist.get_rank() == 0:
        state = {"model": run.model_without_ddp.state_dict(),
                 "optimizer": run.optimizer.state_dict(), "scaler": run.scaler.state_dict(),
                 "epoch": run.epoch, "samples": run.samples, "step": run.step,
                 "world_size": dist.get_world_size(), "args": vars(args), "rng": rng,
                 "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}
        run.writer.write(state, guard.last_checkpoint(args))

def load_checkpoint(args):
    """(path, checkpoint), read once on every rank: this job's last.pt (after a restart, or on a
    node that joins), else --resume, else (None, None). Without --image-size, its sizes go on."""
    path, checkpoint = guard.last_checkpoint(args), None
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    # torchrun's default id, "none", is every job's: only a restart takes a last.pt of that id.
    if path.exists() and not args.evaluate and (restarted or job not in (None, "none")):
        checkpoint = guard.load_file(path, "--checkpoint-dir", "checkpoint")
        run_id = checkpoint.get("run_id") if isinstance(checkpoint, dict) else None
        if run_id != job:  # an earlier job's, left in the directory
            if restarted and guard.world_from_env()[0] == 0:
                guard.say(f"restart: ignoring {path}, written by another job (run id {run_id})")
            checkpoint = None
    if checkpoint is None and args.resume:
        path = Path(args.resume)
        checkpoint = guard.load_file(path, "--resume", "checkpoint")
    if checkpoint is None:
        return None, None
    guard.check_checkpoint(checkpoint, path, args)  # this script's, for this model and classes
    if not args.image_size_given:
        for name in ["image_size", "resize", "interpolation"]:
            setattr(args, name, checkpoint["args"][name])
    return path, checkpoint

def restore_training_state(checkpoint, run):
    """The optimizer's state with this run's settings (--lr, --momentum, fused: a CPU run cannot
    take a GPU's), the scaler, random streams and place in the epoch (the model: build_model)."""
    settings = [{k: v for k, v in group.items() if k != "params"}
                for group in run.optimizer.param_groups]
    run.optimizer.load_state_dict(checkpoint["optimizer"])
    for group, own in zip(run.optimizer.param_groups, settings):
        group.update(own)
    guard.settle_momentum_buffers(run.optimizer)  # in their parameters' memory layout
    if checkpoint["scaler"]:  # empty when saved without --amp fp16: a new scaler's defaults
        run.scaler.load_state_dict(checkpoint["scaler"])
    rng, rank = checkpoint["rng"], dist.get_rank()
    if rank < len(rng):  # a rank the saving run lacked (a larger world) keeps its own seed's
        torch.set_rng_state(rng[rank]["torch"])
        if torch.cuda.is_available() and rng[rank]["cuda"] is not None:
            torch.cuda.set_rng_state(rng[rank]["cuda"])
    run.epoch, run.samples = checkpoint["epoch"], checkpoint["samples"]

if __name__ == "__main__":
    main()
