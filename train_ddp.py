"""Train an image classifier with DistributedDataParallel, on GPUs (NCCL) or on CPUs (gloo).

    bash launch.sh 4                                        # 4 processes here, a free port, the right backend
    torchrun --standalone --nproc-per-node 4 train_ddp.py   # the same by hand
    python train_ddp.py                                     # a single process, no launcher

Without --data it trains on synthetic images made in memory. main() is the table of contents (docs/training.md).
"""
import signal

if __name__ == "__main__":
    # A SIGTERM (SLURM, Kubernetes) during the imports waits, blocked, for main() to stop cleanly at the first step.
    # Its action is the default, not the ignore that launch.sh's torchrun passes on.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

import argparse
import datetime
import json
import math
import os
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import update_bn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import v2

import gather_utils
import guard

# On 2 CPU cores `bash launch.sh 4` must finish in minutes (its lr: docs/training.md); on GPUs a real ResNet-50 run.
DEVICE_DEFAULTS = {
    "cpu": dict(image_size=32, train_samples=2048, val_samples=500, batch_size=16, workers=0, lr=0.005),
    "cuda": dict(image_size=224, train_samples=64000, val_samples=10000, batch_size=64, workers=6, lr=0.1),
}
ARCHS = torchvision.models.list_models(module=torchvision.models)
# Synthetic images: a pattern per class of about 7 gray levels (std) under noise of 48. One image is ambiguous,
# the class shows only over many pixels: accuracy climbs for epochs, and stays below 100%.
SYNTHETIC_PATTERN, SYNTHETIC_NOISE = 9.6, 48
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # what torchvision's weights expect
# Images up to this size (CIFAR, Tiny ImageNet) train whole: a random-resized crop, which may keep 8%, loses them.
SMALL_IMAGE_MAX_SIZE = 64
BN_IMAGES = 1024  # recalibrate_batch_norm's images over all ranks, at most the train set: precise BN's count


def main(argv=None):
    args = parse_args(argv)  # 1. arguments
    # Read before the process group forms, so that a bad file fails fast, and every rank with it.
    resume_from, checkpoint = load_checkpoint(args)
    if args.dry_run:
        return
    # Noted from here on: a SIGTERM during the set-up, or held since start-up, stops training at its first step.
    stop = None if args.evaluate else guard.StopAgreement()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    device = setup_device(args)  # 2. device
    with process_group(args, device):  # 3. process group, and 8. clean-up when the block ends
        train_or_evaluate(args, device, resume_from, checkpoint, stop)


