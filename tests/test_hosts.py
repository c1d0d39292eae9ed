"""Multi-node tests on real hosts: network namespaces on this machine (hosts.py), each with its own address,
interface, hostname and /etc/hosts, one launcher per host, as on a cluster (the file system stands for a shared
one). Without root or `ip netns` they skip; in CI (CI=true) they fail.

Every run has a hard timeout, and every host's processes are killed when its test ends.
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAST, LAUNCH, TRAIN, assert_same_weights, clean_env, load, metrics, noise_image, recipe, \
    write_images
from tools import hosts

PORT = 29500  # each host has its own ports: no clash with this machine's

pytestmark = pytest.mark.timeout(300)  # a backstop: every wait below has its own timeout


@pytest.fixture(scope="module", autouse=True)
def can_make_hosts():
    why = hosts.available()
    if why and os.environ.get("CI") == "true":
        pytest.fail(f"cannot make hosts: {why}")
    if why:
        pytest.skip(f"cannot make hosts: {why}")


def hostname_on_loopback(count):
    """/etc/hosts as many distributions write it: the machine's own name at 127.0.1.1, the others' at their
    addresses."""
    return {i: "127.0.0.1 localhost\n" + "".join(f"{'127.0.1.1' if j == i else f'{hosts.SUBNET}.{j + 1}'} host{j}\n"
                                                for j in range(count)) for i in range(count)}


class Job:
    """One launcher per host but the `absent` ones (start them with restart), its output in files
    (host<i>.out, host<i>.err) that the test can watch. Each host's environment: launch.sh's variables for
    host i (or those `variables(i)` gives), then `env`."""

    def __init__(self, on, folder, command, env=None, per_host=None, absent=(), variables=None):
        folder.mkdir(exist_ok=True)
        self.on, self.dir, self.began = on, folder, time.monotonic()
        self.command, self.env, self.per_host = command, env or {}, per_host or {}
        self.variables = variables or (lambda i: {"NNODES": len(on.names), "NODE_RANK": i, "RUN_ID": "job",
                                                  "MASTER_ADDR": on.address(0), "MASTER_PORT": PORT})
        self.procs = [None if i in absent else self.start(i, "w") for i in range(len(on.names))]

    def start(self, i, mode):
        env = clean_env(**{**self.variables(i), **self.env})
        out, err = open(self.path(i, "out"), mode), open(self.path(i, "err"), mode)
        return self.on.start(i, [*self.command(i), *self.per_host.get(i, [])], env, stdout=out, stderr=err,
                             cwd=os.path.dirname(TRAIN))

    def restart(self, i):
        """Host i's launcher (again), as a node that comes (back); its output goes on in the same files."""
        self.procs[i] = self.start(i, "a")

    def path(self, i, stream):
        return self.dir / f"host{i}.{stream}"

    def out(self, i):
        return self.path(i, "out").read_text() if self.path(i, "out").exists() else ""

    def err(self, i):
        return self.path(i, "err").read_text() if self.path(i, "err").exists() else ""

    def wait_for(self, text, host=0, timeout=120, count=1):
        while self.out(host).count(text) < count:
            if time.monotonic() - self.began > timeout or self.procs[host].poll() is not None:
                pytest.fail(f"never saw {text!r}\n{self.report()}")
            time.sleep(0.05)

    def wait(self, timeout):
        """Exit codes, once every process on every host has ended (not only the launchers)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ended = all(p is None or p.poll() is not None for p in self.procs)
            if ended and not any(self.on.pids(i) for i in range(len(self.procs))):
                return [p and p.returncode for p in self.procs]
            time.sleep(0.2)
        pytest.fail(f"processes left {timeout} s later\n{self.report()}")

    def report(self):
        return "\n".join(f"--- host{i}\n{self.out(i)[-1500:]}\n{self.err(i)[-2500:]}" for i in range(len(self.procs)))


def launch_sh(*args):
    return lambda i: ["bash", LAUNCH, "1", *args]


def torchrun(*args):
    """Plain torchrun on each host, as a user without launch.sh starts it."""
    return lambda i: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                      "--master-addr", hosts.SUBNET + ".1", "--master-port", str(PORT), "--nproc-per-node", "1",
                      TRAIN, *args]


def arguments(pid):
    """pid's command line, or [] once it has ended."""
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return []


