"""What keeps a train_ddp.py run safe, out of its story: argument and file checks, the one-line
failures, the ranks' agreement to stop (a SIGTERM, an unreadable image), resume bookkeeping (run
ids, the rest of a shard, the learning rate placed by images), the atomic checkpoint writer, NCCL's
settings, the log lines, precise batch norm, and batch norm synced on CPUs.

Copy it beside train_ddp.py and gather_utils.py and keep it as it is; train_ddp.py calls it as
guard.NAME. The checks and the resume bookkeeping need no process group (the tests call them in one
process); what runs in the group reads its rank and size, and what gathers or reduces says that
every rank must call it.
"""
import datetime
import hashlib
import math
import os
import shutil
import signal
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.torch_version import TorchVersion
from torchvision.io import ImageReadMode, decode_image, read_file
from torchvision.transforms import v2

import gather_utils

# How long a rank that another's SIGTERM stopped waits for its own (leave_as_the_elastic_agent_
# expects): torchrun's agent polls its workers and the waiting nodes every 0.1 s (5 s on torch 2.3).
ELASTIC_WAIT = 10
# What the old ProcessGroupNCCL writes when it fails, beneath every prefix of torchrun's store
# (ProcessGroupNCCL.hpp: kStoreDumpKey; torch 2.3 named it timeout_dump). torch 2.15's
# ProcessGroupNCCL2 writes none.
NCCL_SIGNAL_KEYS = ["exception_dump", "timeout_dump"]
# The first words of what torch 2.15's ProcessGroupNCCL2 raises at the next collective once a rank
# is gone: a RuntimeError, not the old class's DistBackendError (nccl2/ProcessGroupNCCLUtils.cpp,
# checkAndAbortIfTimedOutOrError).
NCCL2_FAILURES = ("NCCL operation timed out", "NCCL Async Error", "NCCL communicator was aborted")


# ------------------------------------------------------------------------- one-line failures
def say(line):
    """A line on stderr in one write, which other ranks' lines on the same stream cannot split."""
    sys.stderr.write(f"train_ddp.py: {line}\n")


def fail(message, code=2):
    """Bad input (exit 2), or a verdict on values all ranks gathered (1): each machine's first
    process says it."""
    if env_local_rank() == 0:
        say(f"error: {message}")
    sys.exit(code)


def rank_error(message, code=1, at_once=False):
    """An error of this rank's own, which the others may not see: each rank says it, one line.
    at_once: exit without Python's clean-up, which a broken process group can block
    (collective_failed)."""
    say(f"error: rank {world_from_env()[0]}: {message}")
    if at_once:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def first_line(error):
    return str(error).strip().splitlines()[0]


def env_local_rank():
    """This process's rank on its machine, known before the process group exists."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))


def world_from_env():
    """Global rank and world size: torchrun's, else an srun task's (only they have SLURM_STEP_ID),
    else one process."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "SLURM_STEP_ID" in os.environ:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    return 0, 1


# -------------------------------------------------------------------- arguments and files
def settle_args(args, device_defaults):
    """The arguments completed: --weights' recipe sizes (the sizes its weights were published with),
    else this device's defaults; validation's resize; the backend. Then checked."""
    args.image_size_given = args.image_size is not None
    weights = named_weights(args)
    if weights and args.image_size is None:
        recipe = weights.transforms()
        args.image_size, args.resize = recipe.crop_size[0], recipe.resize_size[0]
        args.interpolation = recipe.interpolation.value
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in device_defaults[device_type].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.resize = args.resize or args.image_size * 256 // 224
    if args.backend == "auto":
        args.backend = "nccl" if device_type == "cuda" else "gloo"
    check_args(args)
    return args