# ---------------------------------------------------------------- 1. arguments, and the checkpoint to resume from
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="DDP training of a torchvision classifier (see docs/training.md).")
    p.error = guard.fail  # one line, not argparse's usage, from every rank
    p.add_argument("--local-rank", "--local_rank", type=int, default=guard.env_local_rank(),
                   help="set by torch.distributed.launch (default: LOCAL_RANK, else SLURM_LOCALID, else 0)")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto", help="auto: nccl on GPUs, else gloo")
    p.add_argument("--init-timeout", type=float, default=60, help="seconds for all ranks to join (default 60)")
    p.add_argument("--collective-timeout", type=float, default=600, help="seconds a collective waits (default 600)")
    p.add_argument("--data", help="ImageFolder root with train/ and val/; default: synthetic data")
    p.add_argument("--train-samples", type=int, help="synthetic train set size (default 2048 on CPU, 64000 on GPU)")
    p.add_argument("--val-samples", type=int, help="synthetic val set size (default 500 on CPU, 10000 on GPU)")
    p.add_argument("--num-classes", type=int, default=10, help="synthetic classes (default 10)")
    p.add_argument("--image-size", type=int, help="crop size (default 32 on CPU, 224 on GPU)")
    p.add_argument("--workers", type=int, help="DataLoader workers per process (default 0 on CPU, 6 on GPU)")
    p.add_argument("--no-flip", action="store_true", help="no horizontal flip: for --data whose mirror images differ")
    p.add_argument("--arch", default="resnet50", choices=ARCHS, metavar="NAME",
                   help="a torchvision classification model (default resnet50)")
    p.add_argument("--weights", help="start from these weights: a torchvision name for --arch (IMAGENET1K_V2, "
                                     "DEFAULT, ResNet50_Weights.IMAGENET1K_V2), or a file: a state dict or a last.pt")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (after DDP wraps it)")
    p.add_argument("--sync-bn", action="store_true", help="batch-norm statistics over all ranks")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format (faster convs on tensor cores)")
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off", help="autocast dtype (fp16: a GradScaler)")
    p.add_argument("--comm-hook", choices=["none", "fp16", "bf16", "powersgd"], default="none", help="compressed grads")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, help="per process (default 16 on CPU, 64 on GPU)")
    p.add_argument("--accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, help="peak learning rate (default 0.005 on CPU, 0.1 on GPU)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=float, default=1, help="linear warm-up before the cosine decay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="optimizer steps between log lines")
    p.add_argument("--checkpoint-dir", default="checkpoints", help="where rank 0 writes last.pt")
    p.add_argument("--save-every", type=int, help="also write last.pt every N optimizer steps (default: at epoch ends)")
    p.add_argument("--resume", help="checkpoint to continue from")
    p.add_argument("--evaluate", action="store_true", help="validate the --resume checkpoint or --weights, then exit")
    p.add_argument("--metrics-file", help="rank 0 appends one JSON line per epoch here")
    p.add_argument("--dry-run", action="store_true", help="check arguments and files, then exit (launch.sh does)")
    p.set_defaults(resize=None, interpolation="bilinear")  # the validation resize, before the center crop
    args = p.parse_args(argv)

    args.image_size_given = args.image_size is not None
    weights = guard.named_weights(args)
    if weights and args.image_size is None:  # train and validate at the sizes the weights were published with
        recipe = weights.transforms()
        args.image_size, args.resize, args.interpolation = (recipe.crop_size[0], recipe.resize_size[0],
                                                            recipe.interpolation.value)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in DEVICE_DEFAULTS[device_type].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.resize = args.resize or args.image_size * 256 // 224
    if args.backend == "auto":
        args.backend = "nccl" if device_type == "cuda" else "gloo"
    guard.check_args(args)
    return args


def load_checkpoint(args):
    """(path, checkpoint) to resume from, read on every rank; (None, None) for a fresh start."""
    path = guard.resume_path(args)
    if path is None:
        return None, None
    if not path.is_file():
        guard.fail(f"--resume {path}: no such file; expected a last.pt written by train_ddp.py")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        guard.fail(f"--resume {path}: not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0]})")
    if not isinstance(checkpoint, dict) or not guard.CHECKPOINT_KEYS <= checkpoint.keys():
        guard.fail(f"--resume {path}: not a train_ddp.py checkpoint (expected the keys {', '.join(sorted(guard.CHECKPOINT_KEYS))})")
    if checkpoint["args"]["arch"] != args.arch:
        guard.fail(f"--resume {path} holds a {checkpoint['args']['arch']} model but --arch is {args.arch}")
    if not args.image_size_given:  # continue at the sizes the run started with (a fine-tune's came from its weights)
        sizes = ["image_size", "resize", "interpolation"]
        args.image_size, args.resize, args.interpolation = (checkpoint["args"].get(k, getattr(args, k)) for k in sizes)
    return path, checkpoint


# ---------------------------------------------------------------- 2. device
def setup_device(args):
    # Before any CUDA work: otherwise every rank creates its context and tensors on GPU 0.
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # srun with one GPU per task: each task sees a single GPU, whatever its local rank.
    one_per_task = torch.cuda.device_count() == 1 and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) == 1
    index = 0 if one_per_task else args.local_rank
    if index >= torch.cuda.device_count():  # srun: more tasks on a node than its GPUs
        guard.rank_error(f"local rank {index} but only {torch.cuda.device_count()} GPUs are visible; "
                   "start at most one process per GPU", code=2)
    torch.cuda.set_device(index)
    torch.backends.cudnn.benchmark = True  # fixed input sizes: time the conv kernels once, keep the fastest
    guard.raise_nccl_timeouts(args)  # read as NCCL starts
    return torch.device("cuda", index)


