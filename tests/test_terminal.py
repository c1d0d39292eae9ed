"""What a person sees in a terminal: Ctrl-C typed into a real one (tmux), so that the signal goes where a
terminal sends it (to the foreground process group), not to one process the test picked; then the lines after
it, the exit code and the prompt. Each run has a hard timeout, and every process is killed when its test ends.
"""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAST, LAUNCH, ROOT, TRAIN, clean_env, descendants, kill_pids, load, proc_file, \
    resume_and_compare

pytestmark = pytest.mark.timeout(300)


class Terminal:
    """An interactive bash in a tmux server of its own, 200 columns wide; the job's files go to `folder`."""

    def __init__(self, folder):
        self.folder = folder
        # A server of its own per test: the last test's, just killed, may still hold its socket.
        self.server = f"ddp{os.getpid()}-{folder.name}"
        self.tmux("new-session", "-d", "-x", "200", "-y", "50",
                  "env PS1='prompt$ ' HISTFILE=/dev/null bash --norc --noprofile -i", env=clean_env())

    def tmux(self, *args, env=None):
        return subprocess.run(["tmux", "-L", self.server, *args], env=env, cwd=ROOT, capture_output=True,
                              text=True, check=True, timeout=30).stdout

    def type(self, *keys):
        self.tmux("send-keys", *keys)

    def screen(self):
        """Every line shown since the session began, without the ^C that the terminal echoes."""
        shown = self.tmux("capture-pane", "-p", "-J", "-S", "-").splitlines()
        return [re.sub(r"^(\^C)+", "", line).rstrip() for line in shown if line.strip()]

    def wait_for(self, pattern, timeout=120):
        """Until a line shown matches the regular expression `pattern` from its start."""
        deadline = time.monotonic() + timeout
        while not any(re.match(pattern, line) for line in self.screen()):
            if time.monotonic() > deadline:
                pytest.fail(f"never saw {pattern!r}\n" + "\n".join(self.screen()[-40:]))
            time.sleep(0.05)

    def run(self, command):
        """Type the command, and one that shows its exit code once it has ended."""
        self.type(f"{command}; echo exit $?", "Enter")

    def wait_for_exit(self, timeout=120):
        self.wait_for(r"exit \d+$", timeout)

    def launcher(self):
        """The pid of what the shell runs: launch.sh (whose subshells are its children, not the shell's)."""
        shell = self.tmux("list-panes", "-F", "#{pane_pid}").strip()
        return int(proc_file(shell, f"task/{shell}/children").split()[0])

    def running(self):
        """The job's processes not yet ended (by the folder in their arguments)."""
        return [int(p.name) for p in Path("/proc").glob("[0-9]*") if str(self.folder).encode() in
                proc_file(p.name, "cmdline") and b"tmux" not in proc_file(p.name, "cmdline")]

    def left_running(self):
        """The job's processes not yet ended, killed."""
        left = self.running()
        kill_pids(left)
        return left

    def close(self):
        self.left_running()
        subprocess.run(["tmux", "-L", self.server, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def terminal(tmp_path):
    opened = Terminal(tmp_path)
    yield opened
    opened.close()


def after(lines, text):
    """The lines from the one that holds text."""
    return lines[next(i for i, line in enumerate(lines) if text in line):]


def test_one_ctrl_c_stops_launch_sh_saved_and_the_prompt_comes_back_after_every_process(terminal, tmp_path,
                                                                                       uninterrupted):
    # It was: the prompt at once, then 165 lines and three tracebacks from processes left running, and last.pt
    # still the end of epoch 1. Now the ranks stop at one step, save, and say where, in one line.
    terminal.run(f"bash {LAUNCH} 2 {' '.join(FAST)} --checkpoint-dir {tmp_path}")
    terminal.wait_for("epoch 2/2 step 4/16")
    terminal.type("C-c")
    terminal.wait_for_exit()
    assert not terminal.left_running()  # the line came after every process of the job had ended
    saved = load(tmp_path / "last.pt")
    lines = after(terminal.screen(), "epoch 2/2 step 4/16")[1:]
    assert (saved["epoch"], saved["step"] > 4) == (1, True), lines
    assert [line for line in lines if not line.startswith("epoch 2/2 step ")] == [
        f"stopped by SIGINT at epoch 2 step {saved['step']}/16; continue with --resume {tmp_path}/last.pt",
        "exit 75", "prompt$"], lines
    resume_and_compare(tmp_path, uninterrupted)


def test_a_second_ctrl_c_stops_launch_sh_at_once(terminal, tmp_path):
    terminal.run(f"bash {LAUNCH} 2 {' '.join(FAST)} --checkpoint-dir {tmp_path}")
    terminal.wait_for("epoch 1/2 step 4/16")
    terminal.type("C-c")
    # Two keys typed at once can reach a busy launch.sh as one signal, as a person's two cannot: the second once
    # launch.sh is stopping the workers (its `sleep 1` between passes).
    launcher, deadline = terminal.launcher(), time.monotonic() + 30
    while b"sleep\x001\x00" not in [proc_file(pid, "cmdline") for pid in descendants(launcher)]:
        assert time.monotonic() < deadline, "launch.sh never acted on the first Ctrl-C"
        time.sleep(0.01)
    terminal.type("C-c")
    began = time.monotonic()
    terminal.wait_for_exit(timeout=30)
    assert time.monotonic() - began < 5
    # The SIGKILLs were sent before launch.sh exited; the kernel may take a moment more to end a process.
    while terminal.running() and time.monotonic() < began + 5:
        time.sleep(0.05)
    assert not terminal.left_running()
    lines = after(terminal.screen(), "epoch 1/2 step 4/16")[1:]
    assert [line for line in lines if not line.startswith("epoch 1/2 step ")] == [
        "launch.sh: stopped at once by a second Ctrl-C; the last save is kept", "exit 130", "prompt$"], lines
    assert not (tmp_path / "last.pt").exists()  # nothing saved in epoch 1: nothing written half


def test_ctrl_c_stops_train_ddp_py_without_a_launcher_saved(terminal, tmp_path):
    terminal.run(f"{sys.executable} {TRAIN} {' '.join(FAST)} --checkpoint-dir {tmp_path}")
    terminal.wait_for("epoch 1/2 step 4/32")
    terminal.type("C-c")
    terminal.wait_for_exit()
    saved = load(tmp_path / "last.pt")
    lines = after(terminal.screen(), "epoch 1/2 step 4/32")[1:]
    assert [line for line in lines if not line.startswith("epoch 1/2 step ")] == [
        f"stopped by SIGINT at epoch 1 step {saved['step']}/32; continue with --resume {tmp_path}/last.pt",
        "exit 75", "prompt$"], lines


def test_ctrl_c_to_plain_torchrun_stops_its_workers_saved(terminal, tmp_path):
    # torchrun passes a Ctrl-C on to its workers as SIGINT, then prints its own traceback: the workers save first.
    terminal.run(f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 {TRAIN} "
                 f"{' '.join(FAST)} --checkpoint-dir {tmp_path}")
    terminal.wait_for("epoch 1/2 step 4/16")
    terminal.type("C-c")
    terminal.wait_for_exit()
    assert not terminal.left_running()
    saved = load(tmp_path / "last.pt")
    assert saved["epoch"] == 0 and saved["step"] >= 4
    assert any(line == f"stopped by SIGINT at epoch 1 step {saved['step']}/16; continue with "
               f"--resume {tmp_path}/last.pt" for line in terminal.screen()), terminal.screen()