def check_args(args):
    """Reject bad input before any process group exists, so that nothing can hang on it."""
    for name in ["epochs", "batch_size", "accum_steps", "train_samples", "val_samples",
                 "image_size", "log_every"]:
        if getattr(args, name) < 1:
            fail(f"--{dashed(name)} must be a positive integer, got {getattr(args, name)}")
    if args.save_every is not None and args.save_every < 1:
        fail(f"--save-every must be a positive number of optimizer steps, got {args.save_every}")
    if args.num_classes < 2:
        fail(f"--num-classes must be at least 2, got {args.num_classes}")
    if args.workers < 0:
        fail(f"--workers must be 0 or more, got {args.workers}")
    for name in ["init_timeout", "collective_timeout"]:
        if getattr(args, name) <= 0:
            fail(f"--{dashed(name)} must be a positive number of seconds, "
                 f"got {getattr(args, name)}")
    check_arch_trains(args.arch, args.image_size, training=not args.evaluate)
    if args.backend == "nccl" and not torch.cuda.is_available():
        fail("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo (or auto)")
    # torchrun and launch.sh's dry run say how many processes share this machine; torch's count
    # of GPUs heeds MIG and masks.
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and local_world_size > torch.cuda.device_count():
        fail(f"{local_world_size} processes on this machine but only {torch.cuda.device_count()} "
             "GPUs are visible; start at most one process per GPU")
    if args.evaluate and not (args.resume or args.weights):
        fail("--evaluate needs --resume PATH or --weights: the model to validate")
    if args.resume and args.weights:
        fail("--resume and --weights: a resume continues from its checkpoint's weights; "
             "expected one of them")
    if args.comm_hook == "powersgd" and args.amp == "fp16":
        fail("--comm-hook powersgd cannot run with --amp fp16: one overflowed fp16 step would "
             "leave inf in PowerSGD's error feedback and skip every later step; use --amp bf16")
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


def dashed(name):
    return name.replace("_", "-")


