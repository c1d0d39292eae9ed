"""Multi-node tests on real hosts: network namespaces on this machine (hosts.py), each with its own address,
interface, hostname and /etc/hosts, one launcher per host, as on a cluster (the file system stands for a shared
one). Without root or `ip netns` they skip; in CI (CI=true) they fail.

Every run has a hard timeout, and every host's processes are killed when its test ends.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hosts
from conftest import LAUNCH, TINY, TRAIN, assert_same_weights, clean_env, load, metrics, noise_image, ok, run, \
    write_images

FAST = [*TINY, "--train-samples", "256"]  # 2 epochs of 16 steps on 2 ranks
PORT = 29500  # each host has its own ports: no clash with this machine's

pytestmark = pytest.mark.timeout(300)  # a backstop: every wait below has its own timeout


@pytest.fixture(scope="module", autouse=True)
def can_make_hosts():
    why = hosts.available()
    if why and os.environ.get("CI") == "true":
        pytest.fail(f"cannot make hosts: {why}")
    if why:
        pytest.skip(f"cannot make hosts: {why}")


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """The same 2 ranks on this machine: the final weights and metrics the hosts must give."""
    out = tmp_path_factory.mktemp("one_host")
    ok(run(["bash", LAUNCH, "2", *FAST, "--checkpoint-dir", out, "--metrics-file", out / "m.jsonl"]))
    return load(out / "last.pt")["model"], metrics(out / "m.jsonl")


def hostname_on_loopback(count):
    """/etc/hosts as many distributions write it: the machine's own name at 127.0.1.1."""
    return {i: f"127.0.0.1 localhost\n127.0.1.1 host{i}\n" for i in range(count)}


class Job:
    """One launcher per host, its output in files (host<i>.out, host<i>.err) that the test can watch."""

    def __init__(self, on, folder, command, env=None, per_host=None):
        folder.mkdir(exist_ok=True)
        self.on, self.dir, self.began = on, folder, time.monotonic()
        self.procs = []
        for i in range(len(on.names)):
            env_i = clean_env(NNODES=len(on.names), NODE_RANK=i, MASTER_ADDR=on.address(0), MASTER_PORT=PORT,
                              **(env or {}))
            out, err = open(self.path(i, "out"), "w"), open(self.path(i, "err"), "w")
            self.procs.append(on.start(i, [*command(i), *(per_host or {}).get(i, [])], env_i, stdout=out, stderr=err,
                                       cwd=os.path.dirname(TRAIN)))

    def path(self, i, stream):
        return self.dir / f"host{i}.{stream}"

    def out(self, i):
        return self.path(i, "out").read_text()

    def err(self, i):
        return self.path(i, "err").read_text()

    def wait_for(self, text, host=0, timeout=120):
        while text not in self.out(host):
            if time.monotonic() - self.began > timeout or any(p.poll() is not None for p in self.procs):
                pytest.fail(f"never saw {text!r}\n{self.report()}")
            time.sleep(0.05)

    def wait(self, timeout):
        """Exit codes, once every process on every host has ended (not only the launchers)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ended = all(p.poll() is not None for p in self.procs)
            if ended and not any(self.on.pids(i) for i in range(len(self.procs))):
                return [p.returncode for p in self.procs]
            time.sleep(0.2)
        pytest.fail(f"processes left {timeout} s later\n{self.report()}")

    def report(self):
        return "\n".join(f"--- host{i}\n{self.out(i)[-1500:]}\n{self.err(i)[-2500:]}" for i in range(len(self.procs)))


def worker(on, i):
    """The training process on host i: torchrun's worker, which has LOCAL_RANK in its environment."""
    for pid in on.pids(i):
        try:
            if b"LOCAL_RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            pass
    raise AssertionError(f"no worker on host {i}")


def launch_sh(*args):
    return lambda i: ["bash", LAUNCH, "1", *args]


def torchrun(*args):
    """Plain torchrun on each host, as a user without launch.sh starts it."""
    return lambda i: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                      "--master-addr", hosts.SUBNET + ".1", "--master-port", str(PORT), "--nproc-per-node", "1",
                      TRAIN, *args]


def our_lines(text):
    return [line for line in text.splitlines() if line.startswith("train_ddp.py: error:")]


# ---------------------------------------------------------------- training across hosts
def test_two_hosts_train_resume_and_evaluate_as_one_host_does(tmp_path, one_host):
    # Each host's name resolves to 127.0.1.1, the classic multi-node hang: launch.sh names the interface that
    # reaches MASTER_ADDR for gloo and NCCL, and says so. The user sets NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT.
    weights, records = one_host
    args = [*FAST, "--checkpoint-dir", tmp_path / "ck", "--metrics-file", tmp_path / "m.jsonl"]
    with hosts.Hosts(2, hosts_files=hostname_on_loopback(2)) as on:
        job = Job(on, tmp_path, launch_sh(*args, "--epochs", "1"))
        assert job.wait(120) == [0, 0], job.report()
        for i in range(2):
            assert f"launch.sh: GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0 (reaches MASTER_ADDR {on.address(0)})" \
                in job.err(i), job.report()
        assert "2 x cpu (gloo)" in job.out(0) and job.out(1) == "", job.report()
        job = Job(on, tmp_path, launch_sh(*args, "--resume", tmp_path / "ck" / "last.pt"))
        assert job.wait(120) == [0, 0], job.report()
        assert f"resumed from {tmp_path / 'ck' / 'last.pt'} at epoch 2 step 0" in job.out(0)
        job = Job(on, tmp_path, launch_sh(*args, "--evaluate", "--resume", tmp_path / "ck" / "last.pt"))
        assert job.wait(120) == [0, 0], job.report()
    assert_same_weights(load(tmp_path / "ck" / "last.pt")["model"], weights)
    trained, evaluated = metrics(tmp_path / "m.jsonl")[1:]
    for key in ["val_loss", "val_acc1", "val_acc5", "val_samples"]:
        assert trained[key] == evaluated[key] == records[1][key], key
    assert [r["train_loss"] for r in metrics(tmp_path / "m.jsonl")[:2]] == [r["train_loss"] for r in records]


