"""train_ddp.py's checks and safety nets, which a reader of its story can skip, in its order:
one-line failures; checks of arguments, files, --weights; the image reader; device, process group;
the ranks' stop agreement; batch norm, checkpoints, PowerSGD. What gathers says so: all call it."""
import datetime
import os
import shutil
import signal
import socket
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.optim.swa_utils import update_bn
from torchvision.io import ImageReadMode, decode_image, read_file
from torchvision.transforms import v2

import gather_utils

CHECKPOINT_KEYS = set("model optimizer scaler epoch samples step world_size args rng".split())
BN_IMAGES = 1024  # the images, over all ranks, that recompute batch norm's statistics each epoch
EXIT_STOPPED = 75  # sysexits.h's EX_TEMPFAIL, "try again later": stopped, saved, not done
ELASTIC_WAIT = 10  # torchrun's agent polls workers and joining nodes every 0.1 s (5 s on torch 2.3)
# What the old ProcessGroupNCCL writes when it fails, beneath every prefix of torchrun's store
# (ProcessGroupNCCL.hpp: kStoreDumpKey; timeout_dump on torch 2.3). ProcessGroupNCCL2 writes none.
NCCL_SIGNAL_KEYS = ["exception_dump", "timeout_dump"]
# ProcessGroupNCCL2's (torch 2.15) first words once a rank is gone (ProcessGroupNCCLUtils.cpp)
NCCL2_FAILURES = ("NCCL operation timed out", "NCCL Async Error", "NCCL communicator was aborted")
# gloo's errors name their transport's file, but a receive's timeout, as DDP's backward sees it
GLOO_FAILURES = ("gloo/transport", "Application timeout caused pair closure")
# (major, minor): NGC's builds, 2.11.0a0+git..., are 2.11, which TorchVersion takes for older
TORCH_RELEASE = tuple(int(part) for part in torch.__version__.split(".")[:2])
# The flight recorder's dump path, under each name torch reads: the first one set wins
# (c10d/Utils.hpp, getCvarString). Torch before 2.11 reads the older name alone.
TRACE_FILE_NAMES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
if TORCH_RELEASE < (2, 11):
    TRACE_FILE_NAMES = TRACE_FILE_NAMES[::-1]

def say(line):
    """A line on stderr in one write, which other ranks' lines cannot split."""
    sys.stderr.write(f"train_ddp.py: {line}\n")

def fail(message, code=2):
    """Bad input (exit 2), or a verdict on what all ranks gathered (1): said once per machine."""
    if env_local_rank() == 0:
        say(f"error: {message}")
    sys.exit(code)

def rank_error(message, code=1, at_once=False):
    """An error of this rank's own, which the others may not see: each rank says it."""
    say(f"error: rank {world_from_env()[0]}: {message}")
    if at_once:
        sys.stdout.flush()  # stderr is line-buffered: say's line is out
        os._exit(code)  # no clean-up, which a broken process group can block (collective_failed)
    sys.exit(code)

def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

def env_local_rank():
    """This process's rank on its machine, known before the process group exists."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))

def world_from_env():
    """Rank, world size: torchrun's, else srun's (only a task has SLURM_STEP_ID), else 0, 1."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "SLURM_STEP_ID" in os.environ:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    return 0, 1

def stop_on_problems(problem):
    """Gathers: if any rank has a problem, all exit 1 together, not leaving the others waiting."""
    problems = gather_utils.all_gather_object(problem)
    failed = [rank for rank, other in enumerate(problems) if other]
    if problem:
        rank_error(problem)
    if failed:
        if dist.get_rank() == 0:
            say(f"error: rank 0: stopping: rank {', '.join(map(str, failed))} failed (see above)")
        sys.exit(1)

