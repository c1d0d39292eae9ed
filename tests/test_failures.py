"""Failure tests for train_ddp.py and launch.sh: ranks really killed, stopped and signalled,
ports really taken, bad input really given. CPU/gloo, each with a hard timeout.

Cases 2 to 4 resume the interrupted job and compare its final weights with an uninterrupted
run of the same arguments: they must be bit-identical on CPU.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torchvision
from torch.utils.data.distributed import DistributedSampler

import guard
from conftest import FAST, LAUNCH, RUN_TIMEOUT, TINY, TRAIN, assert_same_weights, clean_env, descendants, \
    free_port, kill_pids, kill_tree, load, metrics, noise_image, ok, proc_file, resume_and_compare, run, torchrun, \
    write_images

pytestmark = pytest.mark.timeout(300)  # a backstop: every run below has its own timeout


def start_logged(cmd, log_dir, env=None):
    """Start cmd with its output in files, so the test can watch the log while it runs."""
    out, err = open(log_dir / "stdout.log", "w"), open(log_dir / "stderr.log", "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env or clean_env(), cwd=Path(TRAIN).parent,
                            start_new_session=True)
    proc.log_dir = log_dir
    return proc


def subdir(path):
    path.mkdir()
    return path


def wait_for(condition, proc, what, timeout=RUN_TIMEOUT, interval=0.05):
    began = time.monotonic()
    while not condition():
        if proc.poll() is not None or time.monotonic() - began > timeout:
            kill_tree(proc)
            pytest.fail(f"never saw {what}; exit {proc.poll()}\n{stdout(proc)[-2000:]}\n{stderr(proc)[-3000:]}")
        time.sleep(interval)


def stdout(proc):
    return (proc.log_dir / "stdout.log").read_text()


def stderr(proc):
    return (proc.log_dir / "stderr.log").read_text()


def wait_exit(proc, timeout):
    began = time.monotonic()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        pytest.fail(f"still running {timeout} s later\n{stdout(proc)[-2000:]}\n{stderr(proc)[-3000:]}")
    return time.monotonic() - began


def worker(proc, rank):
    """The pid of the training process with this RANK among proc's descendants."""
    for pid in descendants(proc.pid):
        if f"RANK={rank}".encode() in proc_file(pid, "environ").split(b"\0"):
            return pid
    raise AssertionError(f"no worker with RANK={rank} under {proc.pid}")


