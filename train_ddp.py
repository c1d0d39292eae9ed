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
import hashlib
import json
import math
import os
import sys
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
from torchvision.io import ImageReadMode, decode_image, read_file
from torchvision.transforms import v2

import gather_utils

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
CHECKPOINT_KEYS = {"model", "optimizer", "scaler", "epoch", "step", "world_size", "args", "rng"}
BN_IMAGES = 1024  # recalibrate_batch_norm's images over all ranks, at most the train set: precise BN's count


def main(argv=None):
    args = parse_args(argv)  # 1. arguments
    # Read before the process group forms, so that a bad file fails fast, and every rank with it.
    resume_from, checkpoint = load_checkpoint(args)
    if args.dry_run:
        return
    # Noted from here on: a SIGTERM during the set-up, or held since start-up, stops training at its first step.
    stop = None if args.evaluate else StopAgreement()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    device = setup_device(args)  # 2. device
    with process_group(args, device):  # 3. process group, and 8. clean-up when the block ends
        train_or_evaluate(args, device, resume_from, checkpoint, stop)


# ---------------------------------------------------------------- 1. arguments, and the checkpoint to resume from
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="DDP training of a torchvision classifier (see docs/training.md).")
    p.error = fail  # one line, not argparse's usage, from every rank
    p.add_argument("--local-rank", "--local_rank", type=int, default=env_local_rank(),
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
    weights = named_weights(args)
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
    check_args(args)
    return args


def load_checkpoint(args):
    """(path, checkpoint) to resume from, read on every rank; (None, None) for a fresh start."""
    path = resume_path(args)
    if path is None:
        return None, None
    if not path.is_file():
        fail(f"--resume {path}: no such file; expected a last.pt written by train_ddp.py")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        fail(f"--resume {path}: not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0]})")
    if not isinstance(checkpoint, dict) or not CHECKPOINT_KEYS <= checkpoint.keys():
        fail(f"--resume {path}: not a train_ddp.py checkpoint (expected the keys {', '.join(sorted(CHECKPOINT_KEYS))})")
    if checkpoint["args"]["arch"] != args.arch:
        fail(f"--resume {path} holds a {checkpoint['args']['arch']} model but --arch is {args.arch}")
    if not args.image_size_given:  # continue at the sizes the run started with (a fine-tune's came from its weights)
        sizes = ["image_size", "resize", "interpolation"]
        args.image_size, args.resize, args.interpolation = (checkpoint["args"].get(k, getattr(args, k)) for k in sizes)
    return path, checkpoint


def resume_path(args):
    """--resume, unless this torchrun job (its run id) has written a last.pt: then that one, which a restart
    (MAX_RESTARTS) goes on from, and a node that joins an elastic job (NNODES=MIN:MAX) as well."""
    last, job = last_checkpoint(args), os.environ.get("TORCHELASTIC_RUN_ID")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    # torchrun's default id, "none", is every job's: only a restart may take a last.pt of that id for its own.
    if last.exists() and not args.evaluate and (restarted or job not in (None, "none")):
        try:  # a last.pt that an earlier job left in the same directory must not pass for this job's
            run_id = torch.load(last, map_location="cpu", weights_only=True, mmap=True).get("run_id")
        except Exception:  # unreadable: not this job's, which writes atomically
            run_id = None
        if run_id == job:
            return last
        if restarted and world_from_env()[0] == 0:
            say(f"restart: ignoring {last}, written by another job (run id {run_id})")
    return Path(args.resume) if args.resume else None


# ---------------------------------------------------------------- 2. device
def setup_device(args):
    # Before any CUDA work: otherwise every rank creates its context and tensors on GPU 0.
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # srun with one GPU per task: each task sees a single GPU, whatever its local rank.
    one_per_task = torch.cuda.device_count() == 1 and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) == 1
    index = 0 if one_per_task else args.local_rank
    if index >= torch.cuda.device_count():  # srun: more tasks on a node than its GPUs
        rank_error(f"local rank {index} but only {torch.cuda.device_count()} GPUs are visible; "
                   "start at most one process per GPU", code=2)
    torch.cuda.set_device(index)
    torch.backends.cudnn.benchmark = True  # fixed input sizes: time the conv kernels once, keep the fastest
    raise_nccl_timeouts(args)  # read as NCCL starts
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
        rank_error(f"a collective failed: another rank stopped, or stopped answering for --collective-timeout "
                   f"{args.collective_timeout:g} s; look for its own error ({str(e).strip().splitlines()[0]})"
                   + (recorded if trace.is_file() else ""))
    finally:
        dist.destroy_process_group()


