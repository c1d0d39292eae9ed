"""Tests on a real one-node SLURM cluster (`bash .ci/slurm.sh start`): sbatch jobs that run
train_ddp.py under srun, with and without launch.sh, stopped by scancel, a time limit or SIGKILL.

Job states come from `scontrol show job` (the cluster has no accounting; finished jobs stay
visible for MinJobAge). The node has 2 CPUs, so the jobs run one after another; each is tiny,
and every wait has a hard timeout that cancels the job. Outside CI, without a cluster, the tests
skip; in CI (CI=true) they fail.
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import LAUNCH, TRAIN, assert_same_weights, clean_env, free_port, load, noise_image, write_images

SMALL = ["--arch", "resnet18", "--train-samples", "64", "--val-samples", "16", "--batch-size", "8", "--epochs", "1"]
# 256 steps per epoch on 2 ranks, a step per log line: a job that is still training when stopped.
LONG = [*SMALL, "--train-samples", "4096", "--epochs", "5", "--log-every", "1"]
JOB_TIMEOUT = 180  # from submission to the end: waiting for the node, start-up, training
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}

pytestmark = pytest.mark.timeout(600)  # a backstop: every wait below has its own timeout


@pytest.fixture(scope="module", autouse=True)
def cluster():
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10).stdout.split()
    except (FileNotFoundError, subprocess.TimeoutExpired):
        states = []
    if not {"idle", "mixed", "allocated", "completing"} & set(states):
        message = f"no SLURM node up (sinfo: {states or 'nothing'}); start one with `bash .ci/slurm.sh start`"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def submit(tmp_path, form, args, sbatch=(), kill_on_bad_exit=True):
    """Submit a batch script that runs train_ddp.py in one of the two SLURM forms of docs/launching.md:
    2 srun tasks, or one task running `launch.sh 2`. Returns the job id."""
    args = " ".join(map(str, [*args, "--checkpoint-dir", tmp_path]))
    if form == "srun":
        lines = ["#SBATCH --ntasks=2", f"export MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()}",
                 f"srun {'--kill-on-bad-exit=1 ' * kill_on_bad_exit}{sys.executable} {TRAIN} {args}"]
    elif form == "launch.sh":
        lines = ["#SBATCH --ntasks=1 --cpus-per-task=2", f"srun bash {LAUNCH} 2 {args}"]
    else:  # the batch shell itself runs the script, with the job's SLURM_NTASKS=2
        lines = ["#SBATCH --ntasks=2", f"export MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()}",
                 f"{sys.executable} {TRAIN} {args}"]
    script = tmp_path / "job.sh"
    script.write_text("\n".join(["#!/bin/bash", *[f"#SBATCH {s}" for s in sbatch], *lines]) + "\n")
    # The job gets this environment: loopback only, one thread per process.
    result = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path / 'job.out'}", f"--chdir={tmp_path}",
                             str(script)], capture_output=True, text=True, timeout=30,
                            env=clean_env(GLOO_SOCKET_IFNAME="lo"))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def job_info(job):
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def output(tmp_path):
    path = tmp_path / "job.out"
    return path.read_text() if path.exists() else ""


def give_up(job, tmp_path, what):
    subprocess.run(["scancel", job], timeout=30)
    pytest.fail(f"job {job}: {what}; state {job_info(job).get('JobState')}\n--- output\n{output(tmp_path)[-4000:]}")


def wait_for(condition, job, tmp_path, what, timeout=JOB_TIMEOUT):
    began = time.monotonic()
    while not condition():
        if job_info(job).get("JobState") in ENDED:
            pytest.fail(f"job {job} ended before {what}\n--- output\n{output(tmp_path)[-4000:]}")
        if time.monotonic() - began > timeout:
            give_up(job, tmp_path, f"no {what} within {timeout} s")
        time.sleep(0.2)


def wait_end(job, tmp_path, timeout=JOB_TIMEOUT):
    """The job's final JobState and ExitCode, e.g. ('COMPLETED', '0:0'), and its output."""
    began = time.monotonic()
    while (info := job_info(job)).get("JobState") not in ENDED:
        if time.monotonic() - began > timeout:
            give_up(job, tmp_path, f"still {info.get('JobState')} after {timeout} s")
        time.sleep(0.2)
    return info["JobState"], info["ExitCode"], output(tmp_path)