# ---------------------------------------------------------------- 1. rendezvous that cannot complete
def test_wrong_world_size_fails_within_init_timeout(tmp_path):
    port = free_port()
    procs = [start_logged([sys.executable, TRAIN, *TINY, "--init-timeout", "5", "--checkpoint-dir", str(tmp_path)],
                          subdir(tmp_path / f"r{r}"),
                          env=clean_env(RANK=r, WORLD_SIZE=3, LOCAL_RANK=r, MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    seconds = [wait_exit(p, 60) for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert max(seconds) < 5 + 25  # the timeout, plus generous start-up time for torch on 2 busy cores
    rank0 = stderr(procs[0])
    assert rank0.count("train_ddp.py: error: rank 0: the process group did not form within --init-timeout 5 s: "
                       "expected WORLD_SIZE=3 ranks at 127.0.0.1:") == 1, rank0
    assert "2/3 clients joined" in rank0
    assert "train_ddp.py: error: rank 1:" in stderr(procs[1])


def test_unreachable_master_fails_within_init_timeout(tmp_path):
    closed_port = free_port()  # nobody listens there
    began = time.monotonic()
    result = run([sys.executable, TRAIN, *TINY, "--init-timeout", "5"], timeout=60,
                 env=clean_env(RANK=1, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=closed_port))
    assert result.returncode != 0
    assert time.monotonic() - began < 5 + 25
    assert f"rank 1: the process group did not form within --init-timeout 5 s: expected WORLD_SIZE=2 ranks at " \
           f"127.0.0.1:{closed_port}" in result.stderr


def test_gloo_socket_ifname_naming_no_interface_here_fails_at_start_with_one_line(tmp_path):
    # gloo would fail on it in every rank, after the rendezvous; the check before it says so once per machine.
    # (Gloo that cannot connect, the hostname on 127.0.1.1: test_hosts.py, on real hosts.)
    result = run(torchrun(2, *TINY, "--checkpoint-dir", tmp_path), timeout=60,
                 env=clean_env(GLOO_SOCKET_IFNAME="nonexistent0"))
    assert result.returncode != 0 and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.startswith("train_ddp.py: error:")]
    assert len(lines) == 1 and lines[0].startswith(
        "train_ddp.py: error: GLOO_SOCKET_IFNAME=nonexistent0 names 'nonexistent0', which this machine lacks"), \
        result.stderr[-3000:]

# ---------------------------------------------------------------- 2. a rank killed with SIGKILL
def test_sigkill_of_a_rank_stops_the_job_and_resume_continues(tmp_path, uninterrupted):
    job = start_logged(["bash", LAUNCH, "2", *FAST, "--checkpoint-dir", str(tmp_path)], tmp_path)
    wait_for(lambda: (tmp_path / "last.pt").exists(), job, "the epoch-1 checkpoint")
    os.kill(worker(job, 1), signal.SIGKILL)
    seconds = wait_exit(job, 60)
    assert job.returncode != 0 and seconds < 60
    # torchrun's report lists every rank that failed, whichever it saw first: rank 0's own
    # one-line exit can come before torchrun notices rank 1's SIGKILL.
    assert re.search(r"rank +: 1 \(local_rank: 1\)\n +exitcode +: -9 ", stderr(job)), stderr(job)[-3000:]
    resume_and_compare(tmp_path, uninterrupted)


def test_max_restarts_resumes_by_itself(tmp_path, uninterrupted):
    job = start_logged(["bash", LAUNCH, "2", *FAST, "--checkpoint-dir", str(tmp_path)], tmp_path,
                       env=clean_env(MAX_RESTARTS=1))
    wait_for(lambda: (tmp_path / "last.pt").exists(), job, "the epoch-1 checkpoint")
    os.kill(worker(job, 1), signal.SIGKILL)
    wait_exit(job, RUN_TIMEOUT)
    assert job.returncode == 0, stderr(job)[-3000:]
    assert f"resumed from {tmp_path / 'last.pt'} at epoch 2 step 0" in stdout(job)
    assert_same_weights(load(tmp_path / "last.pt")["model"], uninterrupted.weights)


def test_restart_ignores_a_last_pt_from_an_earlier_job(tmp_path, uninterrupted):
    # An earlier job left last.pt in the same --checkpoint-dir (only its run id is read before it is
    # ignored); this job's rank dies before its first save.
    torch.save({"run_id": "an-earlier-job"}, tmp_path / "last.pt")
    job = start_logged(["bash", LAUNCH, "2", *FAST, "--checkpoint-dir", str(tmp_path)], subdir(tmp_path / "log"),
                       env=clean_env(MAX_RESTARTS=1))
    wait_for(lambda: "epoch 1/2 step 4/16" in stdout(job), job, "step 4 of epoch 1", interval=0.01)
    os.kill(worker(job, 1), signal.SIGKILL)
    wait_exit(job, RUN_TIMEOUT)
    assert job.returncode == 0, stderr(job)[-3000:]
    assert "resumed from" not in stdout(job)  # the restart started afresh, as the job itself had
    assert f"restart: ignoring {tmp_path / 'last.pt'}, written by another job" in stderr(job)
    assert_same_weights(load(tmp_path / "last.pt")["model"], uninterrupted.weights)


# ---------------------------------------------------------------- 3. SIGTERM
def sigterm_mid_epoch(tmp_path, target):
    job = start_logged(["bash", LAUNCH, "2", *FAST, "--checkpoint-dir", str(tmp_path)], tmp_path)
    wait_for(lambda: "epoch 2/2 step 4/16" in stdout(job), job, "step 4 of epoch 2", interval=0.01)
    os.kill(job.pid if target == "launcher" else worker(job, 1), signal.SIGTERM)
    seconds = wait_exit(job, 60)
    assert job.returncode == 75 and seconds < 30, stderr(job)[-3000:]  # saved, not done
    checkpoint = load(tmp_path / "last.pt")
    assert checkpoint["epoch"] == 1 and 4 <= checkpoint["step"] < 16  # 0-based epoch 1 = the second
    assert f"stopped by SIGTERM at epoch 2 step {checkpoint['step']}/16" in stdout(job)
    return checkpoint


@pytest.mark.quick
def test_a_failed_collective_ends_the_rank_at_once_without_destroying_its_group():
    # After NCCL's watchdog dumps, its heartbeat monitor sleeps 480 s, and destroying the group joins
    # it: a rank whose collective failed says its line and exits, the group left as it is. A GPU shows
    # the wait; here a planted backend error in a gloo group, with destroy_process_group watched.
    code = """if True:
        import types, torch, torch.distributed as dist, train_ddp
        destroy = dist.destroy_process_group
        def watched(*args, **kwargs):
            print("destroyed", flush=True)
            destroy(*args, **kwargs)
        dist.destroy_process_group = watched
        args = types.SimpleNamespace(backend="gloo", init_timeout=5, collective_timeout=5)
        with train_ddp.process_group(args, torch.device("cpu")):
            print("in the group", flush=True)
            raise dist.DistBackendError("NCCL communicator was aborted on rank 0")"""
    result = run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 1 and result.stdout.split("\n")[0] == "in the group", result
    assert "destroyed" not in result.stdout and "Traceback" not in result.stderr, result
    assert result.stderr.startswith("train_ddp.py: error: rank 0: a collective failed: another rank stopped, or "
                                    "stopped answering for --collective-timeout 5 s; look for its own error (NCCL "
                                    "communicator was aborted on rank 0)"), result.stderr


def test_a_restart_starts_without_the_failed_attempts_nccl_signals(tmp_path):
    # A failed NCCL attempt leaves its dump signal in torchrun's store, outside the attempt's prefix:
    # the next attempt's heartbeat monitor would find it, dump and abort. The restart clears them.
    script = tmp_path / "attempts.py"
    script.write_text("""import os, sys
import torch.distributed as dist
import guard
store, _, _ = next(dist.rendezvous("env://", rank=0, world_size=1))
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    for key in guard.NCCL_SIGNAL_KEYS:
        store.set(key, "1")  # as ProcessGroupNCCL's failure leaves them
    sys.exit(1)
guard.store_of_this_attempt(store)
print("left:", [key for key in guard.NCCL_SIGNAL_KEYS if store.check([key])], flush=True)
""")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "--max-restarts", "1", script]
    result = ok(run(cmd, env=clean_env(PYTHONPATH=Path(TRAIN).parent), timeout=90))
    assert "left: []" in result.stdout, result.stdout


@pytest.mark.quick
def test_sigterm_to_launcher_saves_mid_epoch_and_resumes_exactly(tmp_path, uninterrupted):
    sigterm_mid_epoch(tmp_path, "launcher")
    resume_and_compare(tmp_path, uninterrupted)


def test_sigterm_to_one_rank_stops_all_ranks_and_resumes_exactly(tmp_path, uninterrupted):
    sigterm_mid_epoch(tmp_path, "rank 1")
    resume_and_compare(tmp_path, uninterrupted)


def left_behind(tmp_path):
    """The processes whose arguments name tmp_path, killed: torchrun starts each worker in a session of its own."""
    time.sleep(1)
    left = [int(p.name) for p in Path("/proc").glob("[0-9]*") if str(tmp_path).encode() in proc_file(p.name, "cmdline")]
    kill_pids(left)
    return left


def is_worker(pid):
    """Whether pid is a train_ddp.py that torchrun started (not torchrun, nor launch.sh's dry run)."""
    args = proc_file(pid, "cmdline").split(b"\0")
    return not {b"torch.distributed.run", b"--dry-run"} & set(args) and any(a.endswith(b"train_ddp.py") for a in args)


@pytest.mark.parametrize("moment", ["the dry run", "torchrun's start"])
def test_a_signal_before_the_workers_start_ends_launch_sh_at_once_leaving_nothing(tmp_path, moment):
    # Nothing to save yet: launch.sh ends what runs (the dry run, or a torchrun with no worker) and exits 75
    # within seconds, leaving no job behind that nothing would stop. It used to wait out the dry run.
    job = start_logged(["bash", LAUNCH, "2", *FAST, "--checkpoint-dir", str(tmp_path)], tmp_path)
    marker = b"--dry-run" if moment == "the dry run" else b"torch.distributed.run"
    wait_for(lambda: any(marker in proc_file(pid, "cmdline") for pid in descendants(job.pid)), job, moment,
             interval=0.005)
    os.kill(job.pid, signal.SIGTERM)
    assert wait_exit(job, 60) < 5 and job.returncode == 75, stderr(job)[-3000:]
    assert not left_behind(tmp_path), f"still running after launch.sh exited {job.returncode}"
    assert "stopped by" not in stdout(job) and not (tmp_path / "last.pt").exists(), stdout(job)


def test_sigterm_never_saves_the_last_step_of_an_epoch(tmp_path):
    # The ranks agree on a SIGTERM before each step, never after an epoch's last one (where saving step N/N would
    # leave the resume an epoch of no step and a loss of nan). With one step per epoch and the signal sent as the
    # workers start, held by them from their first line, they stop before that step, and the resume trains it.
    one_step = ["--arch", "resnet18", "--train-samples", "16", "--val-samples", "4", "--batch-size", "8",
                "--epochs", "2", "--checkpoint-dir", str(tmp_path), "--metrics-file", str(tmp_path / "m.jsonl")]
    job = start_logged(["bash", LAUNCH, "2", *one_step], subdir(tmp_path / "log"))
    wait_for(lambda: any(is_worker(pid) for pid in descendants(job.pid)), job, "a worker",
             interval=0.005)
    os.kill(job.pid, signal.SIGTERM)
    wait_exit(job, 60)
    assert job.returncode == 75, stderr(job)[-3000:]
    assert "stopped by SIGTERM at epoch 1 step 0/1; continue with --resume" in stdout(job), stdout(job)
    assert (load(tmp_path / "last.pt")["epoch"], load(tmp_path / "last.pt")["step"]) == (0, 0)
    resumed = ok(run(["bash", LAUNCH, "2", *one_step, "--resume", str(tmp_path / "last.pt")]))
    assert "at epoch 1 step 0" in resumed.stdout
    records = metrics(tmp_path / "m.jsonl")
    assert [r["epoch"] for r in records] == [1, 2] and all(r["train_loss"] > 0 for r in records), records


def test_sigterm_during_validation_stops_when_it_ends(tmp_path, uninterrupted):
    # The checkpoint is written just before validation, and 2000 val images take seconds on
    # 2 cores: the signal arrives while the ranks validate.
    job = start_logged(["bash", LAUNCH, "2", *FAST, "--val-samples", "2000", "--checkpoint-dir", str(tmp_path)],
                       tmp_path)
    wait_for(lambda: (tmp_path / "last.pt").exists(), job, "the epoch-1 checkpoint", interval=0.01)
    os.kill(job.pid, signal.SIGTERM)
    wait_exit(job, 60)
    assert job.returncode == 75, stderr(job)[-3000:]
    assert "val_acc1" in stdout(job) and "stopped by SIGTERM after epoch 1; continue with --resume" in stdout(job)
    checkpoint = load(tmp_path / "last.pt")
    assert (checkpoint["epoch"], checkpoint["step"]) == (1, 0)
    resume_and_compare(tmp_path, uninterrupted)


# ---------------------------------------------------------------- 4. a kill during the checkpoint write
def test_kill_during_checkpoint_write_keeps_previous_checkpoint(tmp_path, uninterrupted):
    last, tmp = tmp_path / "last.pt", tmp_path / "last.pt.tmp"
    job = start_logged(["bash", LAUNCH, "2", *FAST, "--checkpoint-dir", str(tmp_path)], tmp_path)
    wait_for(last.exists, job, "the epoch-1 checkpoint")
    wait_for(tmp.exists, job, "the epoch-2 checkpoint being written", interval=0.002)
    kill_tree(job)
    job.wait()
    assert tmp.exists()  # the write really was cut short
    checkpoint = load(last)
    assert checkpoint["epoch"] == 1
    resume_and_compare(tmp_path, uninterrupted)


def test_save_every_loses_at_most_those_steps_to_a_kill(tmp_path, uninterrupted):
    # --save-every 5: the job SIGKILLed in epoch 2 after the save of its step 5 resumes there, to the weights of a run
    # never interrupted (the saves, written on a thread of their own, change nothing in training).
    job = start_logged(["bash", LAUNCH, "2", *FAST, "--checkpoint-dir", str(tmp_path), "--save-every", "5"], tmp_path)
    wait_for(lambda: "epoch 2/2 step 8/16" in stdout(job), job, "step 8 of epoch 2", interval=0.01)
    kill_tree(job)
    job.wait()
    saved = load(tmp_path / "last.pt")
    assert (saved["epoch"], saved["step"], saved["samples"]) == (1, 5, 5 * 16), {k: saved[k] for k in ["epoch", "step"]}
    resume_and_compare(tmp_path, uninterrupted)


def test_a_checkpoint_write_that_fails_stops_the_job_with_one_line(tmp_path):
    # The writer thread cannot open last.pt.tmp (a directory stands there, as a full disk or a lost mount would
    # fail it): rank 0 says so and exits 1, and the other rank, left alone, says why it stops.
    (tmp_path / "ck" / "last.pt.tmp").mkdir(parents=True)
    result = run(torchrun(2, *FAST, "--epochs", "1", "--checkpoint-dir", tmp_path / "ck"))
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("train_ddp.py: error:")]
    assert lines[0].startswith(f"train_ddp.py: error: rank 0: could not write {tmp_path / 'ck' / 'last.pt'} "
                               "(IsADirectoryError: "), result.stderr[-3000:]
    assert len(lines) <= 2 and all("rank 1: a collective failed" in line for line in lines[1:]), lines
    assert not (tmp_path / "ck" / "last.pt").exists()


def test_a_save_slower_than_torchruns_grace_is_never_half_written(tmp_path):
    # Plain torchrun passes a SIGTERM on to its workers and kills them --shutdown-timeout later (default 30 s): here
    # 1 s, less than the stop's save of a Wide ResNet-101's 1 GB checkpoint (saved at every step, so that another is
    # being written too). The write is cut, last.pt stays whole.
    args = ["--arch", "wide_resnet101_2", "--train-samples", "256", "--val-samples", "16", "--batch-size", "8",
            "--epochs", "1", "--save-every", "1", "--checkpoint-dir", str(tmp_path)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--shutdown-timeout", "1", TRAIN, *args]
    job = start_logged(cmd, subdir(tmp_path / "log"))
    wait_for(lambda: (tmp_path / "last.pt").exists() and (tmp_path / "last.pt.tmp").exists(), job,
             "a checkpoint and the next being written", interval=0.01)
    job.send_signal(signal.SIGTERM)
    wait_exit(job, 60)
    assert "forcefully exiting via 9" in stderr(job), stderr(job)[-3000:]  # the grace ran out
    assert (tmp_path / "last.pt.tmp").exists()  # a write was cut short
    saved = load(tmp_path / "last.pt")  # whole: it loads, and its weights fit the model
    assert guard.CHECKPOINT_KEYS <= saved.keys() and saved["step"] >= 1
    torchvision.models.wide_resnet101_2(num_classes=10).load_state_dict(saved["model"])


# ---------------------------------------------------------------- 5. ports
def test_port_29500_taken_and_two_jobs_at_once(tmp_path):
    blocker = socket.socket()
    try:
        blocker.bind(("127.0.0.1", 29500))
        blocker.listen()
    except OSError:
        pass  # already taken by another program, which is the case under test anyway
    args = ["--arch", "resnet18", "--train-samples", "64", "--val-samples", "10", "--batch-size", "8", "--epochs", "1"]
    jobs = [start_logged(["bash", LAUNCH, "2", *args, "--checkpoint-dir", str(tmp_path / f"job{i}")],
                         subdir(tmp_path / f"job{i}")) for i in range(2)]
    for job in jobs:
        wait_exit(job, RUN_TIMEOUT)
    blocker.close()
    for job in jobs:
        assert job.returncode == 0, stderr(job)[-3000:]
        assert "Address already in use" not in stderr(job)
        assert (job.log_dir / "last.pt").exists()


# ---------------------------------------------------------------- 6. bad input fails fast, once
@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    for split in ["train", "val"]:
        (root / "no_images" / split / "cat").mkdir(parents=True)
        (root / "no_images" / split / "cat" / "notes.txt").write_text("not an image")
    for split, label in [("train", "cat"), ("val", "dog")]:
        (root / "classes_differ" / split / label).mkdir(parents=True)
        (root / "classes_differ" / split / label / "x.png").write_bytes(b"")  # only names are checked
    (root / "corrupt.pt").write_bytes(b"this is not a checkpoint" * 100)
    (root / "a_file").write_text("")
    torch.save({**dict.fromkeys(guard.CHECKPOINT_KEYS), "args": {"arch": "resnet18"}}, root / "resnet18.pt")
    return root


BAD_INPUTS = {
    "N missing": ([], "launch.sh: error: N must be a positive integer, got ''"),
    "N zero": (["0"], "launch.sh: error: N must be a positive integer, got '0'"),
    "N not a number": (["four"], "launch.sh: error: N must be a positive integer, got 'four'"),
    "data missing": (["2", "--data", "{root}/nowhere"], "--data {root}/nowhere: no such directory"),
    "data without images": (["2", "--data", "{root}/no_images"], "{root}/no_images/train holds no images"),
    "data classes differ": (["2", "--data", "{root}/classes_differ"],
                            "train/ and val/ must hold the same class folders, or the labels differ "
                            "(only in train/: ['cat']; only in val/: ['dog'])"),
    "unknown arch": (["2", "--arch", "resnet_nope"], "argument --arch: invalid choice: 'resnet_nope' (choose from "),
    "powersgd with fp16": (["2", "--comm-hook", "powersgd", "--amp", "fp16"],
                           "--comm-hook powersgd cannot run with --amp fp16"),
    "arch too large for the images": (["2", "--arch", "vit_b_16", "--image-size", "32"],
                                      "--arch vit_b_16 cannot train on 32 px images (AssertionError: "
                                      "Wrong image height! Expected 224 but got 32!)"),
    "arch with auxiliary outputs": (["2", "--arch", "googlenet"],
                                    "--arch googlenet returns GoogLeNetOutputs, not logits"),
    "unknown comm hook": (["2", "--comm-hook", "int8"], "argument --comm-hook: invalid choice: 'int8'"),
    "batch size 0": (["2", "--batch-size", "0"], "--batch-size must be 1 or more, got 0"),
    "save every 0": (["2", "--save-every", "0"], "--save-every must be 1 or more, got 0"),
    "checkpoint dir under a file": (["2", "--checkpoint-dir", "{root}/a_file/ck"],
                                    "--checkpoint-dir: cannot write under {root}/a_file; "
                                    "expected a writable directory"),
    "resume missing": (["2", "--resume", "{root}/none.pt"], "--resume {root}/none.pt: no such file"),
    "resume corrupt": (["2", "--resume", "{root}/corrupt.pt"], "--resume {root}/corrupt.pt: not a readable checkpoint"),
    "resume other arch": (["2", "--resume", "{root}/resnet18.pt"],
                          "--resume {root}/resnet18.pt holds a resnet18 model but --arch is resnet50"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_fails_fast_with_one_line(case, bad_inputs):
    args, message = BAD_INPUTS[case]
    args = [a.format(root=bad_inputs) for a in args]
    result = run(["bash", LAUNCH, *args], timeout=30)
    assert result.returncode != 0 and result.seconds < 15
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message.format(root=bad_inputs) in lines[0], result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("nnodes", ["3:2", "0:2", "1:", "two"])
def test_a_node_range_torchrun_would_refuse_fails_with_one_line(nnodes):
    result = run(["bash", LAUNCH, "1"], timeout=30, env=clean_env(NNODES=nnodes, MASTER_ADDR="127.0.0.1", RUN_ID="a"))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"launch.sh: error: NNODES must be a number of nodes N or a range MIN:MAX, 1 <= MIN <= MAX: '{nnodes}'"]


@pytest.mark.quick
def test_an_elastic_job_without_a_run_id_fails_with_one_line():
    # Its nodes resume from the job's own last.pt: RUN_ID names the job, or SLURM_JOB_ID.
    result = run(["bash", LAUNCH, "1"], timeout=30, env=clean_env(NNODES="1:2", MASTER_ADDR="127.0.0.1"))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "launch.sh: error: NNODES=1:2 needs RUN_ID, the job's id on every node"]


LAUNCH_ENV_INPUTS = {  # launch.sh's variables: each case's environment, and the one line it gets
    "interface missing": (dict(NNODES="2", NODE_RANK="0", GLOO_SOCKET_IFNAME="lo,nonexistent9"),
                          "train_ddp.py: error: GLOO_SOCKET_IFNAME=lo,nonexistent9 names 'nonexistent9', which this "
                          "machine lacks; expected some of its interfaces: "),
    # A node that joins waits, within INIT_TIMEOUT, for the running ones' 30 s stop, then LAST_CALL.
    "init timeout too short for a node that joins": (
        dict(NNODES="1:2", RUN_ID="a", INIT_TIMEOUT="60", LAST_CALL="30"),
        "launch.sh: error: INIT_TIMEOUT 60 s must exceed LAST_CALL 30 s + 30 s: a node that joins waits for the "
        "others to stop (30 s)"),
    "init timeout not a number": (dict(NNODES="1:2", RUN_ID="a", INIT_TIMEOUT="1m"),
                                  "launch.sh: error: INIT_TIMEOUT must be a whole number: '1m'"),
    # bash's arithmetic reads 050 as octal 40, and 090 as no number at all
    "init timeout with a leading zero": (dict(NNODES="1:2", RUN_ID="a", INIT_TIMEOUT="090", LAST_CALL="30"),
                                         "launch.sh: error: INIT_TIMEOUT must be a whole number: '090'"),
    "node rank not a number": (dict(NNODES="2", NODE_RANK="x"), "launch.sh: error: NODE_RANK must be a whole number: "
                                                                "'x'"),
    "node rank missing": (dict(NNODES="2"), "launch.sh: error: NODE_RANK must be 0 (on MASTER_ADDR) to 1: ''"),
    "node rank past the nodes": (dict(NNODES="2", NODE_RANK="2"),
                                 "launch.sh: error: NODE_RANK must be 0 (on MASTER_ADDR) to 1: '2'"),
    "master addr missing": (dict(NNODES="2", NODE_RANK="0", MASTER_ADDR=""),
                            "launch.sh: error: NNODES=2 needs MASTER_ADDR: node 0's address"),
    "master port not a number": (dict(NNODES="2", NODE_RANK="0", MASTER_PORT="abc"),
                                 "launch.sh: error: MASTER_PORT must be a whole number: 'abc'"),
    "master port zero": (dict(NNODES="2", NODE_RANK="0", MASTER_PORT="0"),
                         "launch.sh: error: MASTER_PORT must be 1 to 65535: 0"),
    # A job's own id, by which its restarts and new pods find its last.pt: without one, new pods would start
    # afresh and write over it.
    "a trainjob without a run id": (dict(NNODES="", RUN_ID="", PET_NNODES="2", PET_NODE_RANK="0"),
                                    "launch.sh: error: NNODES=2 needs RUN_ID, the job's id on every node"),
    "rendezvous host not 0 or 1": (dict(NNODES="1:2", RUN_ID="a", RDZV_HOST="yes"),
                                   "launch.sh: error: RDZV_HOST must be 1 (this node hosts it) or 0"),
}


@pytest.mark.parametrize("case", LAUNCH_ENV_INPUTS)
def test_a_launch_variable_out_of_range_fails_with_one_line(case):
    env, message = LAUNCH_ENV_INPUTS[case]
    result = run(["bash", LAUNCH, "1", "--arch", "resnet18"], timeout=30,
                 env=clean_env(**{"MASTER_ADDR": "127.0.0.1", "RUN_ID": "a", **env}))
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(message), result.stderr
    if case == "interface missing":  # the interfaces this machine has, loopback among them
        assert "lo" in line[len(message):].split(), line


def test_launch_sh_finds_train_ddp_py_under_an_exported_cdpath():
    # cd prints the folder it finds through CDPATH, which went into launch.sh's own path.
    root = Path(LAUNCH).parent
    result = run(["bash", f"{root.name}/launch.sh", "1", "--epochs", "0"], timeout=30, cwd=root.parent,
                 env=clean_env(CDPATH=root.parent))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "train_ddp.py: error: --epochs must be 1 or more, got 0"], result.stderr


def test_master_addr_that_never_resolves_fails_after_init_timeout_with_one_line():
    # A pod's name resolves once it has an address, minutes later maybe: launch.sh waits, and says for what.
    env = clean_env(NNODES="2", NODE_RANK="1", RUN_ID="a", MASTER_ADDR="node0.invalid", INIT_TIMEOUT=3)
    result = run(["bash", LAUNCH, "1", "--arch", "resnet18"], timeout=60, env=env)
    assert result.returncode == 2 and 3 <= result.seconds < 20 and result.stdout == ""
    # Before the name resolves, the interface is the default route's: named, where this machine has one.
    lines = result.stderr.strip().splitlines()
    if re.fullmatch(r"launch\.sh: GLOO_SOCKET_IFNAME=(\S+) NCCL_SOCKET_IFNAME=\1", lines[0]):
        lines = lines[1:]
    assert lines == [
        "launch.sh: waiting for the rendezvous at node0.invalid:29500, which another node hosts",
        "launch.sh: error: no rendezvous answered at MASTER_ADDR:MASTER_PORT node0.invalid:29500 within INIT_TIMEOUT "
        "3 s; expected launch.sh on the node that holds node0.invalid"]


@pytest.mark.parametrize("moment", ["the rendezvous answers", "torchrun meets the other nodes"])
def test_a_signal_while_the_nodes_wait_for_each_other_ends_launch_sh_at_once(tmp_path, moment):
    # A pod waits minutes for the others (INIT_TIMEOUT, 600 s by default), longer than Kubernetes' grace period:
    # there is nothing to save yet, and launch.sh stops within seconds, leaving nothing behind. An elastic node that
    # joins waits for the rendezvous to answer; a static node 0's torchrun, for the other nodes.
    port = free_port()
    env = dict(NNODES="1:2", RDZV_HOST="0") if moment == "the rendezvous answers" else dict(NNODES="2", NODE_RANK="0")
    job = start_logged(["bash", LAUNCH, "1", *FAST, "--checkpoint-dir", str(tmp_path)], tmp_path,
                       clean_env(RUN_ID="a", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env))
    wait_for(lambda: "rendezvous at 127.0.0.1" in stderr(job), job, "the rendezvous line")
    time.sleep(3)
    os.kill(job.pid, signal.SIGTERM)
    assert wait_exit(job, 30) < 5 and job.returncode == 75, stderr(job)
    left = [int(p.name) for p in Path("/proc").glob("[0-9]*") if str(port).encode() in proc_file(p.name, "cmdline")]
    kill_pids(left)
    assert not left_behind(tmp_path) and not left, (left, stderr(job))
    assert "no rendezvous answered" not in stderr(job) and "Traceback" not in stderr(job), stderr(job)


def test_an_elastic_node_without_iproute2_and_procps_finds_that_it_hosts_the_rendezvous(tmp_path):
    # Slim images lack both: the node found nothing, took itself for one that joins, and a SIGTERM there would have
    # killed the rendezvous for every node. Python's socket tells whether it holds MASTER_ADDR.
    path = tmp_path / "bin"
    path.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        for command in Path(folder).glob("*") if Path(folder).is_dir() else []:
            if command.name not in ("ip", "ps", "pgrep", "pkill") and not (path / command.name).exists():
                (path / command.name).symlink_to(command)
    env = clean_env(NNODES="1:2", RUN_ID="a", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), LAST_CALL=1,
                    PATH=path)
    result = ok(run(["bash", LAUNCH, "1", *FAST, "--epochs", "1", "--checkpoint-dir", tmp_path], env=env))
    assert "launch.sh: this node hosts the rendezvous at 127.0.0.1:" in result.stderr, result.stderr
    assert load(tmp_path / "last.pt")["epoch"] == 1