def check_arch_trains(arch, image_size, training):
    """A forward on the meta device (shapes only): a model that cannot train at this size, or
    returns more than logits, fails."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # googlenet and inception_v3 warn about their init
        try:
            model = torchvision.models.get_model(arch, weights=None, num_classes=2)
        except Exception:  # a few (the regnets) compute while they build: not checked
            return
        try:
            out = model.train(training)(torch.empty(2, 3, image_size, image_size))
        except Exception as e:
            fail(f"--arch {arch} cannot train on {image_size} px images ({type(e).__name__}: "
                 f"{first_line(e)}); expected a larger --image-size or another --arch")
    if not isinstance(out, torch.Tensor):
        fail(f"--arch {arch} returns {type(out).__name__}, not logits; expected another --arch")


def check_writable(directory, flag):
    """Fail now rather than after an epoch of training, at the first save."""
    existing = next(d for d in [directory, *directory.parents] if d.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        fail(f"{flag}: cannot write under {existing}; expected a writable directory")


def check_shared_memory(args):
    """DataLoader workers hand batches over in /dev/shm: running out (a container's 64 MB) kills
    them mid-epoch."""
    if args.workers == 0 or not os.path.isdir("/dev/shm"):
        return
    # This machine's processes: torchrun's count, else the most srun tasks on a node ("8(x2),4").
    srun_tasks = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split(",")
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or max(
        int(tasks.split("(")[0]) for tasks in srun_tasks)
    shm = os.statvfs("/dev/shm")
    free_mb = shm.f_bavail * shm.f_frsize / 2**20
    batch_mb = args.batch_size * 3 * args.image_size**2 / 2**20  # uint8 images
    # Each worker prefetches 2 batches (DataLoader's default); the process holds a step's batches.
    batches = 2 * args.workers + args.accum_steps
    need_mb = local_world_size * batches * batch_mb
    if need_mb > free_mb:
        fail(f"--workers {args.workers}: {local_world_size} process(es) x {batches} batches of "
             f"{batch_mb:.0f} MB need {need_mb:.0f} MB of /dev/shm, which has {free_mb:.0f} MB "
             "free; expected fewer --workers, a smaller --batch-size, or a larger /dev/shm "
             "(docker run --shm-size=8g)")


def check_image_folder(root):
    if not root.is_dir():
        fail(f"--data {root}: no such directory; expected an ImageFolder root with train/ and val/")
    for split in ["train", "val"]:
        files = (name.lower() for _, _, names in os.walk(root / split) for name in names)
        if not any(name.endswith(torchvision.datasets.folder.IMG_EXTENSIONS) for name in files):
            fail(f"--data {root}: {root / split} holds no images; "
                 f"expected {root / split}/<class>/<image>.jpg")
    # ImageFolder numbers the classes of each split by its own folder names.
    train, val = ({d.name for d in (root / split).iterdir() if d.is_dir()}
                  for split in ["train", "val"])
    if train != val:
        fail(f"--data {root}: train/ and val/ must hold the same class folders, or the labels "
             f"differ (only in train/: {sorted(train - val)}; only in val/: {sorted(val - train)})")


def num_classes(args):
    """--num-classes, or with --data ImageFolder's classes: the folders in train/."""
    if args.data:
        return len(torchvision.datasets.folder.find_classes(Path(args.data) / "train")[0])
    return args.num_classes


# ------------------------------------------------------------------------------ --weights
def named_weights(args):
    """The torchvision weights --weights names (IMAGENET1K_V2, DEFAULT,
    ResNet50_Weights.IMAGENET1K_V2), or None."""
    if not args.weights or Path(args.weights).is_file():
        return None
    kinds = torchvision.models.get_model_weights(args.arch)
    kind, _, name = args.weights.rpartition(".")
    if kind not in ("", kinds.__name__) or name not in kinds.__members__:
        fail(f"--weights {args.weights}: no such file, nor weights of --arch {args.arch}; "
             f"expected a file or one of {', '.join(kinds.__members__)}")
    return kinds[name]


def read_weights_file(path):
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        fail(f"--weights {path}: not a readable state dict ({type(e).__name__}: {first_line(e)})")
    return state["model"] if isinstance(state, dict) and "model" in state else state  # a last.pt's


def weights_for(model, args):
    """--weights' state dict for `model`, and the layers left new (see fit_weights)."""
    weights = named_weights(args)
    state = weights.get_state_dict() if weights else read_weights_file(args.weights)
    return fit_weights(state, model, args)


def fit_weights(state, model, args):
    """--weights' state dict, for `model`: every key, of the same shape, but the classifier's, which
    may be for another number of classes: then the model keeps its new one. Returns the state to
    load, and the layers left new."""
    own, theirs = model.state_dict(), set(state) if isinstance(state, dict) else set()
    # num_batches_tracked: weights saved before torch 0.4.1 lack it.
    missing = {key for key in own.keys() - theirs if not key.endswith("num_batches_tracked")}
    if missing or theirs - own.keys():
        fail(f"--weights {args.weights} does not fit --arch {args.arch}: missing keys "
             f"{sorted(missing)[:3]}, unexpected keys {sorted(theirs - own.keys())[:3]}")
    new = [key for key in theirs if state[key].shape != own[key].shape]
    for key in new:
        if state[key].shape[1:] != own[key].shape[1:] or own[key].shape[0] != num_classes(args):
            fail(f"--weights {args.weights} does not fit --arch {args.arch}: {key} has shape "
                 f"{list(state[key].shape)}, expected {list(own[key].shape)}")
    new_layers = sorted({key.rpartition(".")[0] for key in new})
    return {**state, **{key: own[key] for key in new}}, new_layers


def fetch_weights(args):
    """The torchvision weights --weights names, if it names them, into torch's hub cache
    ($TORCH_HOME): downloaded once per machine by its first process while the others wait in the
    gather; then every rank loads them from there. Gathers: every rank must call it."""
    weights = named_weights(args)
    if weights is None:
        return
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)
    problem = None
    if env_local_rank() == 0 and not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(weights.url, str(path), progress=False)
        except Exception as e:
            problem = (f"--weights {weights}: could not download {weights.url} "
                       f"({type(e).__name__}: {e}); without a network, place that file at {path}, "
                       "or pass --weights PATH to a state dict")
    stop_on_problems(gather_utils.all_gather_object(problem))


# --------------------------------------------------------------------------------- images
class UnreadableImage(Exception):
    """A file of --data that no decoder can read: damaged, truncated, or not an image."""


def read_image(path):
    """A file as 3-channel RGB uint8 (grayscale, CMYK and alpha alike): torchvision.io's decoders
    for the formats they read (JPEG, PNG; GIF, WebP in newer ones), a third of PIL's time for JPEG;
    PIL for the others (BMP, TIFF, ...)."""
    try:
        image = decode_image(read_file(path), mode=ImageReadMode.RGB)
    except RuntimeError:  # not a format torchvision.io reads, or a damaged file: PIL tells which
        try:
            image = v2.functional.pil_to_tensor(torchvision.datasets.folder.pil_loader(path))
        except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ... when damaged
            raise UnreadableImage(f"{path} ({type(e).__name__}: {str(e).strip()})") from None
    if image.dtype != torch.uint8:
        image = v2.functional.to_dtype(image, torch.uint8, scale=True)
    return image