def is_worker(pid):
    """Whether pid is a train_ddp.py that torchrun started (not torchrun, nor launch.sh's dry run)."""
    args = arguments(pid)
    launched = not {b"torch.distributed.run", b"--dry-run"} & set(args)
    return launched and any(arg.endswith(b"train_ddp.py") for arg in args)


def our_lines(text):
    return [line for line in text.splitlines() if line.startswith("train_ddp.py: error:")]


def tracebacks(text):
    """The lines of text that start a traceback, less those of torchrun's exit barrier. Its agents meet once
    more after their workers end, in the store of node 0's agent; when that agent leaves first, another's last
    wait finds the store closed, and torch logs it with a traceback (`_exit_barrier` in its
    elastic/agent/server/api.py). The agent goes on and exits as its workers did."""
    barrier = tuple(re.findall(r"^(E\S+ \S+ \d+ \S+\]) Error waiting on exit barrier", text, re.M))
    return [line for line in text.splitlines() if "Traceback" in line and not line.startswith(barrier)]


# ---------------------------------------------------------------- training across hosts
def test_two_hosts_train_resume_and_evaluate_as_one_host_does(tmp_path, uninterrupted):
    # Each host's name resolves to 127.0.1.1, the classic multi-node hang: launch.sh names the interface that
    # reaches MASTER_ADDR for gloo and NCCL, and says so. The user sets NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT.
    weights, records = uninterrupted.weights, uninterrupted.metrics
    args = [*FAST, "--checkpoint-dir", tmp_path / "ck", "--metrics-file", tmp_path / "m.jsonl"]
    with hosts.Hosts(2, hosts_files=hostname_on_loopback(2)) as on:
        job = Job(on, tmp_path, launch_sh(*args, "--epochs", "1"))
        assert job.wait(120) == [0, 0], job.report()
        for i in range(2):
            assert "launch.sh: GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0" in job.err(i), job.report()
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


# ---------------------------------------------------------------- elastic: hosts that leave and come back
ELASTIC = {"RUN_ID": "elastic-job", "LAST_CALL": 2}  # 2 s for more hosts once the fewest are there
# Hosts launched together: the later one's torchrun comes seconds after the first's, once its dry run is done and the
# rendezvous answers. 2 s is too short for it: the job would begin on one host, and restart on two or end first.
TOGETHER = {**ELASTIC, "LAST_CALL": 8}


def resumes(out):
    """(epoch, step, the world size it went on at, images of the epoch done) of each resume at another world size."""
    found = re.findall(r"resumed from \S+ at epoch (\d+) step (\d+); with batch 8 x 1 x (\d) \(was 8 x 1 x \d; "
                       r"(\d+) images of the epoch done\)", out)
    return [tuple(map(int, resume)) for resume in found]


def test_an_elastic_job_that_loses_a_host_finishes_on_the_other(tmp_path, uninterrupted):
    # NNODES=1:2: host 1 is killed mid-epoch 2. Host 0's worker fails with it, torchrun restarts it alone, and it
    # resumes from the last --save-every checkpoint at world size 1, after the images the two had trained.
    records = uninterrupted.metrics
    args = [*FAST, "--checkpoint-dir", tmp_path / "ck", "--metrics-file", tmp_path / "m.jsonl", "--save-every", "3"]
    with hosts.Hosts(2) as on:
        job = Job(on, tmp_path, launch_sh(*args), env={"NNODES": "1:2", **TOGETHER})
        job.wait_for("epoch 2/2 step 8/16")  # the save at step 6 is complete: the log line's all-reduce came after
        on.kill(1)
        assert job.wait(180)[0] == 0, job.report()
    *_, (epoch, step, world, images) = resumes(job.out(0))  # the last: host 1 may have joined late, at the start
    # Lost: fewer than 3 steps of those done; the rest of the epoch at 1 rank, each image once (test_resume.py).
    assert (epoch, world) == (2, 1) and step % 3 == 0 and step >= 6 and images == step * 16, job.report()
    assert f"epoch 2/2 step {2 * step + 4 - 2 * step % 4}/32 " in job.out(0)  # logged every 4 steps
    assert load(tmp_path / "ck" / "last.pt")["world_size"] == 1
    final = metrics(tmp_path / "m.jsonl")[-1]
    assert final["epoch"] == 2 and abs(final["val_acc1"] - records[1]["val_acc1"]) <= 15, (final, records[1])


