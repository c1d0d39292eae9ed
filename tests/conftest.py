"""Helpers shared by test_train.py, test_failures.py, test_hosts.py and test_slurm.py: the scripts under test,
the tiny training run, ImageFolders of generated images, and starting, waiting for and killing their processes.
test_gather.py stays self-contained: users copy it with gather_utils.py alone.
"""
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchvision
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]  # the repo root, where the scripts under test run
TRAIN = str(ROOT / "train_ddp.py")
LAUNCH = str(ROOT / "launch.sh")
# 2 ranks x 32 steps x 2 epochs: enough for the synthetic task to be learned (val acc1 ~100%).
TINY = ["--arch", "resnet18", "--train-samples", "512", "--val-samples", "50", "--batch-size", "8", "--lr", "0.02",
        "--epochs", "2", "--log-every", "4"]
FAST = [*TINY, "--train-samples", "256"]  # 16 steps an epoch: for stopping and resuming, not accuracy
RUN_TIMEOUT = 120


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What torchrun, SLURM and launch.sh read or set: run inside such a job, the tests must not inherit
# them (a TORCHELASTIC_RESTART_COUNT above 0, for one, makes train_ddp.py resume from a stale last.pt).
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_", "MASTER_", "TORCHELASTIC_", "TORCH_ELASTIC_", "PET_", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                      "SLURM_", "NNODES", "NODE_RANK", "MAX_RESTARTS", "RUN_ID", "INIT_TIMEOUT", "LAST_CALL",
                      "RDZV_HOST")


def clean_env(**extra):
    """No launcher's or SLURM's variables, one thread per rank, and no GPU: these are CPU tests,
    and with a GPU --backend auto would pick NCCL and the GPU defaults."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(cmd, env=None, cwd=None):
    """Start cmd in its own process group, so the test can kill it with all its workers."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or clean_env(), cwd=cwd or ROOT, start_new_session=True)


def descendants(pid):
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    children = {}
    for child, parent in zip(map(int, table[::2]), map(int, table[1::2])):
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def proc_file(pid, name):
    """The bytes of /proc/<pid>/<name>, or b"" once the process is gone."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:  # gone, or not ours to read
        return b""


def kill_tree(proc, sig=signal.SIGKILL):
    """torchrun starts each worker in its own session, so killing its process group is not enough."""
    kill_pids([proc.pid, *descendants(proc.pid)], sig)


def kill_pids(pids, sig=signal.SIGKILL):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def finish(proc, timeout, began=None):
    began = began or time.monotonic()
    try:
        out, err = proc.communicate(timeout=max(1, timeout - (time.monotonic() - began)))
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {proc.args}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    return Result(proc.returncode, out, err, time.monotonic() - began)


def run(cmd, timeout=RUN_TIMEOUT, env=None, cwd=None):
    began = time.monotonic()
    return finish(start(cmd, env, cwd), timeout, began)


def torchrun(nproc, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), TRAIN,
            *map(str, args)]


def ok(result):
    assert result.returncode == 0, \
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"
    return result


def metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_weights(a, b, exact=True, **tolerance):
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key].double(), b[key].double(), msg=key, **tolerance)


def place_in_hub_cache(torch_home, arch, weights):
    """A state dict of `arch` (1000 classes, seed 1) where torch's hub keeps the named `weights`, which it takes as
    they are: the hub checks a file's hash only when it downloads it. Returns the state dict."""
    path = Path(torch_home) / "hub" / "checkpoints" / os.path.basename(weights.url)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    state = torchvision.models.get_model(arch).state_dict()
    torch.save(state, path)
    return state


def write_images(root, make_image, classes, per_split, suffix=".png"):
    """Files in ImageFolder layout: root/<split>/<class>/<i><suffix>, make_image(label, i) -> uint8 HWC."""
    for split, count in per_split.items():
        for label, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                Image.fromarray(make_image(label, i).numpy()).save(root / split / name / f"{i}{suffix}", quality=90)
    return root


def noise_image(height, width):
    return lambda label, i: torch.randint(0, 256, (height, width, 3), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(2 * i + label))


# pytest.ini runs two tests at a time (pytest-xdist); these files' tests run one at a time, on one worker:
# test_gather.py launches each world size once for all its checks, test_profile.py's read one traced run,
# test_hosts.py's timed waits (a last call of 2 s) are set for one job of hosts at a time, and test_slurm.py's
# jobs share the cluster's one node.
ONE_WORKER = ("test_gather.py", "test_profile.py", "test_hosts.py", "test_slurm.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group(item.path.name))


@dataclass
class Finished:
    weights: dict
    metrics: list
    folder: Path  # its last.pt and m.jsonl
    stdout: str


@pytest.fixture
def world_of_one():
    """A real gloo process group of one rank in this process, for what gathers or reduces."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """`bash launch.sh 2` of FAST to the end: what a run stopped and resumed, or one spread over hosts, must
    equal bit for bit (CPU training is deterministic). One run for all of pytest-xdist's workers: the first to
    ask makes it, in the folder they share, and the others wait for it."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # pytest-N/, above each worker's popen-gwN/
    out = shared / "uninterrupted"
    with open(shared / "uninterrupted.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "stdout").exists():
            result = ok(run(["bash", LAUNCH, "2", *FAST, "--checkpoint-dir", out, "--metrics-file", out / "m.jsonl"]))
            (out / "stdout").write_text(result.stdout)
    return Finished(load(out / "last.pt")["model"], metrics(out / "m.jsonl"), out, (out / "stdout").read_text())


def resume_and_compare(folder, uninterrupted):
    """Resume from folder/last.pt: the run says where it resumes and trains only what was left (a run that started
    afresh would end with the same weights), to the uninterrupted run's weights."""
    saved = load(folder / "last.pt")
    result = ok(run(["bash", LAUNCH, "2", *FAST, "--checkpoint-dir", str(folder), "--resume", str(folder / "last.pt"),
                     "--metrics-file", str(folder / "resumed.jsonl")]))
    assert f"resumed from {folder / 'last.pt'} at epoch {saved['epoch'] + 1} step {saved['step']}" in result.stdout
    steps = re.findall(r"epoch (\d)/2 step (\d+)/16", result.stdout)
    assert steps[0] == (str(saved["epoch"] + 1), str(saved["step"] + 4 - saved["step"] % 4)), steps  # logged every 4
    assert [r["epoch"] for r in metrics(folder / "resumed.jsonl")] == list(range(saved["epoch"] + 1, 3))
    assert_same_weights(load(folder / "last.pt")["model"], uninterrupted.weights)


def recipe(marker):
    """The one YAML block of docs/launching.md that holds `marker`, parsed: what users copy."""
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "launching.md").read_text(), re.S)
    (found,) = [block for block in blocks if marker in block]
    return yaml.safe_load(found)