# ---------------------------------------------------------------- 3. process group
@contextmanager
def process_group(args, device):
    init_distributed(args, device)
    try:
        yield
        # Before torch 2.14 a rank could hang at exit, destroying a gloo group while its threads free the last
        # collectives' tensors (docs/testing.md). These works keep them alive until after the group: a barrier, and a
        # collective on the CPU backend, which on GPUs is gloo's side of the group, never reached by the barrier.
        finished = [dist.barrier(async_op=True), dist.all_reduce(torch.zeros(1), async_op=True)]
        for work in finished:
            work.wait()
    except RuntimeError as e:  # a rank gone (gloo's connections closed or timed out, NCCL's error): one line each
        if "gloo/transport" not in str(e) and not isinstance(e, dist.DistBackendError):
            raise
        trace = Path(os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "") + str(dist.get_rank()))  # on NCCL
        recorded = f"; its last collectives: {trace} (every rank's: torchfrtrace {trace.parent})"
        guard.rank_error(f"a collective failed: another rank stopped, or stopped answering for --collective-timeout "
                   f"{args.collective_timeout:g} s; look for its own error ({str(e).strip().splitlines()[0]})"
                   + (recorded if trace.is_file() else ""))
    finally:
        dist.destroy_process_group()


def init_distributed(args, device):
    rank, world_size = guard.world_from_env()
    # On GPUs one group, two backends: NCCL for CUDA tensors, gloo for the small CPU ones, never queued behind grads.
    backend = "cpu:gloo,cuda:nccl" if args.backend == "nccl" else args.backend
    bind = {"device_id": device} if device.type == "cuda" else {}  # NCCL's communicator on this GPU, at once
    if world_size == 1 and "MASTER_ADDR" not in os.environ:  # no launcher: a store in memory, no address, no port
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **bind)
        return
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        guard.fail("WORLD_SIZE > 1 but MASTER_ADDR or MASTER_PORT is not set; under srun export both (docs/launching.md)")
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    # The rendezvous and gloo's connections wait --init-timeout, the collectives after it --collective-timeout.
    timeout = datetime.timedelta(seconds=args.init_timeout)
    try:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        # torchrun's own store outlives a restart (MAX_RESTARTS) with the last attempt's keys: without a prefix per
        # attempt it hangs. launch.sh's elastic job gets a new store each round, and a joining node counts no restarts.
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **bind)
        dist.barrier()
        gather_utils.all_gather_object(None)  # on GPUs, the gloo backend's first collective: its problems show now
    except (RuntimeError, ValueError) as e:
        guard.rank_error(guard.init_failure(e, args, world_size, address))
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # torch 2.3
    set_timeout(datetime.timedelta(seconds=args.collective_timeout))