def test_an_elastic_job_takes_a_host_back_when_it_returns(tmp_path):
    # NNODES=2:3: host 2 is killed, the other two go on from the last checkpoint; then host 2's launcher starts again,
    # its node joins, torchrun stops the two (SIGTERM: they save at once) and all three go on from there.
    args = [*FAST, "--epochs", "3", "--checkpoint-dir", tmp_path / "ck", "--save-every", "3"]
    with hosts.Hosts(3) as on:
        job = Job(on, tmp_path, launch_sh(*args), env={"NNODES": "2:3", **ELASTIC})
        job.wait_for("epoch 1/3 step 8/10")
        on.kill(2)
        job.wait_for("resumed from")
        job.restart(2)
        assert job.wait(240) == [0, 0, 0], job.report()
    (epoch, _, world, images), (epoch_back, _, world_back, images_back) = resumes(job.out(0))
    assert (world, world_back) == (2, 3) and (epoch, images) < (epoch_back, images_back), job.report()
    assert "stopped by SIGTERM" in job.out(0) and load(tmp_path / "ck" / "last.pt")["world_size"] == 3


def test_an_elastic_job_starts_when_master_addr_is_node_0s_name_on_loopback_there(tmp_path):
    # The SLURM recipe's MASTER_ADDR is node 0's name, which Debian and Ubuntu map to 127.0.1.1 on node 0 itself and
    # the other nodes to its address: node 0 hosts the rendezvous all the same (torch's own guess, the hostname's
    # addresses against MASTER_ADDR, fails on every node), and says that it must stay.
    args = [*FAST, "--epochs", "1", "--checkpoint-dir", tmp_path / "ck"]
    with hosts.Hosts(2, hosts_files=hostname_on_loopback(2), default_route="eth0") as on:  # node 0's card: its route
        job = Job(on, tmp_path, launch_sh(*args), env={"NNODES": "1:2", "MASTER_ADDR": "host0", **TOGETHER})
        assert job.wait(180) == [0, 0], job.report()
    assert f"launch.sh: this node hosts the rendezvous at host0:{PORT}, and must stay" in job.err(0), job.report()
    assert "launch.sh: GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0" in job.err(0), job.report()
    assert f"launch.sh: waiting for the rendezvous at host0:{PORT}, which another node hosts" in job.err(1), \
        job.report()
    assert load(tmp_path / "ck" / "last.pt")["epoch"] == 1


def test_an_elastic_job_on_two_network_cards_named_as_a_list_trains(tmp_path):
    # GLOO_SOCKET_IFNAME=eth0,eth1: gloo spreads its connections over both cards, and launch.sh passes the list on
    # as it is (torchrun's --local-addr: the first card's address).
    args = [*FAST, "--epochs", "1", "--checkpoint-dir", tmp_path / "ck"]
    with hosts.Hosts(2, cards=2) as on:
        job = Job(on, tmp_path, launch_sh(*args), env={"NNODES": "2:2", "GLOO_SOCKET_IFNAME": "eth0,eth1", **ELASTIC})
        assert job.wait(180) == [0, 0], job.report()
    assert load(tmp_path / "ck" / "last.pt")["world_size"] == 2


def test_an_elastic_rendezvous_that_cannot_form_ends_within_init_timeout_with_one_line(tmp_path):
    # Host 0, which holds MASTER_ADDR and would host the rendezvous, never starts: the others say so
    # themselves within INIT_TIMEOUT (the least it may be: LAST_CALL 2 s + 30 s + 1), one line each and no traceback.
    with hosts.Hosts(3) as on:
        job = Job(on, tmp_path, launch_sh(*FAST, "--checkpoint-dir", tmp_path),
                  env={"NNODES": "2:3", "INIT_TIMEOUT": 33, **ELASTIC}, absent=[0])
        began = time.monotonic()
        codes = job.wait(80)
        seconds = time.monotonic() - began
    assert codes == [None, 2, 2] and seconds < 33 + 30, (seconds, job.report())
    for i in 1, 2:
        ours = [line for line in job.err(i).splitlines() if "error" in line.lower()]
        assert ours == [f"launch.sh: error: no rendezvous answered at MASTER_ADDR:MASTER_PORT {on.address(0)}:{PORT} "
                        "within INIT_TIMEOUT 33 s; expected launch.sh on the node that holds "
                        f"{on.address(0)}"], job.report()
        assert "Traceback" not in job.err(i)