def init_distributed(args, device):
    rank, world_size = world_from_env()
    # On GPUs one group, two backends: NCCL for CUDA tensors, gloo for the small CPU ones, never queued behind grads.
    backend = "cpu:gloo,cuda:nccl" if args.backend == "nccl" else args.backend
    bind = {"device_id": device} if device.type == "cuda" else {}  # NCCL's communicator on this GPU, at once
    if world_size == 1 and "MASTER_ADDR" not in os.environ:  # no launcher: a store in memory, no address, no port
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **bind)
        return
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        fail("WORLD_SIZE > 1 but MASTER_ADDR or MASTER_PORT is not set; under srun export both (docs/launching.md)")
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
        rank_error(init_failure(e, args, world_size, address))
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # torch 2.3
    set_timeout(datetime.timedelta(seconds=args.collective_timeout))


def world_from_env():
    """Global rank and world size: torchrun's, else an srun task's (only they have SLURM_STEP_ID), else one process."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "SLURM_STEP_ID" in os.environ:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    return 0, 1


# ---------------------------------------------------------------- 4. to 7., in the process group
def train_or_evaluate(args, device, resume_from, checkpoint, stop):
    """Steps 4 to 7, a function of their own: the DDP model must be freed before process_group() ends the group."""
    check_same_start(checkpoint)
    train_set, val_set = build_datasets(args)  # 4. data
    steps = steps_per_epoch(train_set, args)
    if named_weights(args):
        fetch_weights(named_weights(args))
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
            f"{changed_settings(checkpoint, args, run.samples)}")
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
    return (torchvision.datasets.ImageFolder(root / "train", v2.Compose(train), loader=read_image, allow_empty=True),
            torchvision.datasets.ImageFolder(root / "val", v2.Compose(val), loader=read_image, allow_empty=True))


class UnreadableImage(Exception):
    """A file of --data that no decoder can read: damaged, truncated, or not an image."""


def read_image(path):
    """A file as 3-channel RGB uint8 (grayscale, CMYK and alpha alike): torchvision.io's decoders for the formats they
    read (JPEG, PNG; GIF, WebP in newer ones), a third of PIL's time for JPEG; PIL for the others (BMP, TIFF, ...)."""
    try:
        image = decode_image(read_file(path), mode=ImageReadMode.RGB)
    except RuntimeError:  # not a format torchvision.io reads, or a damaged file: PIL tells which
        try:
            image = v2.functional.pil_to_tensor(torchvision.datasets.folder.pil_loader(path))
        except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ... for damaged files
            raise UnreadableImage(f"{path} ({type(e).__name__}: {str(e).strip()})") from None
    return image if image.dtype == torch.uint8 else v2.functional.to_dtype(image, torch.uint8, scale=True)


def steps_per_epoch(train_set, args):
    """Optimizer steps per epoch: the same on every rank, as DistributedSampler gives equal shards."""
    shard = math.ceil(len(train_set) / dist.get_world_size())
    steps = shard // (args.batch_size * args.accum_steps)
    if steps == 0:
        fail(f"the train set ({len(train_set)} images over {dist.get_world_size()} ranks) is smaller than one step of "
             f"--batch-size {args.batch_size} x --accum-steps {args.accum_steps} per rank")
    return steps


# ---------------------------------------------------------------- 5. model, DDP, hooks
def build_model(args, checkpoint):
    """The bare model on the CPU, the same on every rank: from the checkpoint, else --weights, else --seed.
    Returns it, and the layers that --weights left new: a classifier for another number of classes."""
    torch.manual_seed(args.seed)
    model = torchvision.models.get_model(args.arch, weights=None, num_classes=num_classes(args))
    if checkpoint:
        model.load_state_dict(checkpoint["model"])
    elif args.weights:
        weights = named_weights(args)
        state, new = fit_weights(weights.get_state_dict() if weights else read_weights_file(args.weights), model, args)
        model.load_state_dict(state)
        return model, new
    return model, []