# ---------------------------------------------------------------- 4. to 7., in the process group
def train_or_evaluate(args, device, resume_from, checkpoint, stop):
    """Steps 4 to 7, a function of their own: the DDP model must be freed before process_group() ends the group."""
    guard.check_same_start(checkpoint)
    train_set, val_set = build_datasets(args)  # 4. data
    steps = steps_per_epoch(train_set, args)
    if guard.named_weights(args):
        guard.fetch_weights(guard.named_weights(args))
    model, new_layers = build_model(args, checkpoint)  # 5. model, the same weights on every rank
    torch.manual_seed(args.seed + dist.get_rank())  # from here, one random stream per rank
    to_input = ModelInput(args, device)
    if args.evaluate:
        metrics = validate(model.to(device, memory_format=memory_format(args)), val_set, args, to_input)
        append_metrics(args, {"epoch": checkpoint["epoch"] if checkpoint else 0, **metrics})
        return log(json.dumps(metrics))
    model = wrap_ddp(model, args, device, warmup_steps=round(args.warmup_epochs * steps))  # PowerSGD's plain start
    optimizer, scaler = build_optimizer(model, args)
    run = Training(model, optimizer, scaler, steps_per_epoch=steps)
    if checkpoint:
        restore_training_state(checkpoint, run, args)
        log(f"resumed from {resume_from} at epoch {run.epoch + 1} step {checkpoint['step']}"
            f"{guard.changed_settings(checkpoint, args, run.samples)}")
        checkpoint.clear()  # the model and optimizer have what they need: free the rest (main() holds the dict)
    start = f" from {args.weights}" + (f" (new {', '.join(new_layers)})" if new_layers else "") if args.weights else ""
    start += ", compiled (the first step compiles, which takes a while)" if args.compile else ""
    recipe = " > ".join(type(t).__name__ for t in train_set.transform.transforms) if args.data else "synthetic data"
    log(f"{args.arch}{start} on {dist.get_world_size()} x {device.type} ({args.backend}), "
        f"{len(train_set)} train / {len(val_set)} val images at {args.image_size} px, {recipe}, "
        f"batch {args.batch_size} x {args.accum_steps} x {dist.get_world_size()}, {steps} steps per epoch")
    with run.writer:  # the block's end waits for the last checkpoint write, also on an error: then this rank leaves
        fit(run, train_set, val_set, args, to_input, stop)