def test_a_spot_notice_on_one_host_leaves_the_job_running_on_the_other(tmp_path, uninterrupted):
    # NNODES=1:2: every process of host 1 gets SIGTERM in epoch 2, and SIGKILL 30 s later, as a
    # preempted VM's do. The ranks agree on a step and save; host 1 leaves; host 0 waits for a SIGTERM
    # of its own, which does not come, and torchrun restarts it alone from that save, to the end.
    records = uninterrupted.metrics
    args = [*FAST, "--checkpoint-dir", tmp_path / "ck", "--metrics-file", tmp_path / "m.jsonl"]
    with hosts.Hosts(2) as on:
        job = Job(on, tmp_path, launch_sh(*args), env={"NNODES": "1:2", **TOGETHER})
        job.wait_for("epoch 2/2 step 4/16")
        on.kill(1, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while on.pids(1) and time.monotonic() < deadline:
            time.sleep(0.2)
        on.kill(1)
        codes = job.wait(180)
    assert codes == [0, 75], job.report()
    assert "stopped by SIGTERM at epoch 2 step" in job.out(0) and "another node left the elastic job" in job.err(0)
    *_, (epoch, step, world, images) = resumes(job.out(0))  # the last: host 1 may have joined late, at the start
    assert (epoch, world) == (2, 1) and step >= 4 and images == step * 16, job.report()
    final = metrics(tmp_path / "m.jsonl")[-1]
    assert final["epoch"] == 2 and abs(final["val_acc1"] - records[1]["val_acc1"]) <= 15, (final, records[1])
    assert load(tmp_path / "ck" / "last.pt")["world_size"] == 1


def test_a_spot_notice_on_the_rendezvous_host_ends_the_job_saved_on_every_host(tmp_path):
    # NNODES=1:2: host 0, which hosts the rendezvous, gets the notice (SIGTERM to every process, SIGKILL 30 s later).
    # The job cannot go on without it: the ranks agree on a step and save, and every host ends with exit 75 (saved,
    # not done), the other one with one line that says how to go on, and no traceback.
    args = [*FAST, "--checkpoint-dir", tmp_path / "ck"]
    with hosts.Hosts(2) as on:
        job = Job(on, tmp_path, launch_sh(*args), env={"NNODES": "1:2", **TOGETHER})
        job.wait_for("epoch 1/2 step 4/16")
        on.kill(0, signal.SIGTERM)
        noticed = time.monotonic()
        while on.pids(0) and time.monotonic() < noticed + 30:
            time.sleep(0.2)
        on.kill(0)
        codes = job.wait(60)
        seconds = time.monotonic() - noticed
    assert codes == [75, 75] and seconds < 30, (seconds, job.report())
    assert "stopped by SIGTERM at epoch 1 step" in job.out(0), job.report()
    assert (
        f"train_ddp.py: the node that hosts the rendezvous ({on.address(0)}:{PORT}) got a SIGTERM and left, and the "
        f"elastic job ends with it; go on with --resume {tmp_path / 'ck' / 'last.pt'}, and a MASTER_ADDR on a node "
        "that stays (not a spot node)") in job.err(1).splitlines(), job.report()
    assert "Traceback" not in job.err(0) + job.err(1), job.report()
    checkpoint = load(tmp_path / "ck" / "last.pt")
    assert (checkpoint["epoch"], checkpoint["world_size"]) == (0, 2) and checkpoint["step"] >= 4


def test_a_cancelled_elastic_job_ends_on_every_host_within_a_minute(tmp_path):
    # scancel, a Kubernetes delete, a whole spot fleet reclaimed: every process on every host gets SIGTERM. The
    # ranks agree on a step and save; host 1 leaves (its torchrun killed). Host 0's torchrun, its workers gone,
    # waited 300 s in its exit barrier for host 1's agent, then logged a traceback: launch.sh now ends it.
    args = [*FAST, "--checkpoint-dir", tmp_path / "ck"]
    with hosts.Hosts(2) as on:
        job = Job(on, tmp_path, launch_sh(*args), env={"NNODES": "1:2", **TOGETHER})
        job.wait_for("epoch 1/2 step 4/16")
        for i in 0, 1:
            on.kill(i, signal.SIGTERM)
        cancelled = time.monotonic()
        codes = job.wait(60)
        seconds = time.monotonic() - cancelled
    assert codes == [75, 75] and seconds < 60, (seconds, job.report())
    assert "stopped by SIGTERM at epoch 1 step" in job.out(0), job.report()
    assert "Traceback" not in job.err(0) + job.err(1), job.report()
    checkpoint = load(tmp_path / "ck" / "last.pt")
    assert (checkpoint["epoch"], checkpoint["world_size"]) == (0, 2) and checkpoint["step"] >= 4


def test_a_node_that_leaves_stops_a_worker_still_starting(tmp_path):
    # A worker starts with SIGTERM ignored (torchrun's, passed on) until train_ddp.py's first line: a slow Python
    # start (here a sitecustomize that takes 4 s, as a site-packages on a slow shared file system may) is the
    # window. A leave sent one SIGTERM, which the worker dropped: it trained on, and the node never left.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys, time\n"
        "if sys.argv[0].endswith('train_ddp.py') and '--dry-run' not in sys.argv:\n"
        "    time.sleep(4)\n")
    args = [*FAST, "--epochs", "3", "--checkpoint-dir", tmp_path / "ck"]
    with hosts.Hosts(2) as on:
        job = Job(on, tmp_path, launch_sh(*args), env={"NNODES": "1:2", **ELASTIC}, absent=[1])
        job.wait_for("epoch 1/3 step 4/32")  # host 0 alone; host 1 comes, and its worker starts slowly
        job.env["PYTHONPATH"] = site
        job.restart(1)
        deadline = time.monotonic() + 60
        while not any(is_worker(pid) for pid in on.pids(1)):
            assert time.monotonic() < deadline, job.report()
            time.sleep(0.05)
        job.procs[1].send_signal(signal.SIGTERM)  # to host 1's launch.sh alone, while its worker starts
        assert job.wait(180) == [0, 75], job.report()
    # Its worker took the SIGTERM: host 1 left, and host 0 went on alone.
    assert "another node left the elastic job" in job.err(0), job.report()
    assert load(tmp_path / "ck" / "last.pt")["world_size"] == 1


