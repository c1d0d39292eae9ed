"""Run train_ddp.py, and fail if a training step between two log lines makes the host wait for the device.

    torchrun --standalone --nproc-per-node 2 tools/check_syncs.py --arch resnet18 --workers 2   # any train_ddp.py flags

Such a wait (a value read on the host, a tensor made from host data) stops the host from queueing step N + 1 while
the GPU runs step N. On CUDA, torch.cuda.set_sync_debug_mode("warn") reports every synchronizing call. On the CPU
nothing synchronizes, so a TorchDispatchMode stands in: it sees the operators behind those calls, a value read on
the host (aten._local_scalar_dense: .item(), bool(), int()) and a tensor made from host data (aten.lift_fresh:
torch.tensor, torch.as_tensor); the DataLoader's own work is left to its workers (use --workers 1 or more).

Watched: train_one_epoch from each epoch's first log line on (the steps before warm up: cuDNN's autotuning, DDP's
bucket rebuild) to its last step. Allowed there: what a log line itself reads (synced_clock, all_reduce_mean).
Each rank prints every other one with its stack, and exits 1 if it saw any.
"""
import sys
import traceback
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train_ddp.py, gather_utils.py

import guard
import train_ddp

HOST_WAITS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default}
LOG_LINE_READS = {"synced_clock", "all_reduce_mean"}


def between_log_lines():
    """Whether the caller runs in a watched step of train_one_epoch (see above), and not in a log line's reads."""
    names, frame = set(), sys._getframe(1)
    while frame is not None:
        names.add(frame.f_code.co_name)
        if frame.f_code is train_ddp.train_one_epoch.__code__:
            run, args = frame.f_locals["run"], frame.f_locals["args"]
            at_log_line = run.step % args.log_every == 0 and names & LOG_LINE_READS
            return args.log_every <= run.step < run.steps_per_epoch and not at_log_line
        frame = frame.f_back
    return False


class HostWaits(TorchDispatchMode):
    """The CPU's stand-in for CUDA's sync debug mode: notes the operators that would make the host wait."""

    def __init__(self, found):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_WAITS and between_log_lines():
            self.found.append((str(func), traceback.format_stack(limit=12)))
        return func(*args, **(kwargs or {}))


def main():
    found = []
    if torch.cuda.is_available():
        def note(message, category, filename, lineno, file=None, line=None):
            if between_log_lines():
                found.append((str(message), traceback.format_stack(limit=12)))
            elif "synchroniz" not in str(message):
                sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
        warnings.showwarning = note
        warnings.simplefilter("always")  # every occurrence, not the first per line
        torch.cuda.set_sync_debug_mode("warn")
        train_ddp.main()
    else:
        with HostWaits(found):
            train_ddp.main()
    rank = guard.world_from_env()[0]
    for what, stack in found:
        sys.stderr.write(f"check_syncs.py: rank {rank}: the host waits between log lines: {what}\n{''.join(stack)}")
    print(f"check_syncs.py: rank {rank}: {len(found)} host waits between log lines", flush=True)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