# ---------------------------------------------------------------- 4. data
class SyntheticImages(Dataset):
    """A learnable stand-in for ImageNet: a smooth pattern per class under noise, as uint8 images. Sample i is made
    on demand from (seed, split, i): every rank and every run sees the same data. Labels cycle through the classes."""

    def __init__(self, num_samples, num_classes, image_size, seed, split):
        coarse = torch.randn(num_classes, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
        self.patterns = F.interpolate(coarse, size=image_size, mode="bilinear", align_corners=False)
        self.num_samples = num_samples
        self.noise_seed = (seed * 2 + (split == "val") + 1) << 32

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        label = index % len(self.patterns)
        noise = torch.randn(self.patterns.shape[1:], generator=torch.Generator().manual_seed(self.noise_seed + index))
        image = 128 + SYNTHETIC_PATTERN * self.patterns[label] + SYNTHETIC_NOISE * noise
        return image.round_().clamp_(0, 255).to(torch.uint8), label


def build_datasets(args):
    """uint8 images, as the loader's workers hand them over; ModelInput makes them the model's input."""
    if not args.data:
        return (SyntheticImages(args.train_samples, args.num_classes, args.image_size, args.seed, "train"),
                SyntheticImages(args.val_samples, args.num_classes, args.image_size, args.seed, "val"))
    size = args.image_size
    if size <= SMALL_IMAGE_MAX_SIZE:  # the whole image (squared at size), padded by 1/8 and cropped back
        val = [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
        train = val + [v2.RandomCrop(size, padding=size // 8)]
    else:  # ImageNet's recipe
        interpolation = v2.InterpolationMode(args.interpolation)
        train = [v2.RandomResizedCrop(size, interpolation=interpolation, antialias=True)]
        val = [v2.Resize(args.resize, interpolation=interpolation, antialias=True), v2.CenterCrop(size)]
    train += [] if args.no_flip else [v2.RandomHorizontalFlip()]
    # allow_empty: a class without validation images keeps its label (check_image_folder matched the folders).
    root = Path(args.data)
    return (torchvision.datasets.ImageFolder(root / "train", v2.Compose(train), loader=guard.read_image, allow_empty=True),
            torchvision.datasets.ImageFolder(root / "val", v2.Compose(val), loader=guard.read_image, allow_empty=True))


def steps_per_epoch(train_set, args):
    """Optimizer steps per epoch: the same on every rank, as DistributedSampler gives equal shards."""
    shard = math.ceil(len(train_set) / dist.get_world_size())
    steps = shard // (args.batch_size * args.accum_steps)
    if steps == 0:
        guard.fail(f"the train set ({len(train_set)} images over {dist.get_world_size()} ranks) is smaller than one step of "
             f"--batch-size {args.batch_size} x --accum-steps {args.accum_steps} per rank")
    return steps


# ---------------------------------------------------------------- 5. model, DDP, hooks
def build_model(args, checkpoint):
    """The bare model on the CPU, the same on every rank: from the checkpoint, else --weights, else --seed.
    Returns it, and the layers that --weights left new: a classifier for another number of classes."""
    torch.manual_seed(args.seed)
    model = torchvision.models.get_model(args.arch, weights=None, num_classes=guard.num_classes(args))
    if checkpoint:
        model.load_state_dict(checkpoint["model"])
    elif args.weights:
        weights = guard.named_weights(args)
        state, new = guard.fit_weights(weights.get_state_dict() if weights else guard.read_weights_file(args.weights), model, args)
        model.load_state_dict(state)
        return model, new
    return model, []


def wrap_ddp(model, args, device, warmup_steps):
    if args.sync_bn:
        if device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:  # nn.SyncBatchNorm runs on GPUs only
            model = guard.convert_to_cpu_sync_bn(model)
    model = model.to(device, memory_format=memory_format(args))
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    register_comm_hook(ddp, args.comm_hook, warmup_steps)
    if not args.compile:
        return ddp
    # Compiled after DDP wraps it, as PyTorch advises: the graph splits at the gradient buckets, whose all-reduces still
    # overlap the backward. inductor gives 1x1 convolutions' gradients other strides than their weights': DDP warns.
    warnings.filterwarnings("ignore", "Grad strides do not match bucket view strides")
    return torch.compile(ddp)


def register_comm_hook(ddp, name, warmup_steps):
    """Replace DDP's plain all-reduce of gradients by the hook `name` (none, fp16, bf16, powersgd)."""
    if name in ("fp16", "bf16"):
        ddp.register_comm_hook(None, getattr(default_hooks, f"{name}_compress_hook"))
    elif name == "powersgd":  # plain all-reduce during the lr warm-up; the state carries the error feedback
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=max(2, warmup_steps))
        ddp.register_comm_hook(state, powersgd_hook)


def powersgd_hook(state, bucket):
    """PowerSGD chains two all-reduces per bucket through callbacks. Gloo matches collectives by issue order, which
    the callbacks of concurrent buckets make differ between ranks: there each bucket finishes first."""
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    if dist.get_backend() == "gloo":  # not "cpu:gloo,cuda:nccl", whose gradients go over NCCL
        future.wait()
    return future


def build_optimizer(model, args):
    # On GPUs the fused kernel, which also does the GradScaler's inf check (--amp fp16) on the GPU, not on the host.
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                                fused=device.type == "cuda")
    return optimizer, torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")


# ---------------------------------------------------------------- 6. train and validate
@dataclass
class Training:
    """What the training loop carries from step to step; a checkpoint saves all but steps_per_epoch and writer."""
    model: DDP
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # disabled unless --amp fp16
    steps_per_epoch: int  # at this world size and batch
    epoch: int = 0  # where training stands: in epoch `epoch` (0-based),
    samples: int = 0  # after the first `samples` images of its order (over all ranks, at any world size and batch),
    step: int = 0  # which is after `step` optimizer steps at this world size and batch
    writer: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "checkpoint writer"))
    written: Future = None  # rank 0's latest write: the next save, and the exit, wait for it