def test_two_launchers_on_one_machine_host_and_join_one_elastic_job(tmp_path):
    # A first try of an elastic job, on one machine, as docs/launching.md gives it: both launchers hold MASTER_ADDR,
    # and the second, told RDZV_HOST=0, joins the rendezvous of the first.
    args = [*FAST, "--epochs", "1", "--checkpoint-dir", tmp_path / "ck"]
    env = clean_env(NNODES="1:2", MASTER_ADDR=hosts.SUBNET + ".1", MASTER_PORT=PORT, **TOGETHER)
    with hosts.Hosts(1) as on:
        outputs = [open(tmp_path / f"launcher{i}.err", "w") for i in range(2)]
        first = on.start(0, ["bash", LAUNCH, "1", *args], env, stdout=subprocess.DEVNULL, stderr=outputs[0])
        deadline = time.monotonic() + 60
        while "hosts the rendezvous" not in (tmp_path / "launcher0.err").read_text():
            assert time.monotonic() < deadline and first.poll() is None, (tmp_path / "launcher0.err").read_text()
            time.sleep(0.1)
        time.sleep(3)  # its torchrun listening
        second = on.start(0, ["bash", LAUNCH, "1", *args], {**env, "RDZV_HOST": "0"}, stdout=subprocess.DEVNULL,
                          stderr=outputs[1])
        codes = [proc.wait(timeout=180) for proc in (first, second)]
    errors = [(tmp_path / f"launcher{i}.err").read_text() for i in range(2)]
    assert codes == [0, 0], errors
    assert f"launch.sh: waiting for the rendezvous at {hosts.SUBNET}.1:{PORT}" in errors[1], errors[1]
    assert load(tmp_path / "ck" / "last.pt")["world_size"] == 2


