"""Final accuracy on a small real data set, with and without the batch-norm recalibration, side by side.

    python benchmarks/bench_accuracy.py                          # 3 seeds, 10 epochs: about 9 min on 2 cores
    python benchmarks/bench_accuracy.py --seeds 0 1 --epochs 5   # quicker

The data is scikit-learn's handwritten digits (1,797 gray 8 x 8 images of 0..16, shipped with the package: nothing is
downloaded), scaled to 0..255 and enlarged 4x by repeating each pixel (nearest neighbour) to 32 x 32 PNGs in an
ImageFolder in a temporary directory: every fifth image (index % 5 == 0) in val/, the rest in train/ (1,437 / 360).
Each run is train_ddp.py under torchrun on 2 processes, one thread each, one run at a time: ResNet-18, batch 32 per
process, --lr 0.05, --workers 0, the other flags at their defaults (the flip too, as a user who does not know
--no-flip would run it).

The two arms differ only in the batch-norm statistics that validation (and last.pt) uses: "recalibrated" is
train_ddp.py as it is; "running averages" gives every rank rank 0's running averages instead, as validation did before
the recalibration. No flag of train_ddp.py switches it: torchrun starts this file, which replaces
guard.recalibrate_batch_norm for that arm and calls train_ddp.main(). The recalibration draws its augmentation
from a copy of the random stream, so both arms train the same weights: each seed's difference is the statistics alone.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision
from sklearn.datasets import load_digits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train_ddp.py, gather_utils.py

ARMS = ["recalibrated", "running averages"]
RANK_ENTRY = "--as-rank"  # how torchrun starts this file as a training process: --as-rank ARM train_ddp.py's flags
PROCESSES = 2
TRAIN_FLAGS = ["--arch", "resnet18", "--batch-size", "32", "--workers", "0"]


def main():
    args = parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_accuracy_") as tmp:
        data = write_digits(Path(tmp) / "digits")
        results = {}  # (seed, arm) -> the run's metrics
        for seed in args.seeds:
            for arm in ARMS:
                results[seed, arm] = train(arm, seed, data, Path(tmp) / f"{seed}_{arm.replace(' ', '_')}", args)
                print(f"seed {seed} {arm}: val_acc1 {results[seed, arm]['val_acc1']:.2f}% val_loss "
                      f"{results[seed, arm]['val_loss']:.4f} ({results[seed, arm]['seconds']:.0f} s)", flush=True)
    print_table(results, args)
    print(f"wall time {time.perf_counter() - started:.0f} s")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train_ddp.py --seed of each pair of runs")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    return p.parse_args()


def write_digits(root):
    """The digits as an ImageFolder of 32 px gray PNGs: root/{train,val}/<digit>/<index>.png."""
    digits = load_digits()
    for index, (image, label) in enumerate(zip(digits.images, digits.target)):
        folder = root / ("val" if index % 5 == 0 else "train") / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (torch.from_numpy(image) * 255 / 16).round().to(torch.uint8)  # 17 levels, 0..16, to 0..255
        pixels = pixels.repeat_interleave(4, dim=0).repeat_interleave(4, dim=1)  # 8 x 8 to 32 x 32
        torchvision.io.write_png(pixels[None], str(folder / f"{index:04d}.png"))
    return root


def train(arm, seed, data, workdir, args):
    """One torchrun of train_ddp.py; returns its last epoch's metrics, epoch 1's val_loss and its wall time."""
    workdir.mkdir()
    metrics = workdir / "metrics.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(PROCESSES),
               __file__, RANK_ENTRY, arm, "--data", str(data), *TRAIN_FLAGS, "--seed", str(seed),
               "--epochs", str(args.epochs), "--lr", str(args.lr),
               "--checkpoint-dir", str(workdir), "--metrics-file", str(metrics)]
    # One thread per process: the processes share the cores, and more threads would only contend for them.
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // PROCESSES))}
    began = time.perf_counter()
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"bench_accuracy.py: {arm} seed {seed} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {**records[-1], "epoch1_val_loss": records[0]["val_loss"], "seconds": time.perf_counter() - began}


def train_as_rank(arm, argv):
    """A training process, as torchrun starts it: train_ddp.py's main(), with this arm's batch-norm statistics."""
    import guard
    import train_ddp

    if arm == "running averages":
        guard.recalibrate_batch_norm = running_averages
    train_ddp.main(argv)


def running_averages(model, *_):
    """Validation before the recalibration: rank 0's running averages on every rank (DDP broadcasts rank 0's
    buffers before each forward; each rank then updates its own copy from its batch)."""
    for buffer in model.buffers():
        torch.distributed.broadcast(buffer, src=0)


def print_table(results, args):
    seeds = sorted({seed for seed, _ in results})
    print(f"\ndigits (1,437 train / 360 val, 32 px), resnet18, {PROCESSES} ranks x batch 32, --lr {args.lr:g}, "
          f"{args.epochs} epochs: the last epoch's val_acc1 % / val_loss, and (epoch 1's val_loss)")
    rows = [["seed", *ARMS, "difference"]]
    for seed in seeds:
        rows.append([str(seed), *(shown(results[seed, arm]) for arm in ARMS), difference(results, [seed])])
    medians = [{key: statistics.median(results[seed, arm][key] for seed in seeds)
                for key in ["val_acc1", "val_loss", "epoch1_val_loss"]} for arm in ARMS]
    rows.append(["median", *map(shown, medians), difference(results, seeds)])
    for row in rows:
        print("".join(cell.ljust(width) for cell, width in zip(row, [8, 30, 30, 18])).rstrip())


def shown(metrics):
    return f"{metrics['val_acc1']:6.2f} / {metrics['val_loss']:.4f} ({metrics['epoch1_val_loss']:.4g})"


def difference(results, seeds):
    """Recalibrated minus running averages, seed by seed (the same weights), and their median over `seeds`."""
    def median(key):
        return statistics.median(results[seed, ARMS[0]][key] - results[seed, ARMS[1]][key] for seed in seeds)
    return f"{median('val_acc1'):+.2f} / {median('val_loss'):+.4f}"


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == RANK_ENTRY:
        train_as_rank(sys.argv[2], sys.argv[3:])
    else:
        main()