def fit(run, train_set, val_set, args, to_input, stop):
    """Train from where `run` stands to the last epoch; after each epoch, save last.pt and validate."""
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    for epoch in range(run.epoch, args.epochs):
        run.epoch, epoch_start = epoch, time.perf_counter()
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        # Its own generator seeds the workers: a loader must not draw from the global RNG, which a resume restores.
        worker_seed = args.seed + epoch * dist.get_world_size() + dist.get_rank()
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=guard.remaining_shard(sampler, run, args),
                            num_workers=args.workers, pin_memory=to_input.device.type == "cuda", drop_last=True,
                            generator=torch.Generator().manual_seed(worker_seed))
        train_stats, stopped = train_one_epoch(run, loader, args, to_input, stop)
        if stopped:
            save_checkpoint(run, args)
            log(f"stopped by SIGTERM at epoch {epoch + 1} step {run.step}/{run.steps_per_epoch}; "
                f"continue with --resume {guard.last_checkpoint(args)}")
            return
        run.epoch, run.samples, run.step = epoch + 1, 0, 0
        recalibrate_batch_norm(run.model.module, train_set, sampler, args, to_input)
        # Saved before validating: a SIGTERM or a kill during a long validation loses no training.
        checksums = save_checkpoint(run, args)
        metrics = validate(run.model.module, val_set, args, to_input)
        record = {"epoch": epoch + 1, **train_stats, **metrics,
                  "epoch_seconds": time.perf_counter() - epoch_start, "replica_checksums": checksums}
        append_metrics(args, record)
        log(f"epoch {epoch + 1}/{args.epochs} train_loss {record['train_loss']:.4f} val_loss {metrics['val_loss']:.4f} "
            f"val_acc1 {metrics['val_acc1']:.2f}% val_acc5 {metrics['val_acc5']:.2f}% ({metrics['val_samples']} images)"
            f" {record['images_per_sec']:.1f} img/s data {record['data_wait']:.0%} {record['epoch_seconds']:.1f} s")
        if epoch + 1 < args.epochs and stop.agreed():  # a SIGTERM during validation
            log(f"stopped by SIGTERM after epoch {epoch + 1}; continue with --resume {guard.last_checkpoint(args)}")
            return


def train_one_epoch(run, loader, args, to_input, stop):
    """Train to the end of the epoch, or until the ranks agree to stop. Returns the loss, data-wait share and images/s,
    averaged over ranks, and whether to stop. Between log lines no host waits for the GPU (check_syncs.py)."""
    images_per_step = args.batch_size * args.accum_steps * dist.get_world_size()
    if run.step == run.steps_per_epoch:  # resumed at a larger step, with less than one left in the epoch
        return {"train_loss": math.nan, "data_wait": 0.0, "images_per_sec": 0.0}, False
    run.model.train()
    autocast = amp_context(args, to_input.device)
    batches, loss_sum = iter(loader), torch.zeros((), device=to_input.device)
    # (step, time, seconds waited for data, on the host: a GPU busy with queued steps is not idle), then at each line
    marks = [(run.step, guard.synced_clock(to_input.device), 0.0)]
    upcoming, waited = next_step(batches, args, stop), time.perf_counter() - marks[0][1]
    while run.step < run.steps_per_epoch:
        if stop.agreed():
            return None, True
        micro_batches, fetch_began = upcoming, time.perf_counter()
        if run.step + 1 < run.steps_per_epoch:
            upcoming = next_step(batches, args, stop)
        waited += time.perf_counter() - fetch_began
        step_loss = torch.zeros((), device=to_input.device)
        for i, batch in enumerate(micro_batches):
            images, labels = to_input(*batch)
            # Gradients of the earlier micro-batches only accumulate locally; one all-reduce per step.
            with nullcontext() if i + 1 == args.accum_steps else run.model.no_sync():
                with autocast:
                    loss = F.cross_entropy(run.model(images), labels)
                run.scaler.scale(loss / args.accum_steps).backward()
            # Detached: reducing the live loss would put the collective into the autograd graph.
            step_loss += loss.detach() / args.accum_steps
        lr = guard.learning_rate(run, args, images_per_step)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        run.step, run.samples = run.step + 1, run.samples + images_per_step
        loss_sum += step_loss
        if run.step % args.log_every == 0 or run.step == run.steps_per_epoch:
            (line_step, line_began, line_waited), now = marks[-1], guard.synced_clock(to_input.device)
            data = (waited - line_waited) / (now - line_began)  # the share of the time since the line before
            mean = gather_utils.all_reduce_mean({"loss": step_loss, "data": data})
            if not math.isfinite(mean["loss"]):
                guard.fail(f"the loss is {mean['loss']} at epoch {run.epoch + 1} step {run.step}: training diverged; "
                     f"lower --lr ({args.lr:g} now) or check the data; {guard.last_checkpoint(args)} is unchanged", code=1)
            rate = (run.step - line_step) * images_per_step / (now - line_began)
            total, done = args.epochs * run.steps_per_epoch, run.epoch * run.steps_per_epoch + run.step
            log(f"epoch {run.epoch + 1}/{args.epochs} step {run.step}/{run.steps_per_epoch} ({done}/{total}) loss "
                f"{mean['loss']:.4f} lr {lr:.4g} {rate:.1f} img/s data {mean['data']:.0%} "
                f"eta {datetime.timedelta(seconds=round((total - done) * images_per_step / rate))}")
            marks.append((run.step, now, waited))
        if args.save_every and run.step % args.save_every == 0 and run.step < run.steps_per_epoch:
            save_checkpoint(run, args)  # the epoch's end saves anyway
    # images/s from the first log line on (before it: the warm-up, any compilation), unless it was the last one
    (first_step, began, _), (timed_step, timed, _) = marks[0], marks[1 if len(marks) > 2 else 0]
    stats = {"train_loss": loss_sum / (run.step - first_step), "data_wait": waited / (marks[-1][1] - began),
             "images_per_sec": (run.step - timed_step) * images_per_step / (marks[-1][1] - timed)}
    return gather_utils.all_reduce_mean(stats), False