def num_classes(args):
    """--num-classes, or with --data ImageFolder's classes: the folders in train/."""
    if args.data:
        return len(torchvision.datasets.folder.find_classes(Path(args.data) / "train")[0])
    return args.num_classes


def fit_weights(state, model, args):
    """--weights' state dict, for `model`: every key, of the same shape, but the classifier's, which may be for another
    number of classes; then the model keeps its new one. Returns the state to load, and the layers left new."""
    own, theirs = model.state_dict(), set(state) if isinstance(state, dict) else set()
    missing = {key for key in own.keys() - theirs if not key.endswith("num_batches_tracked")}  # weights before 0.4.1
    if missing or theirs - own.keys():
        fail(f"--weights {args.weights} does not fit --arch {args.arch}: missing keys {sorted(missing)[:3]}, "
             f"unexpected keys {sorted(theirs - own.keys())[:3]}")
    new = [key for key in theirs if state[key].shape != own[key].shape]
    for key in new:
        if state[key].shape[1:] != own[key].shape[1:] or own[key].shape[0] != num_classes(args):
            fail(f"--weights {args.weights} does not fit --arch {args.arch}: {key} has shape "
                 f"{list(state[key].shape)}, expected {list(own[key].shape)}")
    return {**state, **{key: own[key] for key in new}}, sorted({key.rpartition(".")[0] for key in new})


def fetch_weights(weights):
    """Torchvision weights into torch's hub cache ($TORCH_HOME), downloaded once per machine: by its first process,
    while the others wait in the gather; then every rank loads them from there."""
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)
    problem = None
    if env_local_rank() == 0 and not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(weights.url, str(path), progress=False)
        except Exception as e:
            problem = (f"--weights {weights}: could not download {weights.url} ({type(e).__name__}: {e}); without a "
                       f"network, place that file at {path}, or pass --weights PATH to a state dict")
    stop_on_problems(gather_utils.all_gather_object(problem))


def wrap_ddp(model, args, device, warmup_steps):
    if args.sync_bn:
        if device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:  # nn.SyncBatchNorm runs on GPUs only
            from cpu_sync_bn import convert_to_cpu_sync_bn
            model = convert_to_cpu_sync_bn(model)
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


def learning_rate(run, args, images_per_step):
    """The next step's: a linear warm-up over --warmup-epochs, then a cosine decay to 0 at --epochs. Placed by the
    images trained, not the steps, so that a resume at another world size or batch goes on along the same curve."""
    epochs_done = run.epoch + run.samples / (run.steps_per_epoch * images_per_step)
    if epochs_done < args.warmup_epochs:  # the first step already at 1 / warm-up steps of --lr
        return args.lr * (epochs_done + 1 / run.steps_per_epoch) / args.warmup_epochs
    progress = (epochs_done - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
    return args.lr * 0.5 * (1 + math.cos(math.pi * progress))


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
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=remaining_shard(sampler, run, args),
                            num_workers=args.workers, pin_memory=to_input.device.type == "cuda", drop_last=True,
                            generator=torch.Generator().manual_seed(worker_seed))
        train_stats, stopped = train_one_epoch(run, loader, args, to_input, stop)
        if stopped:
            save_checkpoint(run, args)
            log(f"stopped by SIGTERM at epoch {epoch + 1} step {run.step}/{run.steps_per_epoch}; "
                f"continue with --resume {last_checkpoint(args)}")
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
            log(f"stopped by SIGTERM after epoch {epoch + 1}; continue with --resume {last_checkpoint(args)}")
            return