@pytest.mark.timeout(600)
def test_a_host_that_joins_never_ends_the_job_of_the_others(tmp_path):
    # The scale-up race: the agent of the host that sees the joining one first stops its workers; the
    # others' stop with them, before their own agent has seen it. Those wait for their own SIGTERM,
    # so that their agent never takes them for finished and closes the rendezvous. Short steps make
    # the race likely; three jobs in a row must all go on at 3 and finish.
    args = [*FAST, "--epochs", "1", "--train-samples", "400", "--batch-size", "2", "--log-every", "10"]
    with hosts.Hosts(3) as on:
        for attempt in range(3):
            folder = tmp_path / f"try{attempt}"
            job = Job(on, folder, launch_sh(*args, "--checkpoint-dir", folder / "ck"),
                      env={"NNODES": "2:3", **ELASTIC, "RUN_ID": f"race-{attempt}"}, absent=[2])
            job.wait_for("epoch 1/1 step 10/")
            job.restart(2)
            assert job.wait(240) == [0, 0, 0], job.report()
            assert load(folder / "ck" / "last.pt")["world_size"] == 3, job.report()


# ---------------------------------------------------------------- where users run it: Kubernetes, SkyPilot, containers
TRAINJOB_HOST = "trainjob-node-0-0.trainjob"  # Kubeflow's PET_MASTER_ADDR: pod 0 in the JobSet's headless service


def trainjob_hosts_files(names_pod_0=(0, 1)):
    """Each pod's /etc/hosts: the pods by name, and pod 0 by the service's name too where names_pod_0 says."""
    names = "".join(f"{hosts.SUBNET}.{i + 1} host{i}\n" for i in range(2))
    return {i: f"127.0.0.1 localhost\n{names}" + (f"{hosts.SUBNET}.1 {TRAINJOB_HOST}\n" if i in names_pod_0 else "")
            for i in range(2)}


def trainjob_pod(i):
    """What a pod of docs/launching.md's 2-node TrainJob has: the variables Kubeflow Trainer's torch runtime and
    Kubernetes set, and the recipe's RUN_ID, the JobSet's uid."""
    return {"PET_NNODES": 2, "PET_NPROC_PER_NODE": 1, "PET_NODE_RANK": i, "PET_MASTER_ADDR": TRAINJOB_HOST,
            "PET_MASTER_PORT": PORT, "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": 443,
            "RUN_ID": "3f1c2a4e-9b7d-4c65-8e21-5d0a6b7c8f90"}


def test_a_trainjob_pod_evicted_stops_both_pods_saved_and_new_pods_resume_to_the_end(tmp_path):
    # A drain evicts pod 1: Kubernetes sends SIGTERM to its first process, launch.sh. The ranks of both pods save at
    # one step and exit 75, not 0, which would make the pods Succeeded and the TrainJob Complete, half-trained. The
    # Job makes new pods (here the same launchers again), which find the job's last.pt by RUN_ID and go on.
    args = [*FAST, "--epochs", "2", "--checkpoint-dir", tmp_path / "ck", "--metrics-file", tmp_path / "m.jsonl"]
    with hosts.Hosts(2, hosts_files=trainjob_hosts_files()) as on:
        job = Job(on, tmp_path, launch_sh(*args), variables=trainjob_pod)
        job.wait_for("epoch 1/2 step 4/16")
        job.procs[1].send_signal(signal.SIGTERM)
        evicted = time.monotonic()
        codes = job.wait(60)
        seconds = time.monotonic() - evicted
        saved = load(tmp_path / "ck" / "last.pt")
        for i in 0, 1:
            job.restart(i)
        assert job.wait(180) == [0, 0], job.report()
    assert codes == [75, 75], job.report()
    assert "stopped by SIGTERM at epoch 1 step" in job.out(0) and saved["step"] >= 4, job.report()
    assert f"resumed from {tmp_path / 'ck' / 'last.pt'} at epoch 1 step {saved['step']}" in job.out(0), job.report()
    assert [r["epoch"] for r in metrics(tmp_path / "m.jsonl")] == [1, 2]
    assert not tracebacks(job.err(0) + job.err(1)), job.report()
    print(f"a TrainJob's pods ended {seconds:.1f} s after the SIGTERM")  # docs/launching.md's figure