def next_step(batches, args, stop):
    """The next step's micro-batches; this rank's stop flags go on their way, with an image it could not read."""
    try:
        micro_batches, problem = [next(batches) for _ in range(args.accum_steps)], None
    except guard.UnreadableImage as e:
        micro_batches, problem = [], guard.unreadable(e)
    stop.send(problem)
    return micro_batches


class ModelInput:
    """A uint8 batch from the loader as the model takes it, on the device: batches cross shared memory, pinned memory
    and the copy to the GPU at a quarter of float32's bytes, and the GPU does the arithmetic."""

    def __init__(self, args, device):
        self.device, self.memory_format = device, memory_format(args)
        # On the device once: a tensor made from host data for each batch would make the host wait for the GPU.
        self.mean, self.std = 255 * torch.tensor([IMAGENET_MEAN, IMAGENET_STD], device=device).view(2, 1, 3, 1, 1)

    def __call__(self, images, labels):
        images = images.to(self.device, non_blocking=True).contiguous(memory_format=self.memory_format)
        return images.float().sub_(self.mean).div_(self.std), labels.to(self.device, non_blocking=True)


@torch.no_grad()
def validate(model, val_set, args, to_input):
    """Loss, top-1 and top-5 over every val image exactly once, equal on every rank: DistributedSampler pads the
    shards with repeats, and gather_for_metrics drops them, so the averages are a single process's."""
    model.eval()
    autocast = amp_context(args, to_input.device)
    indices = list(DistributedSampler(val_set, shuffle=False))
    loader = DataLoader(val_set, batch_size=args.batch_size, sampler=indices, num_workers=args.workers,
                        pin_memory=to_input.device.type == "cuda", generator=torch.Generator().manual_seed(args.seed))
    rows, problem = [], None
    try:
        for batch in loader:
            images, labels = to_input(*batch)
            with autocast:
                logits = model(images).float()
            hits = (logits.topk(min(5, logits.shape[1]), dim=1).indices == labels[:, None]).float()
            loss = F.cross_entropy(logits, labels, reduction="none")
            rows.append(torch.stack([loss, hits[:, 0], hits.amax(dim=1)], dim=1).double())
    except guard.UnreadableImage as e:
        problem = guard.unreadable(e)
    guard.stop_on_problems(gather_utils.all_gather_object(problem))  # before the gather, which every rank must reach
    rows = gather_utils.gather_for_metrics(torch.cat(rows), torch.tensor(indices), len(val_set))
    loss, acc1, acc5 = rows.mean(dim=0).tolist()
    return {"val_loss": loss, "val_acc1": 100 * acc1, "val_acc5": 100 * acc5, "val_samples": len(rows)}