def test_a_second_sigterm_to_a_leaving_node_still_waits_for_its_workers(tmp_path):
    # NNODES=1:2 on one machine: launch.sh as the rendezvous host, and as a node that joins it. The joining node gets
    # SIGTERM twice (SLURM and launch.sh's own forwarding may send several): it leaves, its workers save with the
    # others, and it exits 75 once they have ended. The second SIGTERM ran the leave again, which found torchrun
    # killed and no worker, and exited at once, its workers still saving.
    checkpoints = tmp_path / "ck"
    env = dict(NNODES="1:2", RUN_ID="twice", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), LAST_CALL=5)
    host, joining = (start_logged(["bash", LAUNCH, "1", *FAST, "--checkpoint-dir", str(checkpoints)],
                                  subdir(tmp_path / name), clean_env(RDZV_HOST=is_host, **env))
                     for name, is_host in [("host", 1), ("joining", 0)])
    try:
        wait_for(lambda: "step 4/16" in stdout(host) + stdout(joining), host, "step 4")
        workers = [pid for pid in descendants(joining.pid) if b"train_ddp.py" in proc_file(pid, "cmdline")]
        os.kill(joining.pid, signal.SIGTERM)
        time.sleep(0.5)
        os.kill(joining.pid, signal.SIGTERM)
        wait_exit(joining, 60)
        alive = [pid for pid in workers if proc_file(pid, "stat") and b") Z" not in proc_file(pid, "stat")]
        assert joining.returncode == 75 and workers and not alive, (workers, alive, stderr(joining)[-2000:])
        wait_for(lambda: (checkpoints / "last.pt").exists(), host, "the save")
        saved = load(checkpoints / "last.pt")
        assert (saved["epoch"], saved["world_size"]) == (0, 2) and saved["step"] >= 4, saved["step"]
        assert "Killed" not in stderr(joining), stderr(joining)[-2000:]
    finally:
        kill_tree(host)
        kill_tree(joining)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")