def load_file(path, flag, what):
    if not Path(path).is_file():
        fail(f"{flag} {path}: no such file; expected a {what}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        fail(f"{flag} {path}: not a readable {what} ({type(e).__name__}: {first_line(e)})")

def last_checkpoint(args):
    return Path(args.checkpoint_dir) / "last.pt"

def settle_args(args, device_defaults):
    """The arguments completed (named --weights' recipe sizes, else the device's), then checked."""
    args.image_size_given = args.image_size is not None
    weights = named_weights(args)
    args.weights_url = weights and weights.url  # where weights_file fetches named weights from
    if weights and args.image_size is None:
        recipe = weights.transforms()
        args.image_size = recipe.crop_size[0]
        args.resize = recipe.resize_size[0]
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
    least = dict(epochs=1, batch_size=1, accum_steps=1, train_samples=1, val_samples=1,
                 image_size=1, log_every=1, save_every=1, num_classes=2, workers=0)
    for name, lowest in least.items():
        value = getattr(args, name)
        if value is not None and value < lowest:  # None: --save-every not given
            fail(f"--{name.replace('_', '-')} must be {lowest} or more, got {value}")
    for name in ["init_timeout", "collective_timeout"]:
        seconds = getattr(args, name)
        if seconds <= 0:
            fail(f"--{name.replace('_', '-')} must be more than 0 seconds, got {seconds:g}")
    if args.backend == "nccl" and not torch.cuda.is_available():
        fail("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo (or auto)")
    if args.sync_bn and not torch.cuda.is_available():
        fail("--sync-bn needs CUDA GPUs (torch's SyncBatchNorm runs on GPUs only); drop it on CPUs")
    # torch's count of GPUs heeds MIG and masks; srun's tasks may each see a GPU of their own.
    gpus = torch.cuda.device_count()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    if gpus and processes > gpus:
        fail(f"{processes} processes on this machine but only {gpus} GPUs are visible; start at "
             "most one process per GPU")
    if args.evaluate and not (args.resume or args.weights):
        fail("--evaluate needs --resume PATH or --weights: the model to validate")
    if args.resume and args.weights:
        fail("--resume or --weights, not both: a resume continues from its checkpoint's weights")
    if args.comm_hook == "powersgd" and args.amp == "fp16":
        fail("--comm-hook powersgd cannot run with --amp fp16: one overflowed fp16 step would "
             "leave inf in PowerSGD's error feedback and skip every later step; use --amp bf16")
    if args.data:
        check_image_folder(Path(args.data))
    model = meta_model(args)  # after --data's check: the classes are its folders
    if model is not None:  # None for the regnets: not checked
        check_arch_trains(model, args)
    if args.weights and args.dry_run:  # (training checks them as it loads them: build_model)
        path, problem = weights_file(args)  # named ones downloaded here, once per machine
        if problem:
            fail(problem)
        if model is not None:
            weights_for(model, path, args)
    check_writable(Path(args.checkpoint_dir), "--checkpoint-dir")
    if args.profile:
        check_writable(Path(args.profile), "--profile")
    interfaces = {name for _, name in socket.if_nameindex()}
    for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(","):  # gloo's list: each must exist
        if name and name not in interfaces:
            fail(f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']} names '{name}', which "
                 f"this machine lacks; expected some of its interfaces: "
                 f"{' '.join(sorted(interfaces))}")
    if args.metrics_file:
        if Path(args.metrics_file).is_dir():
            fail(f"--metrics-file {args.metrics_file}: a directory; expected a file to append to")
        check_writable(Path(args.metrics_file).parent, "--metrics-file")

def meta_model(args):
    """This run's model on the meta device, or None for the regnets, which compute as they build."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # googlenet and inception_v3 warn about their init
        try:
            return torchvision.models.get_model(args.arch, num_classes=num_classes(args))
        except NotImplementedError:
            return None

def check_arch_trains(model, args):
    """Fail where `model` cannot train at this image size and batch, or returns more than logits."""
    # Batch norm trains on 2 values per channel or more: a batch of 1 has them where --sync-bn
    # gathers several ranks' batches (a dry run cannot count the ranks; each rank checks again).
    gathers = args.sync_bn and (args.dry_run or world_from_env()[1] > 1)
    alone = args.batch_size == 1 and not gathers
    hint = "--batch-size 2 or more, " if alone else ""
    images = torch.empty(1 if alone else 2, 3, args.image_size, args.image_size, device="meta")
    try:
        out = model.train(not args.evaluate)(images)
    except Exception as e:
        fail(f"--arch {args.arch} cannot train on {args.image_size} px images "
             f"({type(e).__name__}: {first_line(e)}); expected {hint}a larger --image-size or "
             "another --arch")
    if not isinstance(out, torch.Tensor):
        fail(f"--arch {args.arch} returns {type(out).__name__}, not logits; expected another arch")

def check_writable(directory, flag):
    """Fail now rather than at the first save, after an epoch of training."""
    existing = next(d for d in [directory, *directory.parents] if d.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        fail(f"{flag}: cannot write under {existing}; expected a writable directory")

def check_image_folder(root):
    if not root.is_dir():
        fail(f"--data {root}: no such directory; expected an ImageFolder root with train/ and val/")
    for split in ["train", "val"]:
        files = (name.lower() for _, _, names in os.walk(root / split) for name in names)
        if not any(name.endswith(torchvision.datasets.folder.IMG_EXTENSIONS) for name in files):
            fail(f"--data {root}: {root / split} holds no images; "
                 f"expected {root / split}/<class>/<image>.jpg")
    train = {d.name for d in (root / "train").iterdir() if d.is_dir()}
    val = {d.name for d in (root / "val").iterdir() if d.is_dir()}
    if train != val:
        fail(f"--data {root}: train/ and val/ must hold the same class folders, or the labels "
             f"differ (only in train/: {sorted(train - val)}; only in val/: {sorted(val - train)})")

def check_checkpoint(checkpoint, path, args):
    """A train_ddp.py checkpoint for this model and classes (the regnets' are not checked)."""
    if not isinstance(checkpoint, dict) or not CHECKPOINT_KEYS <= checkpoint.keys():
        fail(f"--resume {path}: not a train_ddp.py checkpoint (expected the keys "
             f"{', '.join(sorted(CHECKPOINT_KEYS))})")
    if checkpoint["args"]["arch"] != args.arch:
        fail(f"--resume {path} holds a {checkpoint['args']['arch']} model but --arch is "
             f"{args.arch}")
    model = meta_model(args)
    if model is not None:
        fitted_state_dict(checkpoint["model"], model, args, f"--resume {path}", new_allowed=False)

def num_classes(args):
    if args.data:
        return len(torchvision.datasets.folder.find_classes(Path(args.data) / "train")[0])
    return args.num_classes

def named_weights(args):
    """The torchvision weights --weights names (DEFAULT, ResNet50_Weights.DEFAULT), or None."""
    if not args.weights or Path(args.weights).is_file():
        return None
    kinds = torchvision.models.get_model_weights(args.arch)
    kind, _, name = args.weights.rpartition(".")
    if kind not in ("", kinds.__name__) or name not in kinds.__members__:
        fail(f"--weights {args.weights}: no such file, nor weights of --arch {args.arch}; "
             f"expected a file or one of {', '.join(kinds.__members__)}")
    return kinds[name]

def weights_file(args):
    """(--weights' file, None): named weights from the hub cache, downloaded if absent (safe on
    ranks at once: torch.hub renames its file); or (None, the line) where it cannot be had."""
    if not args.weights_url:
        return Path(args.weights), None
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(args.weights_url)
    try:
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(args.weights_url, str(path), progress=False)
    except Exception as e:
        return None, (f"--weights {args.weights}: could not download {args.weights_url} "
                      f"({type(e).__name__}: {e}); without a network, place that file at {path}, "
                      "or pass --weights PATH to a state dict")
    return path, None

def weights_for(model, path, args):
    """The state dict in --weights' file for `model`, and the layers it leaves new."""
    state = load_file(path, "--weights", "state dict")  # a bad file: one line
    if isinstance(state, dict) and "model" in state:  # a last.pt
        state = state["model"]
    source = f"--weights {args.weights}"
    if args.evaluate:
        source = "--evaluate " + source
    # --evaluate takes no new layer: it would validate a classifier made at random.
    return fitted_state_dict(state, model, args, source, new_allowed=not args.evaluate)

def fitted_state_dict(state, model, args, source, new_allowed):
    """`state` completed for `model`, and the layers left new (a classifier for other classes)."""
    own = model.state_dict()
    theirs = set(state) if isinstance(state, dict) else set()
    # num_batches_tracked: weights saved before torch 0.4.1 lack it.
    missing = {key for key in own.keys() - theirs if not key.endswith("num_batches_tracked")}
    if missing or theirs - own.keys():
        fail(f"{source} does not fit --arch {args.arch}: missing keys {sorted(missing)[:3]}, "
             f"unexpected keys {sorted(theirs - own.keys())[:3]}")
    new = [key for key in theirs if state[key].shape != own[key].shape]
    for key in new:
        if state[key].shape[1:] != own[key].shape[1:] or own[key].shape[0] != num_classes(args):
            fail(f"{source} does not fit --arch {args.arch}: {key} has shape "
                 f"{list(state[key].shape)}, expected {list(own[key].shape)}")
    new_layers = sorted({key.rpartition(".")[0] for key in new})
    if new and not new_allowed:
        fail(f"{source}: {', '.join(new_layers)} is for {state[new[0]].shape[0]} classes, not "
             f"{num_classes(args)}; expected the classes it was trained on (--num-classes, or the "
             "class folders of --data)")
    return {**state, **{key: own[key] for key in new}}, new_layers

class UnreadableImage(Exception):
    """A file of --data that no decoder can read: damaged, truncated, or not an image."""

def read_image(path):
    """A file as RGB uint8: torchvision.io decodes (JPEG in a third of PIL's time), else PIL."""
    try:
        image = decode_image(read_file(path), mode=ImageReadMode.RGB)
    except RuntimeError:  # not a format torchvision.io reads, or a damaged file: PIL tells which
        try:
            image = v2.functional.pil_to_tensor(torchvision.datasets.folder.pil_loader(path))
        except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ... when damaged
            raise UnreadableImage(f"{path} ({type(e).__name__}: {str(e).strip()})") from None
    return v2.functional.to_dtype(image, torch.uint8, scale=True)  # 16-bit ones scaled, uint8 kept

def read_or_problem(read):
    """(read(), None), or (None, the line) if it met an image it cannot read, also in a worker."""
    try:
        return read(), None
    except UnreadableImage as e:
        path = str(e).rsplit("UnreadableImage: ", 1)[-1].strip()  # a worker's text ends with ours
        return None, f"cannot read {path}; remove or replace that file"

def gpu_index(local_rank):
    """The GPU this process takes: its local rank's, or the only one it sees (an srun task's)."""
    if torch.cuda.device_count() == 1:
        return 0
    if local_rank >= torch.cuda.device_count():  # srun: more tasks on a node than its GPUs
        rank_error(f"local rank {local_rank} but only {torch.cuda.device_count()} GPUs are "
                   "visible; start at most one process per GPU", code=2)
    return local_rank

def raise_nccl_timeouts(args):
    """A collective past --collective-timeout dumps each rank's flight recorder by the checkpoints
    and aborts NCCL, for collective_failed()'s line: TORCH_NCCL_ASYNC_ERROR_HANDLING 2, not
    torchrun's 1, which kills without a line. The user's values win, under any name torch reads."""
    Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    # torchrun sets the new name to 1 where it is unset: a 1 there gives way to the legacy name.
    handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if handling == "1":
        handling = os.environ.get("NCCL_ASYNC_ERROR_HANDLING", "1")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2" if handling == "1" else handling
    trace = str(Path(args.checkpoint_dir).resolve() / "nccl_trace_rank_")
    settings = [(TRACE_FILE_NAMES, trace)]  # from torch 2.11 it records and dumps by default
    if TORCH_RELEASE < (2, 11):
        settings += [(("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"), "2000"),
                     (("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_ON_TIMEOUT"), "1")]
    for names, value in settings:  # the user's value, else ours, under the name torch reads first
        os.environ[names[0]] = next((os.environ[n] for n in names if n in os.environ), value)

def store_of_this_attempt(store):
    """torchrun's store, whose keys a restart (MAX_RESTARTS) would meet again and hang on, under a
    prefix per attempt; without the old ProcessGroupNCCL's failure signals, beneath every prefix,
    on which the next attempt would dump and abort. An elastic job makes a store each round."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if attempt != "0":
        for key in NCCL_SIGNAL_KEYS:
            store.delete_key(key)
    return dist.PrefixStore(f"attempt_{attempt}", store)

def init_failure(error, args, world_size):
    if isinstance(error, ValueError):  # MASTER_ADDR or MASTER_PORT unset or not a number
        return (f"{first_line(error)}; expected MASTER_ADDR and a MASTER_PORT number from the "
                "launcher (under srun, export both: docs/launching.md)")
    duplicate = [line.strip() for line in str(error).splitlines() if "Duplicate GPU" in line]
    if duplicate:  # NCCL: two processes that see one GPU, e.g. SLURM tasks without GPU binding
        return (f"two ranks share one GPU ({duplicate[0]}); give each process a GPU of its own "
                "(srun --gpus-per-task=1, or one launch.sh per node)")
    reason = first_line(error)
    if "gloo" in str(error).lower():
        reason += ("; gloo takes its interface from the hostname, ignoring NCCL_SOCKET_IFNAME: "
                   "set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on")
    return (f"the process group did not form within --init-timeout {args.init_timeout:g} s: "
            f"expected WORLD_SIZE={world_size} ranks at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')}, and not all came or could connect ({reason})")

def set_collective_timeout(seconds):
    # torch before 2.12 has dist.set_timeout under a private name only.
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(datetime.timedelta(seconds=seconds))

def collective_failed(error, args):
    """A rank is gone: one line from each rank, naming its flight recorder's dump on NCCL, and
    exit 1 at once, for destroying the broken group can block (the old ProcessGroupNCCL's heartbeat
    monitor sleeps 480 s; ProcessGroupNCCL2 waits for pending collectives). Other errors go on."""
    gone = isinstance(error, dist.DistBackendError) or first_line(error).startswith(NCCL2_FAILURES)
    if not gone and not any(words in str(error) for words in GLOO_FAILURES):
        raise error
    trace = Path(os.environ.get(TRACE_FILE_NAMES[0], "") + str(dist.get_rank()))
    recorded = f"; its last collectives: {trace}"
    if shutil.which("torchfrtrace"):
        recorded += f" (every rank's: torchfrtrace {trace.parent})"
    rank_error(f"a collective failed: another rank stopped, or stopped answering for "
               f"--collective-timeout {args.collective_timeout:g} s; look for its own error "
               f"({first_line(error)})" + (recorded if trace.is_file() else ""), at_once=True)

def check_same_start(checkpoint):
    """Every rank must resume from one place (nodes' own disks may hold different checkpoints), or
    they run different numbers of steps and hang; DDP broadcasts rank 0's weights. Compares the
    epoch, step, images trained and run id of each rank's checkpoint, not its weights. Gathers."""
    start = "a fresh start"
    if checkpoint is not None:
        start = "epoch {epoch} step {step}, samples {samples}".format_map(checkpoint)
        start += f", run id {checkpoint.get('run_id')}"
    starts = gather_utils.all_gather_object(start)
    ranks_by_start = {}
    for rank, other in enumerate(starts):
        ranks_by_start.setdefault(other, []).append(str(rank))
    if len(ranks_by_start) > 1:
        where = "; ".join(f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)}: {text}"
                          for text, ranks in ranks_by_start.items())
        fail(f"the ranks would resume from different checkpoints ({where}); give every node the "
             "same --resume file, and a --checkpoint-dir they all see (a shared filesystem)")

def check_finite(finite, what, run, args):
    """Stop where training diverged, with what is not finite: every rank together, as it checks a
    loss averaged over ranks, or weights that DDP keeps equal: no save holds non-finite weights."""
    if not finite:
        fail(f"{what} at epoch {run.epoch + 1} step {run.step}: training diverged; lower --lr "
             f"({args.lr:g} now) or check the data; {last_checkpoint(args)} keeps the last save",
             code=1)

def check_finite_weights(run, args):
    tensors = [t for t in run.model_without_ddp.state_dict().values() if t.is_floating_point()]
    finite = torch.stack([t.isfinite().all() for t in tensors]).all()  # batch norm's statistics too
    check_finite(bool(finite), "the weights are not finite", run, args)  # waits for the device

class StopAgreement:
    """SLURM and Kubernetes send SIGTERM before they kill a job, a terminal's Ctrl-C SIGINT. The
    handler notes the first; before every optimizer step, and after each validation but the last,
    an all-reduce of three flags on the CPU (no wait for the GPU) stops all ranks at one point for
    one's signal or unreadable image. A second Ctrl-C stops at once, without saving."""

    def __init__(self):
        self.requested = 0  # the first signal's number, set by the handler (in the main thread)
        self.stopped_by = None  # its name, once the ranks agreed to stop for it (or another's)
        self.ending = False  # the signal came to the node that hosts an elastic job's rendezvous
        self.flags = torch.zeros(3, dtype=torch.int32)
        self.sent = None  # the all-reduce of the flags in flight
        self.problem = None
        signal.signal(signal.SIGTERM, self.note)
        signal.signal(signal.SIGINT, self.note)

    def note(self, signum, frame):
        self.requested = signum
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # launch.sh repeats it: no kill as it saves
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    def send(self, problem=None):
        """Start this rank's flags on their way: its signal so far, a `problem`, and `ending`."""
        self.problem = problem
        self.flags[0].fill_(self.requested)
        self.flags[1].fill_(problem is not None)
        self.flags[2].fill_(self.requested and os.environ.get("RDZV_HOST") == "1")
        self.sent = dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, async_op=True)

    def agreed(self):
        """Whether to stop, by the flags sent last (or now); a problem on any rank exits all."""
        if self.sent is None:
            self.send()
        self.sent.wait()
        self.sent = None
        signum, problems, ending = self.flags.tolist()  # a CPU tensor: reading it waits for no GPU
        if problems:
            stop_on_problems(self.problem)
        self.stopped_by = signal.Signals(signum).name if signum else None
        self.ending = bool(ending)
        return self.stopped_by is not None

    def exit(self, args):
        """Trained to the end: return, for exit 0. Saved: exit 75 (EXIT_STOPPED), on which
        Kubernetes and SkyPilot start the job anew; 0 under SLURM (its afterok chains) and
        launch.sh (whose torchrun takes other codes for failures; told by STOP_FILE, launch.sh exits
        75). An elastic node's ranks first leave as its agent expects."""
        stop_file = os.environ.get("STOP_FILE")
        if self.stopped_by is None:
            if stop_file:  # an earlier round of an elastic job stopped for a node that came
                Path(stop_file).unlink(missing_ok=True)
            return
        if ":" in os.environ.get("NNODES", "") and not self.requested:
            self.leave_elastic_job(args)
        if stop_file:
            Path(stop_file).touch()
        sys.exit(0 if stop_file or "SLURM_JOB_ID" in os.environ else EXIT_STOPPED)

    def leave_elastic_job(self, args):
        """A rank another node's SIGTERM stopped waits ELASTIC_WAIT s for its own, which torchrun's
        agent sends to restart larger; none: that node left, exit 1 (0 would end the job: api.py,
        _invoke_run). The rendezvous host left: the job ends with it, saved."""
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