def test_trainjob_pods_minutes_apart_wait_for_pod_0s_name_and_train(tmp_path):
    # JobSet starts pods in any order, and pod 0's name resolves only once pod 0 has an address; a cold node pulls the
    # image for minutes. Pod 1 exited 2 at once on the name, and the nodes waited 60 s for each other: now it waits
    # for the name, and both wait as torchrun would, 600 s (its waiting loop runs under `timeout 600`).
    args = [*FAST, "--epochs", "1", "--checkpoint-dir", tmp_path / "ck"]
    with hosts.Hosts(2, hosts_files=trainjob_hosts_files(names_pod_0=[0])) as on:
        job = Job(on, tmp_path, launch_sh(*args), variables=trainjob_pod, absent=[0])
        deadline = time.monotonic() + 30
        while f"waiting for the rendezvous at {TRAINJOB_HOST}:{PORT}" not in job.err(1):
            assert time.monotonic() < deadline and job.procs[1].poll() is None, job.report()
            time.sleep(0.2)
        waits = [arguments(pid)[:2] for pid in on.pids(1)]
        assert [b"timeout", b"600"] in waits, waits
        time.sleep(5)  # still waiting, not failed on the name
        assert job.procs[1].poll() is None, job.report()
        (Path("/etc/netns") / on.names[1] / "hosts").write_text(trainjob_hosts_files()[1])
        job.restart(0)
        assert job.wait(180) == [0, 0], job.report()  # done: the TrainJob is Complete
    assert load(tmp_path / "ck" / "last.pt")["world_size"] == 2


def test_a_trainjobs_pods_train_with_plain_torchrun(tmp_path):
    # The TrainJob's own command, `torchrun train_ddp.py`: torchrun takes every argument from the PET_* variables.
    command = lambda i: [sys.executable, "-m", "torch.distributed.run", TRAIN, *FAST, "--epochs", "1",
                         "--checkpoint-dir", tmp_path / "ck"]
    with hosts.Hosts(2, hosts_files=trainjob_hosts_files()) as on:
        job = Job(on, tmp_path, command, variables=trainjob_pod)
        assert job.wait(120) == [0, 0], job.report()
    assert load(tmp_path / "ck" / "last.pt")["world_size"] == 2


def test_the_skypilot_recipe_trains_on_two_hosts(tmp_path):
    # docs/launching.md's SkyPilot run: lines, with the variables SkyPilot sets on each node and this test's
    # arguments for the recipe's; RUN_ID is launch.sh's default, SKYPILOT_TASK_ID.
    run = recipe("job_recovery")["run"]
    documented = "--data /data/imagenet --checkpoint-dir /checkpoints --save-every 500"
    assert run.strip().endswith(documented), run
    command = lambda i: ["bash", "-c", run.replace(documented, '"$@"'), "bash", *FAST, "--epochs", "1",
                         "--checkpoint-dir", tmp_path / "ck"]
    with hosts.Hosts(2) as on:
        variables = lambda i: {"SKYPILOT_NODE_IPS": f"{on.address(0)}\n{on.address(1)}", "SKYPILOT_NODE_RANK": i,
                               "SKYPILOT_NUM_NODES": 2, "SKYPILOT_NUM_GPUS_PER_NODE": 1,
                               "SKYPILOT_TASK_ID": "sky-managed-2026-12-07-01-20-00-123456_resnet50_17-0"}
        job = Job(on, tmp_path, command, variables=variables)
        assert job.wait(120) == [0, 0], job.report()
    saved = load(tmp_path / "ck" / "last.pt")
    assert saved["world_size"] == 2 and saved["run_id"].startswith("sky-managed-"), saved["run_id"]


