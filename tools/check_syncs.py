"""Run train_ddp.py, and fail if a training step between two log lines makes the host wait for the device.

    torchrun --standalone --nproc-per-node 2 tools/check_syncs.py --arch resnet18 --workers 2   # any train_ddp.py flags

Such a wait (a value read on the host, a tensor made from host data) stops the host from queueing step N + 1 while
the GPU runs step N. On CUDA, torch.cuda.set_sync_debug_mode("warn") reports every synchronizing call. On the CPU
nothing synchronizes, so this stands in:
- a TorchDispatchMode sees the operators behind those calls: a value read on the host (aten._local_scalar_dense:
  .item(), bool(), int()), a tensor made from host data (aten.lift_fresh: torch.tensor, torch.as_tensor), and the
  operators whose output size depends on the data, which CUDA must read back (nonzero, masked_select, indexing
  with a boolean mask);
- the Tensor methods that copy to the host without an operator on a CPU tensor (.tolist(), .cpu(), .numpy()) are
  wrapped while it watches.
The DataLoader's own work is left to its workers (use --workers 1 or more). Neither device's mode sees what waits
on a CUDA event (DDP's timer does at some iterations).

Watched: train_one_epoch from each epoch's first log line on (the steps before warm up: cuDNN's autotuning, DDP's
bucket rebuild) to its last step. Allowed there: what a log line itself reads (log_step), and
the stop agreement's flags (agreed), a CPU tensor on every device.
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

aten = torch.ops.aten
HOST_WAITS = {aten._local_scalar_dense.default, aten.lift_fresh.default, aten.nonzero.default,
              aten.masked_select.default}
MASKED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}  # a boolean mask makes them wait
HOST_COPIES = ["tolist", "cpu", "numpy"]  # Tensor methods that dispatch no operator on a CPU tensor
LOG_LINE_READS = {"log_step"}


def between_log_lines():
    """Whether the caller runs in a watched step of train_one_epoch (see above), and not in a log line's reads."""
    names, frame = set(), sys._getframe(1)
    while frame is not None:
        names.add(frame.f_code.co_name)
        if frame.f_code is train_ddp.train_one_epoch.__code__:
            run, args = frame.f_locals["run"], frame.f_locals["args"]
            at_log_line = run.step % args.log_every == 0 and names & LOG_LINE_READS
            stop_flags = "agreed" in names  # a CPU tensor on every device: reading it waits for no GPU
            return args.log_every <= run.step < run.steps_per_epoch and not at_log_line and not stop_flags
        frame = frame.f_back
    return False


class HostWaits(TorchDispatchMode):
    """The CPU's stand-in for CUDA's sync debug mode: notes the operators, and the Tensor methods, that would make
    the host wait."""

    def __init__(self, found):
        super().__init__()
        self.found, self.methods = found, {name: getattr(torch.Tensor, name) for name in HOST_COPIES}

    def note(self, what):
        if between_log_lines():
            self.found.append((what, traceback.format_stack(limit=12)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func in MASKED and any(getattr(i, "dtype", None) == torch.bool for i in args[1])
        if func in HOST_WAITS or masked:
            self.note(f"{func}{' with a boolean mask' if masked else ''}")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, self.watched(name, method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def watched(self, name, method):
        def copy_to_host(tensor, *args, **kwargs):
            self.note(f"Tensor.{name}()")
            return method(tensor, *args, **kwargs)
        return copy_to_host


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