@torch.no_grad()
def recalibrate_batch_norm(model, train_set, sampler, args, to_input):
    """Precise batch norm: these weights' statistics, averaged: every rank validates one model."""
    per_rank = min(BN_IMAGES // dist.get_world_size(), len(sampler))  # len: the shard's
    images = max(1, per_rank // args.batch_size) * args.batch_size
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, drop_last=True,
                                         sampler=list(sampler)[:images], num_workers=args.workers,
                                         generator=torch.Generator().manual_seed(args.seed))
    # All read first: with --sync-bn each forward is a collective, which every rank must reach.
    batches, problem = read_or_problem(lambda: list(loader))
    stop_on_problems(problem)
    with torch.random.fork_rng([to_input.device] if to_input.device.type == "cuda" else []):
        update_bn((to_input(*batch)[0] for batch in batches), model)  # training's RNG untouched
    for norm in model.modules():
        if getattr(norm, "track_running_stats", False):
            for stats in norm.running_mean, norm.running_var:  # equal batch counts: a plain mean
                dist.all_reduce(stats.div_(dist.get_world_size()))

class CheckpointWriter(ThreadPoolExecutor):
    """Rank 0's checkpoint writes on a thread as training goes on; leaving `with` waits for them."""

    def __init__(self):
        super().__init__(1, "checkpoint writer")
        self.written = None  # the latest write

    def write(self, state, path):
        if self.written:
            self.written.result()  # one at a time: one copy of the state, however slow the disk
        self.written = self.submit(write_atomically, on_host(state), path)

def on_host(value):
    """A host copy of the tensors in nested dicts and lists, which training goes on changing."""
    if isinstance(value, dict):
        copy = type(value)((key, on_host(item)) for key, item in value.items())
        if hasattr(value, "_metadata"):
            copy._metadata = value._metadata  # the module versions load_state_dict passes on
        return copy
    if isinstance(value, list):
        return [on_host(item) for item in value]
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value

def write_atomically(state, path):
    """Via last.pt.tmp, fsynced and renamed: a kill at any moment leaves the old file or the new."""
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

def settle_momentum_buffers(optimizer):
    """Momentum buffers in their parameters' layout, as fused kernels need, and zeros where there
    are none: fused SGD fails on a partial list, and makes them with empty_like, whose garbage an
    overflowed first step, skipped, would keep (sgd.py, _fused_sgd)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            buffer = optimizer.state[p].get("momentum_buffer")
            if buffer is not None:
                optimizer.state[p]["momentum_buffer"] = torch.empty_like(p).copy_(buffer)
            elif group["momentum"]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)

def powersgd_hook_for_gloo_too(state, bucket):
    """torch's PowerSGD hook, two all-reduces a bucket chained by callbacks; on gloo, which matches
    collectives by the order they come in, which concurrent buckets scramble, a bucket at a time."""
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    if dist.get_backend() == "gloo":  # not "cpu:gloo,cuda:nccl", whose gradients go over NCCL
        future.wait()
    return future