def remaining_shard(sampler, run, args):
    """This rank's indices for the rest of the epoch, in whole optimizer steps, as many on every rank; sets run.step.
    DistributedSampler deals the epoch's one order out in turn (rank r: entries r, r + world, ...), so the run.samples
    trained before, at any world size and batch, are its first ones: each rank skips its share (docs/checkpoints.md)."""
    world, rank, per_step = sampler.num_replicas, sampler.rank, args.batch_size * args.accum_steps
    skip = math.ceil((run.samples - rank) / world)  # this rank's entries before position run.samples
    steps_left = max(0, len(sampler) - math.ceil(run.samples / world)) // per_step  # rank 0's: it skips the most
    run.step = run.steps_per_epoch - steps_left
    return list(sampler)[skip: skip + steps_left * per_step]


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
    marks = [(run.step, synced_clock(to_input.device), 0.0)]
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
        lr = learning_rate(run, args, images_per_step)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        run.step, run.samples = run.step + 1, run.samples + images_per_step
        loss_sum += step_loss
        if run.step % args.log_every == 0 or run.step == run.steps_per_epoch:
            (line_step, line_began, line_waited), now = marks[-1], synced_clock(to_input.device)
            data = (waited - line_waited) / (now - line_began)  # the share of the time since the line before
            mean = gather_utils.all_reduce_mean({"loss": step_loss, "data": data})
            if not math.isfinite(mean["loss"]):
                fail(f"the loss is {mean['loss']} at epoch {run.epoch + 1} step {run.step}: training diverged; "
                     f"lower --lr ({args.lr:g} now) or check the data; {last_checkpoint(args)} is unchanged", code=1)
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
    except UnreadableImage as e:
        micro_batches, problem = [], unreadable(e)
    stop.send(problem)
    return micro_batches


def synced_clock(device):
    if device.type == "cuda":
        torch.cuda.synchronize()  # kernels run asynchronously: time what they did, not what was queued
    return time.perf_counter()


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
    except UnreadableImage as e:
        problem = unreadable(e)
    stop_on_problems(gather_utils.all_gather_object(problem))  # before the gather, which every rank must reach
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
    writer thread, which writes last.pt while training goes on. Returns replica_checksums."""
    checksums = replica_checksums(run, args)
    rng = gather_utils.all_gather_object({"torch": torch.get_rng_state(),
                                          "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None})
    if dist.get_rank() == 0:
        state = {"model": run.model.module.state_dict(), "optimizer": run.optimizer.state_dict(),
                 "scaler": run.scaler.state_dict(), "epoch": run.epoch, "samples": run.samples, "step": run.step,
                 "world_size": dist.get_world_size(), "args": vars(args), "rng": rng,
                 "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}
        if run.written:
            run.written.result()  # one write at a time: one copy of the state in memory, however slow the disk
        run.written = run.writer.submit(write_atomically, on_host(state), last_checkpoint(args))
    return checksums


def on_host(value):
    """A copy in host memory of the tensors in nested dicts and lists, which training goes on changing in place."""
    if isinstance(value, dict):
        return {key: on_host(item) for key, item in value.items()}
    if isinstance(value, list):
        return [on_host(item) for item in value]
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def write_atomically(state, path):
    """To last.pt.tmp, flushed and fsynced, then renamed over last.pt: a kill at any moment leaves the old file or the
    new one, never a torn one. A write that fails (a full disk) ends the process, with one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:  # on the writer thread, where sys.exit would end the thread only
        say(f"error: rank 0: could not write {path} ({type(e).__name__}: {str(e).strip().splitlines()[0]})")
        os._exit(1)


def last_checkpoint(args):
    return Path(args.checkpoint_dir) / "last.pt"


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


def changed_settings(checkpoint, args, samples):
    """For the resume line: what this run changes, and then trains with: the batch over all ranks, the optimizer's."""
    saved = f"{checkpoint['args']['batch_size']} x {checkpoint['args']['accum_steps']} x {checkpoint['world_size']}"
    now = f"{args.batch_size} x {args.accum_steps} x {dist.get_world_size()}"
    changed = [] if now == saved else [f"batch {now} (was {saved}; {samples} images of the epoch done)"]
    changed += [f"--{name.replace('_', '-')} {getattr(args, name):g} (was {checkpoint['args'][name]:g})"
                for name in ["lr", "momentum", "weight_decay"] if getattr(args, name) != checkpoint["args"][name]]
    return f"; with {', '.join(changed)}" if changed else ""