def test_more_processes_than_gpus_fails_fast():
    n = torch.cuda.device_count() + 1
    env = clean_env()
    del env["CUDA_VISIBLE_DEVICES"]  # the one test that needs the GPUs
    result = run(["bash", LAUNCH, str(n)], timeout=30, env=env)
    assert result.returncode != 0 and result.seconds < 15
    assert result.stderr.strip().splitlines() == [
        f"train_ddp.py: error: {n} processes on this machine but only {n - 1} GPUs are visible; "
        "start at most one process per GPU"]


def test_val_set_smaller_than_world_size_works(tmp_path):
    # 2 val images on 3 ranks: the third evaluates a padding duplicate, which must not count. One process
    # evaluating the same checkpoint must give the same numbers.
    args = ["--arch", "resnet18", "--train-samples", "48", "--val-samples", "2", "--batch-size", "8"]
    ok(run(torchrun(3, *args, "--epochs", "1", "--checkpoint-dir", tmp_path, "--metrics-file", tmp_path / "m.jsonl")))
    ok(run([sys.executable, TRAIN, *args, "--evaluate", "--resume", str(tmp_path / "last.pt"),
            "--metrics-file", str(tmp_path / "single.jsonl")]))
    distributed, single = metrics(tmp_path / "m.jsonl")[0], metrics(tmp_path / "single.jsonl")[0]
    assert distributed["val_samples"] == single["val_samples"] == 2
    for key in ["val_acc1", "val_acc5"]:
        assert distributed[key] == single[key], (distributed, single)
    assert distributed["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)


def test_unreadable_image_mid_epoch_stops_every_rank_with_one_line(tmp_path):
    # An ImageFolder of JPEGs trained for an epoch; then one file is damaged, and the resumed run meets it in
    # a DataLoader worker mid-epoch. The rank that read it names it, rank 0 says which rank failed, every rank
    # stops at once (no other rank left in a collective), and last.pt is the epoch-1 checkpoint, as it was.
    data = write_images(tmp_path / "data", noise_image(32, 32), ["a", "b"], {"train": 32, "val": 4}, ".jpg")
    args = ["--data", str(data), "--arch", "resnet18", "--image-size", "32", "--batch-size", "4", "--workers", "1",
            "--checkpoint-dir", str(tmp_path / "ck")]
    ok(run(["bash", LAUNCH, "2", *args, "--epochs", "1"]))
    before = (tmp_path / "ck" / "last.pt").read_bytes()
    damaged = data / "train" / "b" / "7.jpg"
    damaged.write_bytes(damaged.read_bytes()[:300])
    resume = ["--resume", str(tmp_path / "ck" / "last.pt")]
    result = run(["bash", LAUNCH, "2", *args, "--epochs", "2", *resume], timeout=90)
    assert result.returncode != 0 and result.seconds < 60
    ours = [line for line in result.stderr.splitlines() if line.startswith("train_ddp.py: error:")]
    assert len(ours) == 2 and f'File "{TRAIN}"' not in result.stderr, result.stderr  # no traceback from any rank
    failed = next(line for line in ours if "cannot read" in line)
    rank = re.search(r"rank (\d): cannot read ", failed)[1]
    assert f"cannot read {damaged} (" in failed and failed.endswith("; remove or replace that file"), failed
    assert f"train_ddp.py: error: rank 0: stopping: rank {rank} failed (see above)" in ours
    assert (tmp_path / "ck" / "last.pt").read_bytes() == before


def test_an_unreadable_image_that_only_batch_norms_recompute_reads_stops_every_rank_with_one_line(tmp_path):
    # 20 images per rank train one step of 4 x 4; batch norm's statistics are then recomputed from all 20, so that
    # image 16 of rank 0's shard is read there first: rank 0 must not raise in the loader (a traceback) while rank 1
    # waits in the statistics' all-reduce.
    data = write_images(tmp_path / "data", noise_image(32, 32), ["a", "b"], {"train": 20, "val": 2}, ".jpg")
    order = list(DistributedSampler(range(40), num_replicas=2, rank=0, seed=0))
    damaged = Path(torchvision.datasets.ImageFolder(data / "train").samples[order[16]][0])
    damaged.write_bytes(damaged.read_bytes()[:300])
    result = run(["bash", LAUNCH, "2", "--data", str(data), "--arch", "resnet18", "--image-size", "32", "--epochs",
                  "1", "--batch-size", "4", "--accum-steps", "4", "--checkpoint-dir", str(tmp_path / "ck")],
                 timeout=90)
    ours = [line for line in result.stderr.splitlines() if line.startswith("train_ddp.py: error:")]
    assert result.returncode != 0 and f'File "{TRAIN}"' not in result.stderr, result.stderr[-3000:]
    assert len(ours) == 1 and ours[0].startswith(f"train_ddp.py: error: rank 0: cannot read {damaged} ("), ours
    assert not (tmp_path / "ck" / "last.pt").exists()


@pytest.mark.parametrize("seen_by", ["a log line", "a save between log lines"])
def test_a_model_gone_nan_stops_every_rank_with_one_line_and_saves_nothing(tmp_path, seen_by):
    # An epoch of sound training, then a resume at an lr of 1e9: the loss overflows within a few steps. The first log
    # line or --save-every save that sees it stops every rank with one line that says where; last.pt keeps the last
    # save before it, finite: the epoch-1 checkpoint, or one of --save-every's before the weights overflowed.
    every = ["--log-every", "2"] if seen_by == "a log line" else ["--log-every", "100", "--save-every", "1"]
    what = "the loss is (nan|inf)" if seen_by == "a log line" else "the weights are not finite"
    args = [*TINY, "--train-samples", "128", *every, "--checkpoint-dir", str(tmp_path)]
    ok(run(torchrun(2, *args, "--epochs", "1")))
    before = (tmp_path / "last.pt").read_bytes()
    result = run(torchrun(2, *args, "--resume", tmp_path / "last.pt", "--lr", "1e9"), timeout=90)
    assert result.returncode == 1 and f'File "{TRAIN}"' not in result.stderr, result.stderr[-3000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("train_ddp.py: error:")]
    assert len(ours) == 1 and re.search(f"error: {what} at epoch 2 step \\d+: training diverged", ours[0]), ours
    assert ours[0].endswith(f"{tmp_path / 'last.pt'} keeps the last save"), ours
    assert all(weights.isfinite().all() for weights in load(tmp_path / "last.pt")["model"].values())
    assert seen_by == "a save between log lines" or (tmp_path / "last.pt").read_bytes() == before


def test_workers_out_of_shared_memory_fail_naming_it(tmp_path):
    # Workers hand their batches over in /dev/shm; here a tmpfs of 1 MB, in a mount namespace of the run's own (root),
    # against batches of 4.8 MB. torch's DataLoader says what ran out, as troubleshooting.md shows.
    shm = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"', "sh"]
    result = run([*shm, "bash", LAUNCH, "2", "--arch", "resnet18", "--image-size", "224", "--batch-size", "32",
                  "--workers", "1", "--train-samples", "128", "--val-samples", "16", "--epochs", "1",
                  "--checkpoint-dir", str(tmp_path)], timeout=90)
    assert result.returncode != 0 and result.seconds < 60, result.stderr[-3000:]
    assert re.search(r"RuntimeError: unable to allocate shared memory\(shm\) for file </torch_\S+>: No space left on "
                     r"device", result.stderr), result.stderr[-3000:]
    assert not (tmp_path / "last.pt").exists()


# ---------------------------------------------------------------- 7. a rank late at evaluation
def test_rank_late_at_evaluation_does_not_time_out(tmp_path):
    # Rank 1 is frozen for longer than --init-timeout just as rank 0 starts validating: the
    # collectives must wait for it (up to --collective-timeout, 600 s by default), not fail.
    job = start_logged(["bash", LAUNCH, "2", *FAST, "--epochs", "1", "--init-timeout", "3", "--checkpoint-dir",
                        str(tmp_path), "--metrics-file", str(tmp_path / "m.jsonl")], tmp_path)
    wait_for(lambda: "step 16/16" in stdout(job), job, "the end of the training epoch", interval=0.01)
    late = worker(job, 1)
    os.kill(late, signal.SIGSTOP)
    time.sleep(8)
    os.kill(late, signal.SIGCONT)
    wait_exit(job, RUN_TIMEOUT)
    assert job.returncode == 0, stderr(job)[-3000:]
    assert metrics(tmp_path / "m.jsonl")[0]["val_samples"] == 50


# ---------------------------------------------------------------- 8. nodes that disagree on where to resume
def test_nodes_resuming_from_different_checkpoints_all_stop(tmp_path):
    # Node 0 has a checkpoint, node 1 (its own local disk) has none: both must stop at once.
    args = ["--arch", "resnet18", "--train-samples", "32", "--val-samples", "4", "--batch-size", "8"]
    ok(run(torchrun(1, *args, "--epochs", "1", "--checkpoint-dir", tmp_path / "node0")))
    port = free_port()
    nodes = [start_logged(["bash", LAUNCH, "1", *args, "--epochs", "2", "--checkpoint-dir", str(tmp_path / f"node{r}"),
                           *(["--resume", str(tmp_path / "node0" / "last.pt")] if r == 0 else [])],
                          subdir(tmp_path / f"log{r}"),
                          env=clean_env(NNODES=2, NODE_RANK=r, RUN_ID="a", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    for node in nodes:
        wait_exit(node, 60)
    assert all(node.returncode != 0 for node in nodes)
    errors = stderr(nodes[0]) + stderr(nodes[1])
    for node in nodes:  # each node says it, once
        line = re.escape("train_ddp.py: error: the ranks would resume from different checkpoints (rank 0: epoch 1 "
                         "step 0, samples 0, run id ") + "[0-9a-f-]{36}" + re.escape("; rank 1: a fresh start)")
        assert len(re.findall(line, stderr(node))) == 1, stderr(node)[-3000:]
    assert "; rank 1: a fresh start); give every node the same --resume file" in errors


# ---------------------------------------------------------------- 9. gpu_check.sh, which has one try on a GPU machine
def gpu_check(tmp_path, deadline, only="", **env):
    """gpu_check.sh --rehearse (its steps on the CPU) under DEADLINE, its output in tmp_path/out; ONLY these steps;
    env, more variables."""
    return start_logged(["bash", str(Path(TRAIN).parent / "gpu_check.sh"), "--rehearse"], tmp_path,
                        env=clean_env(DEADLINE=deadline, OUT=tmp_path / "out", ONLY=only, **env))


def gpu_check_plan():
    """gpu_check.sh's plan: its steps in order, each with (the processes it starts that import torch, its
    seconds of work on an H200); the same for the probes and checks between them; the seconds it counts for
    one such start; and the steps that run on torch 2.15 or later only."""
    text = (Path(TRAIN).parent / "gpu_check.sh").read_text()
    words = re.search(r"^plan=\(([^)]*)\)", text, re.M)[1].split()
    plan = {name: (int(starts), int(work)) for name, starts, work in zip(words[::3], words[1::3], words[2::3])}
    probes_and_checks = tuple(map(int, re.search(r"^probes_and_checks=\((\d+) (\d+)\)$", text, re.M).groups()))
    return (plan, probes_and_checks, int(re.search(r"^START_SECONDS=(\d+)$", text, re.M)[1]),
            re.search(r"^from_torch_2_15=\(([^)]*)\)", text, re.M)[1].split())


def left_by(tmp_path):
    """Processes still running with tmp_path in their command line or environment."""
    return [int(p.name) for p in Path("/proc").glob("[0-9]*") if p.name != str(os.getpid())
            and str(tmp_path).encode() in proc_file(p.name, "cmdline") + proc_file(p.name, "environ")]


def test_gpu_check_skips_what_its_deadline_leaves_no_time_for(tmp_path):
    # 40 s: time for a step or two, each started only if the deadline leaves it the time its process starts take,
    # and cut at the deadline. A step skipped is not a pass: the check is incomplete, exit code 2 (1 if a step
    # failed or timed out).
    job = gpu_check(tmp_path, 40)
    seconds = wait_exit(job, 40 + 60)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    results = {step["step"]: (step["result"], step["note"]) for step in summary["steps"]}
    assert seconds < 40 + 30, stdout(job)[-3000:]
    plan, _, start_seconds, _ = gpu_check_plan()  # every step, in the plan's order, with its estimate
    assert [(step["step"], step["estimated_seconds"]) for step in summary["steps"]] == [
        (name, starts * start_seconds + work) for name, (starts, work) in plan.items()], summary
    skips = re.findall(r"^== (\w+): skipped, (-?\d+) s left before the deadline, (\d+) s to start its processes$",
                       stdout(job), re.M)
    assert skips and all(int(left) < int(starting) == plan[name][0] * start_seconds
                         for name, left, starting in skips), skips
    assert results["gather_nccl"] == ("skipped", "needs a GPU")
    # A rehearsal runs every step on gloo; a step that runs nothing here has no backend.
    assert all(step["backend"] == ("-" if step["note"] == "needs a GPU" or step["result"] == "not applicable"
                                   else "gloo") for step in summary["steps"]), summary
    # A step that the deadline cut short is incomplete too, not failed.
    assert results["headline"][0] == "pass" or results["headline"] == ("skipped", "deadline"), results
    # Once the deadline skips a step, it skips every one after it (but those a rehearsal skips for want of a GPU,
    # and those this torch has nothing for): the least valuable, last in the plan.
    cut = [result == ("skipped", "deadline") for result in results.values()
           if result != ("skipped", "needs a GPU") and result[0] != "not applicable"]
    assert cut[-1] and cut[cut.index(True):] == [True] * (len(cut) - cut.index(True)), results
    assert not [name for name, (result, _) in results.items()
                if result not in ("pass", "skipped", "not applicable")], results
    assert job.returncode == 2, stdout(job)[-3000:]
    # The rehearsal runs 5 steps: at least all after the headline are left no time.
    assert summary["finished"] and not summary["complete"] and summary["skipped_by_deadline"] >= 4, summary
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.log", "step_logs.tar.gz",
                                                                      "summary.json"]
    assert not left_by(tmp_path)


def test_gpu_check_plan_fits_with_margin_on_torch_2_11_and_2_15_counting_process_starts():
    # A GPU session has 15 minutes at most, the machine's start included, and 10 for one command: the deadline
    # (540 s) is the margin for estimates that turn out low, not a budget to plan into. Each process that imports
    # torch takes 10 to 15 s to start on the GPU machine, whose torch is 2.11; on 2.15 or later the timeout step
    # runs again on the old NCCL backend.
    plan, probes_and_checks, start_seconds, from_torch_2_15 = gpu_check_plan()
    assert 10 <= start_seconds <= 15, start_seconds
    assert all(starts >= 1 for starts, _ in plan.values()), plan  # each step runs python with torch
    assert from_torch_2_15 and set(from_torch_2_15) <= plan.keys(), from_torch_2_15
    def estimate(steps):
        return sum(starts * start_seconds + work for starts, work in [probes_and_checks, *steps])
    on_2_11 = estimate(steps for name, steps in plan.items() if name not in from_torch_2_15)
    on_2_15 = estimate(plan.values())
    assert on_2_11 < on_2_15 <= 0.85 * 540, (on_2_11, on_2_15, plan)


@pytest.mark.quick
@pytest.mark.skipif(torch.__version__ >= "2.15", reason="this torch has both NCCL backends")
def test_gpu_check_lists_the_old_nccl_backends_step_as_not_applicable_before_torch_2_15(tmp_path):
    # On the GPU machine's torch 2.11 the step for torch 2.15's old NCCL backend runs nothing, costs no time, and
    # leaves the check complete, exit code 0: not skipped by the deadline, which would make it incomplete.
    *_, from_torch_2_15 = gpu_check_plan()
    job = gpu_check(tmp_path, 300, only=" ".join(from_torch_2_15))
    wait_exit(job, 120)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert job.returncode == 0 and summary["complete"] and summary["failed"] == 0, stdout(job)[-3000:]
    assert [(step["step"], step["result"], step["seconds"], step["backend"]) for step in summary["steps"]] == [
        (name, "not applicable", 0, "-") for name in from_torch_2_15], summary
    assert all(re.fullmatch(r"torch 2\.\d+ has one NCCL backend", step["note"]) for step in summary["steps"]), summary


def test_gpu_check_skips_compile_in_one_line_without_a_compiler(tmp_path):
    # Inductor on the CPU builds with $CXX, else g++ (on CUDA, Triton's launcher with $CC, else gcc, else clang):
    # without one, every rank would fail at its first compiled step, deep in Inductor's traceback. The machine
    # lacks it, not the code: the step is skipped, saying so, and the check is complete.
    job = gpu_check(tmp_path, 300, only="compile", CXX=str(tmp_path / "no-such-compiler"))
    wait_exit(job, 120)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert job.returncode == 0 and summary["complete"], stdout(job)[-3000:]
    assert [(step["step"], step["result"], step["seconds"], step["note"]) for step in summary["steps"]] == [
        ("compile", "skipped", 0, "no C++ compiler: Inductor takes CXX, else g++")], summary
    assert "== compile: skipped, no C++ compiler: Inductor takes CXX, else g++\n" in stdout(job), stdout(job)


def test_gpu_check_refuses_an_only_that_names_no_step(tmp_path):
    # A misspelt name would run nothing, and pass.
    result = run(["bash", str(Path(TRAIN).parent / "gpu_check.sh"), "--rehearse"],
                 env=clean_env(TMPDIR=tmp_path, ONLY="headline train_fp61"), timeout=60)
    assert result.returncode == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("gpu_check.sh: error: ONLY names no step 'train_fp61'; expected names from the plan: "
                           "gather_nccl gather_mixed_group "), line
    assert not list(tmp_path.iterdir())


@pytest.mark.quick
def test_gpu_check_notes_the_headlines_images_per_second(tmp_path):
    # The note is read from train_ddp.py's metrics file and check_syncs.py's line, which either could change.
    job = gpu_check(tmp_path, 300, only="headline")
    wait_exit(job, 240)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert job.returncode == 0 and summary["complete"], stdout(job)[-3000:]
    (headline,) = summary["steps"]
    assert re.fullmatch(r"\d+ img/s, waiting for data \d+%, no host sync", headline["note"]), headline


def test_gpu_check_on_sigterm_kills_its_step_and_packs_what_it_has(tmp_path):
    job = gpu_check(tmp_path, 480, only="headline resume")
    wait_for(lambda: "== resume" in stdout(job), job, "the resume step", timeout=240, interval=0.1)  # after headline
    time.sleep(3)  # the step's processes are up
    os.kill(job.pid, signal.SIGTERM)
    wait_exit(job, 30)
    assert job.returncode == 1 and "gpu_check.sh: stopped by a signal" in stdout(job), stdout(job)[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(step["step"], step["result"]) for step in summary["steps"]] == [
        ("headline", "pass"), ("resume", "stopped")], summary
    assert (tmp_path / "out" / "step_logs.tar.gz").exists() and not (tmp_path / "out" / "logs").exists()
    time.sleep(1)
    left = left_by(tmp_path)
    kill_pids(left)
    assert not left


def test_gpu_check_refuses_at_once_without_a_gpu(tmp_path):
    # Run as on the GPU machine, without --rehearse: one line, exit 2, and nothing made or started.
    result = run(["bash", str(Path(TRAIN).parent / "gpu_check.sh")], env=clean_env(TMPDIR=tmp_path), timeout=60)
    assert result.returncode == 2 and result.seconds < 30, result
    assert result.stderr.strip().splitlines() == ["gpu_check.sh: error: torch sees no CUDA GPU here; expected the GPU "
                                                  "machine, or --rehearse on a CPU"], result.stderr
    assert not list(tmp_path.iterdir())


def test_gpu_check_stopped_under_timeout_leaves_no_process_and_no_work_folder(tmp_path):
    # timeout signals gpu_check.sh's whole process group (tee too): the step in flight is ended, whatever runs
    # under it, and the work folder removed. (Its steps run in sessions of their own, out of the group's reach.)
    env = clean_env(TMPDIR=tmp_path, OUT=tmp_path / "out", ONLY="headline resume")
    job = start_logged(["timeout", "-s", "TERM", "600", "bash", str(Path(TRAIN).parent / "gpu_check.sh"),
                        "--rehearse"], subdir(tmp_path / "log"), env=env)
    wait_for(lambda: "== headline" in stdout(job), job, "the training step", interval=0.1)
    time.sleep(3)  # the step's processes are up
    os.killpg(job.pid, signal.SIGTERM)
    wait_exit(job, 60)
    assert "gpu_check.sh: stopped by a signal" in stdout(job), stdout(job)[-3000:]
    time.sleep(1)
    left = left_by(tmp_path)
    kill_pids(left)
    assert not left
    assert not list(tmp_path.glob("gpu_check_work.*"))


def test_what_the_gpu_machine_runs_needs_only_torch_and_torchvision(tmp_path):
    # What the GPU machine has: a virtual environment with torch, torchvision and what they need, without pytest or
    # scikit-learn (a .pth file points at links to all of this machine's packages but those). test_gather.py's
    # torchrun entry runs there as gpu_check.sh runs it (one rank on env://'s variables, its store on a port the
    # system picks), and so does bench_data.py's photograph writer, which a user runs there by hand to time the
    # input pipeline on that machine's cores.
    import site
    packages = Path(site.getsitepackages()[0])
    linked = tmp_path / "linked"
    linked.mkdir()
    for entry in packages.iterdir():
        if not entry.name.lower().startswith(("pytest", "_pytest", "sklearn", "scikit_learn", "pynvml", "__pycache__")):
            (linked / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    python = venv / "bin" / "python"
    venv_packages = Path(subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                                        capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    (venv_packages / "machine.pth").write_text(f"{linked}\n")
    env = clean_env()
    absent = run([python, "-c", "import pytest"], env=env, timeout=60)
    assert absent.returncode != 0 and "No module named 'pytest'" in absent.stderr, absent
    here = Path(TRAIN).parent
    one_rank = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    gathers = ok(run([python, here / "test_gather.py", "--checks",
                      "check_all_gather_concat_uneven,check_all_gather_object"], env=one_rank, timeout=120))
    assert "2 passed, 0 failed" in gathers.stdout, gathers.stdout
    photos = ok(run([python, here / "benchmarks" / "bench_data.py", "--write-folder", tmp_path / "photos",
                     "--images", "4", "--val-images", "2"], env=env, timeout=120))
    assert "scikit-learn is not installed" in photos.stdout, photos.stdout
    assert len(list((tmp_path / "photos").rglob("*.jpg"))) == 6