def unreadable(error):
    """The line for an UnreadableImage, also one a DataLoader worker raised (its text ends with
    ours)."""
    path = str(error).rsplit("UnreadableImage: ", 1)[-1].strip()
    return f"cannot read {path}; remove or replace that file"


# ----------------------------------------------------------------- the device, the process group
def gpu_index(local_rank):
    """The GPU this process takes: its local rank's, or the only one an srun task with one GPU per
    task sees, whatever its local rank."""
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.device_count() == 1 and local_world_size == 1:
        return 0
    if local_rank >= torch.cuda.device_count():  # srun: more tasks on a node than its GPUs
        rank_error(f"local rank {local_rank} but only {torch.cuda.device_count()} GPUs are "
                   "visible; start at most one process per GPU", code=2)
    return local_rank


def raise_nccl_timeouts(args):
    """On NCCL, a collective past --collective-timeout: torch's watchdog logs it, dumps each rank's
    flight recorder beside the checkpoints and aborts NCCL, so that the next collective raises for
    collective_failed()'s one line (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, "clean up only"). torchrun
    passes 1 unless it was set ("tear down": the watchdog kills the process, and no line comes):
    1 becomes 2, which ends the job as surely; 0 and 3 are kept (docs/troubleshooting.md)."""
    Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    if os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1") == "1":
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    # The flight recorder's dump, beside the checkpoints. From torch 2.11 it records and dumps by
    # default, and warns of its old variables' names; 2.3 needs all three, under those names.
    trace = str(Path(args.checkpoint_dir).resolve() / "nccl_trace_rank_")
    settings = {"TORCH_FR_DUMP_TEMP_FILE": trace}
    if TorchVersion(torch.__version__) < (2, 11):
        settings = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace}
    for name, value in settings.items():
        os.environ.setdefault(name, value)


def check_master_env():
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        fail("WORLD_SIZE > 1 but MASTER_ADDR or MASTER_PORT is not set; under srun export both "
             "(docs/launching.md)")