# =================================================================================================
# What guards the story: bad input, failures, signals, and what the log reports.


def env_local_rank():
    """This process's rank on its machine, known before the process group exists."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))


def fail(message, code=2):
    """Bad input (exit 2), or a verdict on values all ranks gathered (1): each machine's first process says it."""
    if env_local_rank() == 0:
        say(f"error: {message}")
    sys.exit(code)


def rank_error(message, code=1):
    """An error of this rank's own, which the others may not see: each rank says it, one line each."""
    say(f"error: rank {world_from_env()[0]}: {message}")
    sys.exit(code)


def say(line):
    """A line on stderr in one write, which the lines of other ranks on the same stream cannot split."""
    sys.stderr.write(f"train_ddp.py: {line}\n")


def check_args(args):
    """Reject bad input before any process group exists, so nothing can hang on it."""
    for name in ["epochs", "batch_size", "accum_steps", "train_samples", "val_samples", "image_size", "log_every"]:
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.save_every is not None and args.save_every < 1:
        fail(f"--save-every must be a positive number of optimizer steps, got {args.save_every}")
    if args.num_classes < 2:
        fail(f"--num-classes must be at least 2, got {args.num_classes}")
    if args.workers < 0:
        fail(f"--workers must be 0 or more, got {args.workers}")
    for name in ["init_timeout", "collective_timeout"]:
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be a positive number of seconds, got {getattr(args, name)}")
    check_arch_trains(args.arch, args.image_size, training=not args.evaluate)
    if args.backend == "nccl" and not torch.cuda.is_available():
        fail("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo (or auto)")
    # torchrun and launch.sh's dry run say how many processes share this machine; torch's count heeds MIG and masks.
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and local_world_size > torch.cuda.device_count():
        fail(f"{local_world_size} processes on this machine but only {torch.cuda.device_count()} GPUs are "
             "visible; start at most one process per GPU")
    if args.evaluate and not (args.resume or args.weights):
        fail("--evaluate needs --resume PATH or --weights: the model to validate")
    if args.resume and args.weights:
        fail("--resume and --weights: a resume continues from its checkpoint's weights; expected one of them")
    if args.comm_hook == "powersgd" and args.amp == "fp16":
        fail("--comm-hook powersgd cannot run with --amp fp16: one overflowed fp16 step would leave inf in "
             "PowerSGD's error feedback and skip every later step; use --amp bf16")
    if args.data:
        check_image_folder(Path(args.data))
    if args.weights and not named_weights(args):
        with torch.device("meta"):  # shapes only
            model = torchvision.models.get_model(args.arch, num_classes=num_classes(args))
        fit_weights(read_weights_file(args.weights), model, args)
    check_writable(Path(args.checkpoint_dir), "--checkpoint-dir")
    if args.metrics_file:
        check_writable(Path(args.metrics_file).parent, "--metrics-file")
    check_shared_memory(args)


def named_weights(args):
    """The torchvision weights --weights names (IMAGENET1K_V2, DEFAULT, ResNet50_Weights.IMAGENET1K_V2), or None."""
    if not args.weights or Path(args.weights).is_file():
        return None
    kinds = torchvision.models.get_model_weights(args.arch)
    kind, _, name = args.weights.rpartition(".")
    if kind not in ("", kinds.__name__) or name not in kinds.__members__:
        fail(f"--weights {args.weights}: no such file, nor weights of --arch {args.arch}; expected a file or one of "
             f"{', '.join(kinds.__members__)}")
    return kinds[name]


def read_weights_file(path):
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        fail(f"--weights {path}: not a readable state dict ({type(e).__name__}: {str(e).strip().splitlines()[0]})")
    return state["model"] if isinstance(state, dict) and "model" in state else state  # a last.pt holds one