def test_launch_sh_trains_on_a_machine_whose_own_name_does_not_resolve(tmp_path):
    # A container or VM without its hostname in /etc/hosts: torchrun --standalone gave the workers that name as
    # MASTER_ADDR, which nothing resolves, and `bash launch.sh 2` retried it until it was killed.
    with hosts.Hosts(1, hosts_files={0: "127.0.0.1 localhost\n"}) as on:
        job = Job(on, tmp_path, lambda i: ["bash", LAUNCH, "2", *FAST, "--epochs", "1", "--checkpoint-dir",
                                           tmp_path / "ck"], variables=lambda i: {})
        assert job.wait(120) == [0], job.report()
    assert "2 x cpu (gloo)" in job.out(0)


def test_node_0_takes_its_card_when_its_name_maps_to_loopback_and_to_its_address(tmp_path):
    # host0's /etc/hosts maps its name to 127.0.1.1 and to its address, and its default route goes out eth1: it
    # took the last address it held, 127.0.1.1, then the default route's card, not the one the others reach.
    files = hostname_on_loopback(2)
    files[0] += f"{hosts.SUBNET}.1 host0\n"
    args = [*FAST, "--epochs", "1", "--checkpoint-dir", tmp_path / "ck"]
    with hosts.Hosts(2, hosts_files=files, cards=2, default_route="eth1") as on:
        job = Job(on, tmp_path, launch_sh(*args), env={"NNODES": "1:2", "MASTER_ADDR": "host0", **TOGETHER})
        assert job.wait(120) == [0, 0], job.report()
    assert "launch.sh: GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0" in job.err(0), job.report()


def test_an_ipv6_master_addr_trains_on_two_hosts(tmp_path):
    # launch.sh looked MASTER_ADDR up for IPv4 addresses only, and refused an IPv6 one.
    args = [*FAST, "--epochs", "1", "--checkpoint-dir", tmp_path / "ck"]
    with hosts.Hosts(2, ipv6=True) as on:
        job = Job(on, tmp_path, launch_sh(*args), env={"NNODES": "2:2", "MASTER_ADDR": on.ipv6_address(0), **ELASTIC})
        assert job.wait(120) == [0, 0], job.report()
    assert f"launch.sh: this node hosts the rendezvous at {on.ipv6_address(0)}:{PORT}" in job.err(0), job.report()
    assert load(tmp_path / "ck" / "last.pt")["world_size"] == 2


# ---------------------------------------------------------------- what goes wrong between hosts
def test_hostname_on_loopback_fails_within_init_timeout_and_says_what_to_set(tmp_path):
    # Plain torchrun works nothing out: gloo takes 127.0.1.1 from the hostname, and no rank can reach another. (gloo's
    # connect gives up after 5 x --init-timeout.)
    with hosts.Hosts(2, hosts_files=hostname_on_loopback(2)) as on:
        job = Job(on, tmp_path, torchrun(*FAST, "--init-timeout", "5", "--checkpoint-dir", tmp_path))
        codes = job.wait(5 + 60)
    assert all(codes), job.report()
    for i in range(2):
        lines = our_lines(job.err(i))
        assert len(lines) == 1, job.report()
        assert f"rank {i}: the process group did not form within --init-timeout 5 s" in lines[0], lines
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


def test_a_link_cut_mid_epoch_stops_the_others_and_the_job_resumes(tmp_path, uninterrupted):
    # The link to host 1 goes down: no reset, its packets vanish. The rank left stops within --collective-timeout
    # with one line; then the job resumes from last.pt, to the weights of a run never interrupted. (A host killed
    # outright closes its connections, and the others fail at once: test_an_elastic_job_that_loses_a_host_...)
    weights = uninterrupted.weights
    args = [*FAST, "--checkpoint-dir", tmp_path / "ck", "--collective-timeout", "10"]
    with hosts.Hosts(2) as on:
        job = Job(on, tmp_path, launch_sh(*args))
        job.wait_for("epoch 2/2 step 4/16")
        on.cut(1)
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
        env = clean_env(NNODES=2, NODE_RANK=0, RUN_ID="a", MASTER_ADDR=on.address(0), MASTER_PORT=PORT,
                        INIT_TIMEOUT=5)
        began = time.monotonic()
        proc = on.start(0, ["bash", LAUNCH, "1", *FAST, "--checkpoint-dir", tmp_path], env, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(TRAIN))
        out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.monotonic() - began < 5 + 30
    assert "Timed out after" in err and "1/2 clients joined" in err, err[-3000:]