def store_of_this_attempt(store):
    """torchrun's own store outlives a restart (MAX_RESTARTS) with the last attempt's keys: without
    a prefix per attempt the group hangs. The old ProcessGroupNCCL writes its dump signal beneath
    every prefix (its globalStore_): a failed attempt's would make the next one's heartbeat monitor
    dump and abort it, so it goes first.
    launch.sh's elastic job gets a new store each round, and a node that joins counts no restarts:
    there, the store as it is."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if attempt != "0":
        for key in NCCL_SIGNAL_KEYS:
            store.delete_key(key)
    return dist.PrefixStore(f"attempt_{attempt}", store)


def init_failure(error, args, world_size):
    """Why the process group did not form, in one line that says what to change."""
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    text = str(error)
    duplicate = [line.strip() for line in text.splitlines() if "Duplicate GPU" in line]
    if duplicate:  # NCCL: two processes that see one GPU, e.g. SLURM tasks without GPU binding
        return (f"two ranks share one GPU ({duplicate[0]}); give each process a GPU of its own "
                "(srun --gpus-per-task=1, or one launch.sh per node)")
    reason = first_line(text)
    if "gloo" in text.lower():
        reason += ("; gloo finds its network interface from the hostname and ignores "
                   "NCCL_SOCKET_IFNAME: set GLOO_SOCKET_IFNAME to the interface the nodes reach "
                   "each other on")
    return (f"the process group did not form within --init-timeout {args.init_timeout:g} s: "
            f"expected WORLD_SIZE={world_size} ranks at {address}, and not all came or could "
            f"connect ({reason})")


def set_collective_timeout(seconds):
    # dist.set_timeout is newer than torch 2.11; 2.3 to 2.11 have it under a private name.
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(datetime.timedelta(seconds=seconds))


def collective_failed(error, args):
    """A collective that failed because a rank is gone (gloo's connections closed or timed out,
    NCCL's error): one line from each rank, naming its flight recorder's dump on NCCL, and exit 1
    at once. Any other error is raised as it is.

    At once: the group is broken, and destroying it can block. After a dump, the old
    ProcessGroupNCCL's heartbeat monitor sleeps TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (480 s) before it
    ends the process, and the group's destructor joins that thread (ProcessGroupNCCL.cpp:
    HeartbeatMonitor::runLoop, ~ProcessGroupNCCL); ProcessGroupNCCL2's shutdown waits for each
    pending collective to end or time out (WorkNCCLQueue::finalize). Nothing is left to save (the
    checkpoint writer finished when the error left train_or_evaluate), the watchdog already aborted
    the communicators, and the driver frees what the process held when it exits."""
    gone = isinstance(error, dist.DistBackendError) or first_line(error).startswith(NCCL2_FAILURES)
    if not gone and "gloo/transport" not in str(error):
        raise error
    dump = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get(
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "")
    trace = Path(dump + str(dist.get_rank()))
    recorded = f"; its last collectives: {trace}"
    if shutil.which("torchfrtrace"):  # torch 2.3 has no such tool
        recorded += f" (every rank's: torchfrtrace {trace.parent})"
    rank_error(f"a collective failed: another rank stopped, or stopped answering for "
               f"--collective-timeout {args.collective_timeout:g} s; look for its own error "
               f"({first_line(error)})" + (recorded if trace.is_file() else ""), at_once=True)


def check_same_start(checkpoint):
    """Every rank must resume from the same checkpoint (nodes with disks of their own may not), or
    the ranks hang. Gathers: every rank must call it."""
    start = "a fresh start"
    if checkpoint is not None:
        weights = hashlib.blake2b(digest_size=6)
        for tensor in checkpoint["model"].values():
            weights.update(tensor.reshape(-1).view(torch.uint8).numpy())
        start = (f"epoch {checkpoint['epoch']} step {checkpoint['step']}, "
                 f"weights {weights.hexdigest()}")
    ranks_by_start = {}
    for rank, other in enumerate(gather_utils.all_gather_object(start)):
        ranks_by_start.setdefault(other, []).append(str(rank))
    if len(ranks_by_start) > 1:
        where = "; ".join(f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)}: {text}"
                          for text, ranks in ranks_by_start.items())
        fail(f"the ranks would resume from different checkpoints ({where}); give every node the "
             "same --resume file, and a --checkpoint-dir they all see (a shared filesystem)")


# ------------------------------------------------------------------------- stopping together
class StopAgreement:
    """SLURM and Kubernetes send SIGTERM before they kill a job. The handler only notes it; before
    every optimizer step, and after each validation but the last, the ranks agree, so that one
    rank's SIGTERM, or an image it cannot read, stops all at the same point: an all-reduce of two
    flags on the CPU backend, which never waits for the GPU."""

    def __init__(self):
        self.requested = False  # set by the handler, which Python runs in the main thread
        self.stopped = False  # the ranks agreed to stop for a SIGTERM, this rank's or another's
        signal.signal(signal.SIGTERM, self.note)
        self.ending = False  # the SIGTERM came to the node that hosts an elastic job's rendezvous
        self.flags, self.sent, self.problem = torch.zeros(3, dtype=torch.int32), None, None

    def note(self, signum, frame):
        self.requested = True
        # Ignored from now: a second one (SLURM and launch.sh may send several) cannot kill the
        # process as it exits.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def send(self, problem=None):
        """Start this rank's flags on their way: a SIGTERM noted so far, whether it has a `problem`,
        and whether its SIGTERM ends an elastic job (launch.sh's RDZV_HOST=1: the job cannot go on
        without the rendezvous that its node hosts)."""
        self.problem = problem
        self.flags[0].fill_(self.requested)
        self.flags[1].fill_(problem is not None)
        self.flags[2].fill_(self.requested and os.environ.get("RDZV_HOST") == "1")
        self.sent = dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, async_op=True)

    def agreed(self):
        """Whether to stop, by the flags sent last (or now): for a SIGTERM on any rank; for a
        problem, all exit."""
        if self.sent is None:
            self.send()
        self.sent.wait()
        self.sent = None
        sigterm, problems, ending = self.flags.tolist()  # a CPU tensor: reading it waits for no GPU
        if problems:
            stop_on_problems(gather_utils.all_gather_object(self.problem))
        self.stopped, self.ending = bool(sigterm), bool(ending)
        return self.stopped

    def leave_as_the_elastic_agent_expects(self, args):
        """After the group's end. In an elastic job (NNODES=MIN:MAX), a rank that another rank's
        SIGTERM stopped waits up to ELASTIC_WAIT s for its own: torchrun's agent sends it one when
        a node joins, and restarts the group at the larger size. If none comes, a node is leaving
        (its launch.sh took a SIGTERM: a spot notice): exit 1, so that the agent restarts the group
        without it (one of MAX_RESTARTS). An exit 0 would end the job: the agent takes workers that
        all succeeded for the job's end, closes the rendezvous, and the other agents stop too
        (torch/distributed/elastic/agent/server/api.py, _invoke_run: SUCCEEDED is checked before
        the nodes waiting to join). If the node that hosts the rendezvous got it, every node exits
        0: the job ends, saved."""
        if not self.stopped or self.requested or ":" not in os.environ.get("NNODES", ""):
            return
        if self.ending:
            if env_local_rank() == 0:
                say(f"the node that hosts the rendezvous ({os.environ.get('RDZV_ENDPOINT')}) got a "
                    f"SIGTERM and left, and the elastic job ends with it; go on with --resume "
                    f"{last_checkpoint(args)}, and a MASTER_ADDR on a node that stays "
                    "(not a spot node)")
            return
        deadline = time.monotonic() + ELASTIC_WAIT
        while not self.requested and time.monotonic() < deadline:
            time.sleep(0.1)
        if not self.requested:
            if env_local_rank() == 0:
                say(f"another node left the elastic job (a SIGTERM there, none here in "
                    f"{ELASTIC_WAIT} s): exit 1, for torchrun to go on without it from last.pt "
                    "(one of MAX_RESTARTS)")
            sys.exit(1)


def stop_on_problems(problems):
    """Every rank's problem (or None), as every rank gathered them. If any has one, each rank that
    has it says so, rank 0 says who, and all exit 1 together, instead of leaving the others waiting
    in their next collective."""
    failed = [rank for rank, problem in enumerate(problems) if problem]
    if problems[dist.get_rank()]:
        rank_error(problems[dist.get_rank()])
    if failed:
        if dist.get_rank() == 0:
            say(f"error: rank 0: stopping: rank {', '.join(map(str, failed))} failed (see above)")
        sys.exit(1)


def check_finite_loss(loss, run, args):
    """A loss averaged over ranks, so every rank stops here together when it is not finite."""
    if not math.isfinite(loss):
        fail(f"the loss is {loss} at epoch {run.epoch + 1} step {run.step}: training diverged; "
             f"lower --lr ({args.lr:g} now) or check the data; {last_checkpoint(args)} is "
             "unchanged", code=1)


def replica_checksums(run, args):
    """Each rank's parameter checksum, which DDP keeps equal: a difference (a broken sync), or nan,
    stops every rank. Gathers: every rank must call it."""
    checksum = sum(p.detach().double().sum() * (i + 1)
                   for i, p in enumerate(run.model.parameters())).item()
    checksums = gather_utils.all_gather_object(checksum)
    if not all(map(math.isfinite, checksums)):
        fail(f"the model's weights are not finite at epoch {run.epoch + 1} step {run.step} "
             f"(checksums per rank: {checksums}): training diverged; lower --lr or check the "
             f"data; {last_checkpoint(args)} is unchanged", 1)
    if len(set(checksums)) != 1:
        fail(f"the model replicas diverged (parameter checksums per rank: {checksums}); "
             "expected equal ones", 1)
    return checksums


# ---------------------------------------------------------------------------- the log lines
# ------------------------------------------------------------------- resume bookkeeping
def last_checkpoint(args):
    return Path(args.checkpoint_dir) / "last.pt"


def start_momentum_at_zero(optimizer):
    """Every momentum buffer in its parameter's layout (see restore_optimizer_settings), and zeros
    for each parameter of a group with momentum that has none: at the start (build_optimizer), and
    after a checkpoint's state, which may hold none (saved with --momentum 0) or some (parameters
    that got no gradient). torch's fused SGD makes missing ones with empty_like at its first step
    if all are missing, and keeps them so when the GradScaler skips that step for an overflow
    (torch/optim/sgd.py, _fused_sgd), as an fp16 run's first steps do: garbage momentum from then
    on; if some are missing, it raises. With dampening 0, a zero buffer makes the next step's
    update the same as no buffer."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            buffer = optimizer.state[p].get("momentum_buffer")
            if buffer is not None:
                optimizer.state[p]["momentum_buffer"] = torch.empty_like(p).copy_(buffer)
            elif group["momentum"]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)