def training(tmp_path):
    return lambda: re.search(r"step [2-9]\d*/", output(tmp_path))


def tasks(job):
    """The pids of the job's training processes (not launch.sh's --dry-run), by SLURM_PROCID or RANK."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline, environ = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if TRAIN.encode() in cmdline and b"--dry-run" not in cmdline and f"SLURM_JOB_ID={job}".encode() in environ:
            env = dict(v.decode().split("=", 1) for v in environ if b"=" in v)
            found[int(env.get("RANK", env.get("SLURM_PROCID")))] = int(proc.name)
    return found


def assert_stopped_cleanly(state, exit_code, out, tmp_path):
    assert (state, exit_code) == ("COMPLETED", "0:0"), out[-4000:]
    checkpoint = load(tmp_path / "last.pt")
    # Saved on the signal, not at an epoch's end: mid-epoch, or before the first step if it came during start-up.
    assert checkpoint["step"] > 0 or checkpoint["epoch"] == 0, (checkpoint["epoch"], checkpoint["step"])
    reached = f"stopped by SIGTERM at epoch {checkpoint['epoch'] + 1} step {checkpoint['step']}/256"
    assert f"{reached}; continue with --resume {tmp_path / 'last.pt'}" in out, out[-4000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-4000:]
    return checkpoint


# ---------------------------------------------------------------- training under srun
def test_srun_tasks_and_launch_sh_train_the_same_weights(tmp_path):
    for form in ["srun", "launch.sh"]:
        (tmp_path / form).mkdir()
    jobs = {form: submit(tmp_path / form, form, SMALL) for form in ["srun", "launch.sh"]}
    for form, job in jobs.items():
        state, exit_code, out = wait_end(job, tmp_path / form)
        assert (state, exit_code) == ("COMPLETED", "0:0"), out[-4000:]
        assert "2 x cpu (gloo)" in out and "epoch 1/1 train_loss" in out, out[-4000:]
    assert_same_weights(load(tmp_path / "srun" / "last.pt")["model"], load(tmp_path / "launch.sh" / "last.pt")["model"])


def test_batch_script_without_srun_is_one_process(tmp_path):
    # The batch shell sees the job's SLURM_NTASKS=2 and SLURM_PROCID=0, but it is one process:
    # with world size 2 it would wait --init-timeout for a rank that never comes.
    state, exit_code, out = wait_end(submit(tmp_path, "batch", [*SMALL, "--init-timeout", "10"]), tmp_path)
    assert (state, exit_code) == ("COMPLETED", "0:0"), out[-4000:]
    assert "1 x cpu (gloo)" in out, out[-4000:]


# ---------------------------------------------------------------- stopping
@pytest.mark.parametrize("form", ["srun", "launch.sh"])
def test_scancel_signal_term_saves_and_completes(tmp_path, form):
    # scancel --signal=TERM signals every process of the job's steps (not the batch shell):
    # the tasks, and under launch.sh also bash and torchrun.
    job = submit(tmp_path, form, LONG)
    wait_for(training(tmp_path), job, tmp_path, "step 2")
    subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=30)
    assert_stopped_cleanly(*wait_end(job, tmp_path), tmp_path)


@pytest.mark.parametrize("form", ["srun", "launch.sh"])
def test_time_limit_signal_saves_and_completes(tmp_path, form):
    # SLURM sends the signal when at most 50 s are left, checking every 30 s or so:
    # 10 to 40 s into this 1-minute job, which trains for longer.
    job = submit(tmp_path, form, LONG, sbatch=["--time=1 --signal=TERM@50"])
    checkpoint = assert_stopped_cleanly(*wait_end(job, tmp_path), tmp_path)
    assert checkpoint["epoch"] < 5


@pytest.mark.parametrize("form", ["srun", "launch.sh"])
def test_plain_scancel_saves_before_the_kill(tmp_path, form):
    # scancel sends SIGTERM to every process of the job, then SIGKILL KillWait (30 s) later.
    job = submit(tmp_path, form, LONG)
    wait_for(training(tmp_path), job, tmp_path, "step 2")
    subprocess.run(["scancel", job], check=True, timeout=30)
    state, _, out = wait_end(job, tmp_path)
    assert state == "CANCELLED", out[-4000:]
    checkpoint = load(tmp_path / "last.pt")
    assert checkpoint["epoch"] == 0 and checkpoint["step"] >= 2, out[-4000:]
    assert f"stopped by SIGTERM at epoch 1 step {checkpoint['step']}/256" in out, out[-4000:]


def test_sigterm_while_importing_torch_stops_before_the_first_step(tmp_path):
    job = submit(tmp_path, "srun", LONG)

    def importing():
        # From its first line until main(), while it imports torch and torchvision, train_ddp.py
        # holds SIGTERM back (/proc's SigBlk); a process without that would die of the signal.
        pids = tasks(job).values()
        return len(pids) == 2 and all(holds_sigterm(pid) for pid in pids)

    wait_for(importing, job, tmp_path, "both tasks holding SIGTERM while they import torch", timeout=60)
    subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=30)
    state, exit_code, out = wait_end(job, tmp_path)
    assert (state, exit_code) == ("COMPLETED", "0:0"), out[-4000:]
    assert (load(tmp_path / "last.pt")["epoch"], load(tmp_path / "last.pt")["step"]) == (0, 0)
    assert f"stopped by SIGTERM at epoch 1 step 0/256; continue with --resume {tmp_path / 'last.pt'}" in out


def holds_sigterm(pid):
    blocked = re.search(rb"SigBlk:\s*([0-9a-f]+)", proc_bytes(pid, "status"))
    return bool(blocked) and int(blocked.group(1), 16) >> (signal.SIGTERM - 1) & 1


def proc_bytes(pid, name):
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize("kill_on_bad_exit", [True, False], ids=["kill-on-bad-exit", "without"])
def test_sigkill_of_a_task_ends_the_job_within_seconds(tmp_path, kill_on_bad_exit):
    job = submit(tmp_path, "srun", LONG, kill_on_bad_exit=kill_on_bad_exit)
    wait_for(training(tmp_path), job, tmp_path, "step 2")
    os.kill(tasks(job)[1], signal.SIGKILL)
    state, exit_code, out = wait_end(job, tmp_path, timeout=30)
    assert state == "FAILED" and exit_code != "0:0", out[-4000:]


# ---------------------------------------------------------------- bad input under srun
def test_unreadable_image_ends_the_job_with_one_line_and_the_checkpoint_intact(tmp_path):
    # A damaged file among the val images: the epoch's checkpoint is saved before validation, the rank that reads
    # the file names it, and every task stops together: the job fails within seconds, with last.pt intact.
    data = write_images(tmp_path / "data", noise_image(32, 32), ["a", "b"], {"train": 16, "val": 4}, ".jpg")
    damaged = data / "val" / "a" / "1.jpg"
    damaged.write_text("not an image")
    job = submit(tmp_path, "srun", ["--data", data, *SMALL[:2], "--image-size", "32", "--batch-size", "4"])
    state, exit_code, out = wait_end(job, tmp_path)
    assert state == "FAILED" and exit_code != "0:0", out[-4000:]
    ours = [line for line in out.splitlines() if line.startswith("train_ddp.py: error:")]
    assert len(ours) == 2 and f'File "{TRAIN}"' not in out, out[-4000:]
    assert re.fullmatch(rf"train_ddp.py: error: rank [01]: cannot read {damaged} \(.*\); remove or replace that file",
                        next(line for line in ours if "cannot read" in line)), ours
    assert load(tmp_path / "last.pt")["epoch"] == 1