def test_restart_across_hosts_resumes_from_the_jobs_checkpoint(tmp_path, one_host):
    # A worker on host 1 killed mid-epoch 2: host 0's worker fails with it, both launchers restart their workers
    # (MAX_RESTARTS=1), they meet again and resume from the job's own last.pt (RUN_ID, the same on both hosts).
    weights, _ = one_host
    with hosts.Hosts(2) as on:
        job = Job(on, tmp_path, launch_sh(*FAST, "--checkpoint-dir", tmp_path), env={"MAX_RESTARTS": 1,
                                                                                   "RUN_ID": "job-1"})
        job.wait_for("epoch 2/2 step 4/16")
        os.kill(worker(on, 1), signal.SIGKILL)
        assert job.wait(180) == [0, 0], job.report()
        assert f"resumed from {tmp_path / 'last.pt'} at epoch 2 step 0" in job.out(0), job.report()
    assert_same_weights(load(tmp_path / "last.pt")["model"], weights)


# ---------------------------------------------------------------- what goes wrong between hosts
def test_hostname_on_loopback_fails_within_init_timeout_and_says_what_to_set(tmp_path):
    # Plain torchrun works nothing out: gloo takes 127.0.1.1 from the hostname, and no rank can reach another.
    with hosts.Hosts(2, hosts_files=hostname_on_loopback(2)) as on:
        job = Job(on, tmp_path, torchrun(*FAST, "--init-timeout", "10", "--checkpoint-dir", tmp_path))
        codes = job.wait(10 + 60)
    assert all(codes), job.report()
    for i in range(2):
        lines = our_lines(job.err(i))
        assert len(lines) == 1, job.report()
        assert f"rank {i}: the process group did not form within --init-timeout 10 s" in lines[0], lines
        assert lines[0].endswith("set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on)"), lines


def test_bad_input_on_one_host_is_said_there_and_the_other_stops(tmp_path):
    # Host 1 has no such --data folder (a node-local path): its rank says so; host 0's rank waits --init-timeout
    # for a rank that will not come, and says that.
    data = {0: ["--data", tmp_path / "data"], 1: ["--data", tmp_path / "nowhere"]}
    write_images(tmp_path / "data", noise_image(32, 32), ["a", "b"], {"train": 8, "val": 2})
    with hosts.Hosts(2) as on:
        job = Job(on, tmp_path, torchrun("--arch", "resnet18", "--init-timeout", "10", "--checkpoint-dir", tmp_path),
                  per_host=data)
        codes = job.wait(10 + 60)
    assert all(codes), job.report()
    assert our_lines(job.err(1)) == [f"train_ddp.py: error: --data {tmp_path / 'nowhere'}: no such directory; "
                                     "expected an ImageFolder root with train/ and val/"], job.report()
    (line,) = our_lines(job.err(0))
    assert "rank 0: the process group did not form within --init-timeout 10 s: expected WORLD_SIZE=2 ranks at " \
           f"{on.address(0)}:{PORT}, and not all came or could connect (" in line, line


@pytest.mark.parametrize("fault", ["link cut", "host killed"])
def test_a_host_lost_mid_epoch_stops_the_others_and_the_job_resumes(tmp_path, one_host, fault):
    # The link to host 1 goes down (no reset: its packets vanish), or every process on it is SIGKILLed. The rank
    # left stops within --collective-timeout with one line; then the job resumes from last.pt, to the weights of
    # a run never interrupted.
    weights, _ = one_host
    args = [*FAST, "--checkpoint-dir", tmp_path / "ck", "--collective-timeout", "10"]
    with hosts.Hosts(2) as on:
        job = Job(on, tmp_path, launch_sh(*args))
        job.wait_for("epoch 2/2 step 4/16")
        if fault == "link cut":
            on.cut(1)
        else:
            on.kill(1)
        began = time.monotonic()
        codes = job.wait(10 + 60)
        seconds = time.monotonic() - began
    assert codes[0] != 0 and seconds < 10 + 30, (seconds, job.report())
    (line,) = our_lines(job.err(0))
    assert "rank 0: a collective failed: another rank stopped, or stopped answering for --collective-timeout 10 s" \
        in line, line
    assert load(tmp_path / "ck" / "last.pt")["epoch"] == 1
    with hosts.Hosts(2) as on:
        resumed = Job(on, tmp_path / "resumed", launch_sh(*args, "--resume", tmp_path / "ck" / "last.pt"))
        assert resumed.wait(120) == [0, 0], resumed.report()
    assert_same_weights(load(tmp_path / "ck" / "last.pt")["model"], weights)


def test_a_host_that_never_comes_stops_the_other_within_init_timeout(tmp_path):
    with hosts.Hosts(2) as on:
        env = clean_env(NNODES=2, NODE_RANK=0, MASTER_ADDR=on.address(0), MASTER_PORT=PORT, INIT_TIMEOUT=5)
        began = time.monotonic()
        proc = on.start(0, ["bash", LAUNCH, "1", *FAST, "--checkpoint-dir", tmp_path], env, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(TRAIN))
        out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.monotonic() - began < 5 + 30
    assert "Timed out after" in err and "1/2 clients joined" in err, err[-3000:]