def check_arch_trains(arch, image_size, training):
    """A forward on the meta device (shapes only): a model that cannot train at this size, or returns more, fails."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # googlenet and inception_v3 warn about their init
        try:
            model = torchvision.models.get_model(arch, weights=None, num_classes=2)
        except Exception:  # a few (the regnets) compute while they build, which meta cannot: not checked
            return
        try:
            out = model.train(training)(torch.empty(2, 3, image_size, image_size))
        except Exception as e:
            fail(f"--arch {arch} cannot train on {image_size} px images ({type(e).__name__}: "
                 f"{str(e).strip().splitlines()[0]}); expected a larger --image-size or another --arch")
    if not isinstance(out, torch.Tensor):
        fail(f"--arch {arch} returns {type(out).__name__}, not logits; expected another --arch")


def check_writable(directory, flag):
    """Fail now rather than after an epoch of training, at the first save."""
    existing = next(d for d in [directory, *directory.parents] if d.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        fail(f"{flag}: cannot write under {existing}; expected a writable directory")


def check_shared_memory(args):
    """DataLoader workers hand batches over in /dev/shm: running out (a container's 64 MB) kills them mid-epoch."""
    if args.workers == 0 or not os.path.isdir("/dev/shm"):
        return
    # The processes of this machine: torchrun's count, else the most srun tasks on one node ("8(x2),4").
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or max(
        int(tasks.split("(")[0]) for tasks in os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split(","))
    shm = os.statvfs("/dev/shm")
    free_mb = shm.f_bavail * shm.f_frsize / 2**20
    batch_mb = args.batch_size * 3 * args.image_size**2 / 2**20  # uint8 images
    # Each worker prefetches 2 batches (DataLoader's default), and the process holds a step's micro-batches.
    batches = 2 * args.workers + args.accum_steps
    need_mb = local_world_size * batches * batch_mb
    if need_mb > free_mb:
        fail(f"--workers {args.workers}: {local_world_size} process(es) x {batches} batches of "
             f"{batch_mb:.0f} MB need {need_mb:.0f} MB of /dev/shm, which has {free_mb:.0f} MB free; expected "
             "fewer --workers, a smaller --batch-size, or a larger /dev/shm (docker run --shm-size=8g)")


def check_image_folder(root):
    if not root.is_dir():
        fail(f"--data {root}: no such directory; expected an ImageFolder root with train/ and val/")
    for split in ["train", "val"]:
        files = (name.lower() for _, _, names in os.walk(root / split) for name in names)
        if not any(name.endswith(torchvision.datasets.folder.IMG_EXTENSIONS) for name in files):
            fail(f"--data {root}: {root / split} holds no images; expected {root / split}/<class>/<image>.jpg")
    # ImageFolder numbers the classes of each split by its own folder names.
    train, val = ({d.name for d in (root / split).iterdir() if d.is_dir()} for split in ["train", "val"])
    if train != val:
        fail(f"--data {root}: train/ and val/ must hold the same class folders, or the labels differ "
             f"(only in train/: {sorted(train - val)}; only in val/: {sorted(val - train)})")


def init_failure(error, args, world_size, address):
    """Why the process group did not form, in one line that says what to change."""
    text = str(error)
    duplicate = [line.strip() for line in text.splitlines() if "Duplicate GPU" in line]
    if duplicate:  # NCCL: two processes that see the same single GPU, e.g. SLURM tasks without GPU binding
        return (f"two ranks share one GPU ({duplicate[0]}); give each process a GPU of its own "
                "(srun --gpus-per-task=1, or one launch.sh per node)")
    reason = text.strip().splitlines()[0]
    if "gloo" in text.lower():
        reason += ("; gloo finds its network interface from the hostname and ignores NCCL_SOCKET_IFNAME: "
                   "set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on")
    return (f"the process group did not form within --init-timeout {args.init_timeout:g} s: "
            f"expected WORLD_SIZE={world_size} ranks at {address}, and not all came or could connect ({reason})")


def raise_nccl_timeouts(args):
    """On NCCL, a collective past --collective-timeout: torch's watchdog logs it, dumps each rank's flight recorder
    beside the checkpoints and aborts NCCL, so that the next collective raises for process_group()'s one line."""
    Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    settings = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(args.checkpoint_dir).resolve() / "nccl_trace_rank_")}
    for name, value in settings.items():
        os.environ.setdefault(name, value)