@torch.no_grad()
def recalibrate_batch_norm(model, train_set, sampler, args, to_input):
    """Batch-norm statistics for the weights as they are, as precise BN computes them: the batch statistics of each
    rank's share of BN_IMAGES, averaged over ranks, so that all validate, and save, one model (docs/training.md)."""
    batches = max(1, min(BN_IMAGES // dist.get_world_size(), len(sampler)) // args.batch_size)  # len: the shard's
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=list(sampler)[: batches * args.batch_size],
                        num_workers=args.workers, drop_last=True, generator=torch.Generator().manual_seed(args.seed))
    with torch.random.fork_rng([to_input.device] if to_input.device.type == "cuda" else []):  # training's stream stays
        update_bn((to_input(*batch)[0] for batch in loader), model)  # reset, then a plain average over the batches
    for norm in model.modules():
        if getattr(norm, "track_running_stats", False):
            for stats in norm.running_mean, norm.running_var:  # equal batch counts: the mean over all batches
                dist.all_reduce(stats.div_(dist.get_world_size()))


def amp_context(args, device):
    dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def memory_format(args):
    return torch.channels_last if args.channels_last else torch.contiguous_format


def log(message):
    if dist.get_rank() == 0:
        print(message, flush=True)


def append_metrics(args, record):
    if dist.get_rank() == 0 and args.metrics_file:
        with open(args.metrics_file, "a") as f:
            f.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------- 7. checkpoints
def save_checkpoint(run, args):
    """Rank 0 hands a copy of the training state, with each rank's random stream for a resume to continue, to its
    writer thread, which writes last.pt while training goes on. Returns guard.replica_checksums."""
    checksums = guard.replica_checksums(run, args)
    rng = gather_utils.all_gather_object({"torch": torch.get_rng_state(),
                                          "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None})
    if dist.get_rank() == 0:
        state = {"model": run.model.module.state_dict(), "optimizer": run.optimizer.state_dict(),
                 "scaler": run.scaler.state_dict(), "epoch": run.epoch, "samples": run.samples, "step": run.step,
                 "world_size": dist.get_world_size(), "args": vars(args), "rng": rng,
                 "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}
        if run.written:
            run.written.result()  # one write at a time: one copy of the state in memory, however slow the disk
        run.written = run.writer.submit(guard.write_atomically, guard.on_host(state), guard.last_checkpoint(args))
    return checksums


def restore_training_state(checkpoint, run, args):
    """run's epoch, images of it trained, optimizer, scaler and random stream as saved; build_model loaded the model."""
    run.optimizer.load_state_dict(checkpoint["optimizer"])
    # The loaded state carries the old run's settings: this run's win (learning_rate sets lr at every step).
    for group in run.optimizer.param_groups:
        group.update(momentum=args.momentum, weight_decay=args.weight_decay)
    if checkpoint["scaler"]:  # empty when saved without --amp fp16: a new scaler starts from its defaults
        run.scaler.load_state_dict(checkpoint["scaler"])
    rng = checkpoint["rng"]
    if dist.get_rank() < len(rng):
        torch.set_rng_state(rng[dist.get_rank()]["torch"])
        if torch.cuda.is_available() and rng[dist.get_rank()]["cuda"] is not None:
            torch.cuda.set_rng_state(rng[dist.get_rank()]["cuda"])
    # Checkpoints before 2026-12-04 count the steps only, at the world size and batch that wrote them.
    per_step = checkpoint["world_size"] * checkpoint["args"]["batch_size"] * checkpoint["args"]["accum_steps"]
    run.epoch, run.samples = checkpoint["epoch"], checkpoint.get("samples", checkpoint["step"] * per_step)


# =================================================================================================
# What guards the story: bad input, failures, signals, and what the log reports.


if __name__ == "__main__":
    main()
