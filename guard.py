"""What guards a train_ddp.py run, kept out of its story: argument and file checks, the one-line failures,
the ranks' agreement to stop (SIGTERM, an unreadable image), elastic resume bookkeeping (run ids, the rest of a
shard, the learning rate placed by images), the atomic checkpoint write, NCCL's settings, batch norm synced on CPUs.

Copy it beside train_ddp.py and gather_utils.py, and keep it as it is: train_ddp.py calls it as guard.NAME.
"""
import hashlib
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torchvision
from torchvision.io import ImageReadMode, decode_image, read_file
from torchvision.transforms import v2

import gather_utils

CHECKPOINT_KEYS = {"model", "optimizer", "scaler", "epoch", "step", "world_size", "args", "rng"}


def say(line):
    """A line on stderr in one write, which the lines of other ranks on the same stream cannot split."""
    sys.stderr.write(f"train_ddp.py: {line}\n")


def fail(message, code=2):
    """Bad input (exit 2), or a verdict on values all ranks gathered (1): each machine's first process says it."""
    if env_local_rank() == 0:
        say(f"error: {message}")
    sys.exit(code)


def rank_error(message, code=1):
    """An error of this rank's own, which the others may not see: each rank says it, one line each."""
    say(f"error: rank {world_from_env()[0]}: {message}")
    sys.exit(code)


def env_local_rank():
    """This process's rank on its machine, known before the process group exists."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))


def world_from_env():
    """Global rank and world size: torchrun's, else an srun task's (only they have SLURM_STEP_ID), else one process."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "SLURM_STEP_ID" in os.environ:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    return 0, 1


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


def unreadable(error):
    """The line for an UnreadableImage, also one that a DataLoader worker raised (its text ends with ours)."""
    return f"cannot read {str(error).rsplit('UnreadableImage: ', 1)[-1].strip()}; remove or replace that file"


def raise_nccl_timeouts(args):
    """On NCCL, a collective past --collective-timeout: torch's watchdog logs it, dumps each rank's flight recorder
    beside the checkpoints and aborts NCCL, so that the next collective raises for process_group()'s one line."""
    Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    settings = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(args.checkpoint_dir).resolve() / "nccl_trace_rank_")}
    for name, value in settings.items():
        os.environ.setdefault(name, value)


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


def synced_clock(device):
    if device.type == "cuda":
        torch.cuda.synchronize()  # kernels run asynchronously: time what they did, not what was queued
    return time.perf_counter()


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


def last_checkpoint(args):
    return Path(args.checkpoint_dir) / "last.pt"


def remaining_shard(sampler, run, args):
    """This rank's indices for the rest of the epoch, in whole optimizer steps, as many on every rank; sets run.step.
    DistributedSampler deals the epoch's one order out in turn (rank r: entries r, r + world, ...), so the run.samples
    trained before, at any world size and batch, are its first ones: each rank skips its share (docs/checkpoints.md)."""
    world, rank, per_step = sampler.num_replicas, sampler.rank, args.batch_size * args.accum_steps
    skip = math.ceil((run.samples - rank) / world)  # this rank's entries before position run.samples
    steps_left = max(0, len(sampler) - math.ceil(run.samples / world)) // per_step  # rank 0's: it skips the most
    run.step = run.steps_per_epoch - steps_left
    return list(sampler)[skip: skip + steps_left * per_step]


def learning_rate(run, args, images_per_step):
    """The next step's: a linear warm-up over --warmup-epochs, then a cosine decay to 0 at --epochs. Placed by the
    images trained, not the steps, so that a resume at another world size or batch goes on along the same curve."""
    epochs_done = run.epoch + run.samples / (run.steps_per_epoch * images_per_step)
    if epochs_done < args.warmup_epochs:  # the first step already at 1 / warm-up steps of --lr
        return args.lr * (epochs_done + 1 / run.steps_per_epoch) / args.warmup_epochs
    progress = (epochs_done - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
    return args.lr * 0.5 * (1 + math.cos(math.pi * progress))


def changed_settings(checkpoint, args, samples):
    """For the resume line: what this run changes, and then trains with: the batch over all ranks, the optimizer's."""
    saved = f"{checkpoint['args']['batch_size']} x {checkpoint['args']['accum_steps']} x {checkpoint['world_size']}"
    now = f"{args.batch_size} x {args.accum_steps} x {dist.get_world_size()}"
    changed = [] if now == saved else [f"batch {now} (was {saved}; {samples} images of the epoch done)"]
    changed += [f"--{name.replace('_', '-')} {getattr(args, name):g} (was {checkpoint['args'][name]:g})"
                for name in ["lr", "momentum", "weight_decay"] if getattr(args, name) != checkpoint["args"][name]]
    return f"; with {', '.join(changed)}" if changed else ""


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


class CPUSyncBatchNorm(nn.BatchNorm2d):
    """Batch norm with statistics over all ranks, for CPU/gloo (nn.SyncBatchNorm needs GPUs), for torchvision's
    affine BatchNorm2d layers. The sums travel through a differentiable all-reduce: the backward is synchronized too."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        c, xf = x.shape[1], x.float()
        count = xf.new_full((1,), x.numel() / c)
        totals = dist_nn.all_reduce(torch.cat([xf.sum((0, 2, 3)), (xf * xf).sum((0, 2, 3)), count]))
        n = totals[-1]
        mean = totals[:c] / n
        var = (totals[c:2 * c] / n - mean * mean).clamp_min(0)  # E[x²] - mean² can round below 0
        with torch.no_grad():
            self.num_batches_tracked += 1
            weight = 1 / self.num_batches_tracked.item() if self.momentum is None else self.momentum  # a plain average
            self.running_mean.lerp_(mean, weight)
            self.running_var.lerp_(var * n / (n - 1), weight)
        scale = self.weight * torch.rsqrt(var + self.eps)
        return (xf * scale.view(1, c, 1, 1) + (self.bias - mean * scale).view(1, c, 1, 1)).to(x.dtype)


def convert_to_cpu_sync_bn(module):
    """Swap every BatchNorm2d for a CPUSyncBatchNorm with the same state (and state_dict keys)."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            sync = CPUSyncBatchNorm(child.num_features, child.eps, child.momentum)
            sync.load_state_dict(child.state_dict())
            setattr(module, name, sync)
        else:
            convert_to_cpu_sync_bn(child)
    return module