def check_same_start(checkpoint):
    """Every rank must resume from the same checkpoint (nodes with disks of their own may not), or the ranks hang."""
    start = "a fresh start"
    if checkpoint is not None:
        weights = hashlib.blake2b(digest_size=6)
        for tensor in checkpoint["model"].values():
            weights.update(tensor.reshape(-1).view(torch.uint8).numpy())
        start = f"epoch {checkpoint['epoch']} step {checkpoint['step']}, weights {weights.hexdigest()}"
    ranks_by_start = {}
    for rank, other in enumerate(gather_utils.all_gather_object(start)):
        ranks_by_start.setdefault(other, []).append(str(rank))
    if len(ranks_by_start) > 1:
        where = "; ".join(f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)}: {text}"
                          for text, ranks in ranks_by_start.items())
        fail(f"the ranks would resume from different checkpoints ({where}); give every node the same --resume "
             "file, and a --checkpoint-dir they all see (a shared filesystem)")


class StopAgreement:
    """SLURM and Kubernetes send SIGTERM before they kill a job. The handler only notes it; before every optimizer
    step, and after each validation but the last, the ranks agree, so that one rank's SIGTERM, or an image it cannot
    read, stops all at the same point: an all-reduce of two flags on the CPU backend, which never waits for the GPU."""

    def __init__(self):
        self.requested = False  # set by the handler, which Python runs in the main thread
        signal.signal(signal.SIGTERM, self.note)
        self.flags, self.sent, self.problem = torch.zeros(2, dtype=torch.int32), None, None

    def note(self, signum, frame):
        self.requested = True
        # Ignored from now: a second one (SLURM and launch.sh may send several) cannot kill the process as it exits.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def send(self, problem=None):
        """Start this rank's flags on their way: a SIGTERM noted so far, and whether it has a `problem`."""
        self.problem = problem
        self.flags[0].fill_(self.requested)
        self.flags[1].fill_(problem is not None)
        self.sent = dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, async_op=True)

    def agreed(self):
        """Whether to stop, by the flags sent last (or now): for a SIGTERM on any rank; for a problem, all exit."""
        if self.sent is None:
            self.send()
        self.sent.wait()
        self.sent = None
        sigterm, problems = self.flags.tolist()  # a CPU tensor: reading it waits for no GPU
        if problems:
            stop_on_problems(gather_utils.all_gather_object(self.problem))
        return bool(sigterm)


def stop_on_problems(problems):
    """Every rank's problem (or None), as every rank gathered them. If any has one, each rank that has it says so,
    rank 0 says who, and all exit 1 together, instead of leaving the others waiting in their next collective."""
    failed = [rank for rank, problem in enumerate(problems) if problem]
    if problems[dist.get_rank()]:
        rank_error(problems[dist.get_rank()])
    if failed:
        if dist.get_rank() == 0:
            say(f"error: rank 0: stopping: rank {', '.join(map(str, failed))} failed (see above)")
        sys.exit(1)


def unreadable(error):
    """The line for an UnreadableImage, also one that a DataLoader worker raised (its text ends with ours)."""
    return f"cannot read {str(error).rsplit('UnreadableImage: ', 1)[-1].strip()}; remove or replace that file"


def replica_checksums(run, args):
    """Each rank's parameter checksum, which DDP keeps equal: a difference (a broken sync), or nan, stops every rank."""
    checksum = sum(p.detach().double().sum() * (i + 1) for i, p in enumerate(run.model.parameters())).item()
    checksums = gather_utils.all_gather_object(checksum)
    if not all(map(math.isfinite, checksums)):
        fail(f"the model's weights are not finite at epoch {run.epoch + 1} step {run.step} (checksums per rank: "
             f"{checksums}): training diverged; lower --lr or check the data; {last_checkpoint(args)} is unchanged", 1)
    if len(set(checksums)) != 1:
        fail(f"the model replicas diverged (parameter checksums per rank: {checksums}); expected equal ones", 1)
    return checksums


if __name__ == "__main__":
    main()