# ------------------------------------------------------------------------ checkpoint writes
class CheckpointWriter:
    """Rank 0's checkpoint writes, on a thread of their own while training goes on: one at a time,
    so that one copy of the state is held in memory however slow the disk. Leaving the `with` block
    waits for the last write, also on an error."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(1, "checkpoint writer")
        self.written = None  # the latest write

    def write(self, state, path):
        """A copy of `state` in host memory, now; written to `path` atomically, later."""
        if self.written:
            self.written.result()
        self.written = self.pool.submit(write_atomically, on_host(state), path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.pool.shutdown(wait=True)


def on_host(value):
    """A copy in host memory of the tensors in nested dicts and lists, which training goes on
    changing in place. A state dict keeps its _metadata: the modules' versions, which
    load_state_dict passes to each module's _load_from_state_dict."""
    if isinstance(value, dict):
        copy = type(value)((key, on_host(item)) for key, item in value.items())
        if hasattr(value, "_metadata"):
            copy._metadata = value._metadata
        return copy
    if isinstance(value, list):
        return [on_host(item) for item in value]
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def write_atomically(state, path):
    """To last.pt.tmp, flushed and fsynced, then renamed over last.pt: a kill at any moment leaves
    the old file or the new one, never a torn one. A write that fails (a full disk) ends the
    process, with one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:  # on the writer thread, where sys.exit would end the thread only
        say(f"error: rank 0: could not write {path} ({type(e).__name__}: {first_line(e)})")
        os._exit(1)


# ----------------------------------------------------------------------- hooks and batch norm
def powersgd_hook_for_gloo_too(state, bucket):
    """torch's PowerSGD hook, which chains two all-reduces per bucket through callbacks. Gloo
    matches collectives by issue order, which concurrent buckets' callbacks make differ between
    ranks: there each bucket finishes first."""
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    if dist.get_backend() == "gloo":  # not "cpu:gloo,cuda:nccl", whose gradients go over NCCL
        future.wait()
    return future


class SumOverRanks(torch.autograd.Function):
    """A differentiable all-reduce: the sum of every rank's tensor, on every rank. Each rank's
    output feeds that rank's loss, so the gradient of each input is the sum of all outputs'
    gradients: an all-reduce again. (torch.distributed.nn's all_reduce does this too, but is
    deprecated, and raises under torch.compile, where each call broke the graph.)"""

    @staticmethod
    def forward(ctx, tensor):
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    backward = forward  # the gradients' sum over ranks, as the docstring says


class CPUSyncBatchNorm(nn.BatchNorm2d):
    """Batch norm with statistics over all ranks on CPUs (gloo), where nn.SyncBatchNorm does not
    run, for torchvision's affine BatchNorm2d layers. The sums travel through a differentiable
    all-reduce: the backward is synchronized too."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        c, xf = x.shape[1], x.float()
        count = xf.new_full((1,), x.numel() / c)
        totals = SumOverRanks.apply(torch.cat([xf.sum((0, 2, 3)), (xf * xf).sum((0, 2, 3)), count]))
        n = totals[-1]
        mean = totals[:c] / n
        var = (totals[c:2 * c] / n - mean * mean).clamp_min(0)  # E[x²] - mean² can round below 0
        with torch.no_grad():
            self.num_batches_tracked += 1
            weight = self.momentum
            if weight is None:  # a plain average
                weight = 1 / self.num_batches_tracked.item()
            self.running_mean.lerp_(mean, weight)
            self.running_var.lerp_(var * n / (n - 1), weight)
        scale = self.weight * torch.rsqrt(var + self.eps)
        shift = self.bias - mean * scale
        return (xf * scale.view(1, c, 1, 1) + shift.view(1, c, 1, 1)).to(x.dtype)


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
