"""Images/s of the input pipelines at 224 px, side by side in one run, on real photographs.

    python benchmarks/bench_data.py                                     # 512 photographs, 5 rounds
    python benchmarks/bench_data.py --write-folder /tmp/photos --images 4096   # an ImageFolder of them, for --data

The photographs are crops at ImageNet's usual size (about 500 x 375) of scikit-learn's two sample
photographs (a test and benchmark dependency only), flipped and shifted at random, saved as JPEG at
quality 90. Without scikit-learn (a GPU machine may have torch and torchvision alone), two pictures
made with torch stand in for them, and the writer says so. Each pipeline is timed per image in this
process, on one thread (so images/s per core), and through a DataLoader (2 workers, batch 64,
collation and the transfer of the batches to this process, after the workers have started), in
rounds that take the pipelines in turn. The table shows each one's median over the rounds and its
ratio to the PIL recipe (and to decoding alone). train_ddp.py's own datasets are imported from it:
its batches are uint8, normalized later on the device (not counted here: on a GPU that is the GPU's
work).
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.io import ImageReadMode, decode_image, read_file
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train_ddp.py, gather_utils.py

import train_ddp

MEAN, STD = train_ddp.IMAGENET_MEAN, train_ddp.IMAGENET_STD


def write_photographs(root, count, val_count=None, seed=0):
    """`count` JPEGs in root/train/<class>/ (2 classes), the first `val_count` (default: all) also in root/val/."""
    rng = random.Random(seed)
    sources = sample_photographs()
    for split in ["train", "val"]:
        for label in range(2):
            (Path(root) / split / f"class{label}").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        photo = sources[i % 2]
        width, height = rng.randint(400, 560), rng.randint(300, 420)
        left, top = rng.randint(0, photo.width - width), rng.randint(0, photo.height - height)
        crop = photo.crop((left, top, left + width, top + height))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        for split in ["train", "val"][: 1 + (val_count is None or i < val_count)]:
            crop.save(Path(root) / split / f"class{i % 2}" / f"{i:05d}.jpg", quality=90)


def sample_photographs():
    """Two 640 x 427 RGB pictures: scikit-learn's sample photographs, else two made here."""
    try:
        from sklearn.datasets import load_sample_images
    except ImportError:
        print("bench_data.py: scikit-learn is not installed: pictures made with torch stand in for its photographs")
        return [made_picture(seed) for seed in (0, 1)]
    return [Image.open(name).convert("RGB") for name in load_sample_images().filenames]


def made_picture(seed, height=427, width=640):
    """Smooth shapes at several scales under fine noise, as a photograph's detail is spread over its scales
    (a JPEG of it decodes at about a photograph's cost): uniform noise upsampled from grids of 8 to 128 px cells."""
    generator = torch.Generator().manual_seed(seed)
    layers = [F.interpolate(torch.rand(1, 3, height // cell + 2, width // cell + 2, generator=generator),
                            size=(height, width), mode="bicubic", align_corners=False) / 2 ** i
              for i, cell in enumerate([128, 32, 8])]
    picture = sum(layers) / 1.75 + 0.05 * torch.randn(1, 3, height, width, generator=generator)
    return v2.functional.to_pil_image((255 * picture[0].clamp(0, 1)).to(torch.uint8))


def pipelines(root):
    """name -> dataset of the same files: each one's __getitem__ is the work of one image."""
    pil = transforms.Normalize(MEAN, STD)
    args = train_ddp.parse_args(["--data", str(root), "--image-size", "224", "--arch", "resnet50"])
    train_set, val_set = train_ddp.build_datasets(args)
    folder = torchvision.datasets.ImageFolder
    return {
        "decode alone (torchvision.io)": folder(root / "train", loader=decode_jpeg),
        "PIL recipe (pytorch/examples)": folder(root / "train", transforms.Compose([
            transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), pil])),
        "tensor backend (torchvision references)": folder(root / "train", v2.Compose([
            v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD)]), loader=decode_jpeg),
        "train_ddp.py training": train_set,
        "PIL validation (pytorch/examples)": folder(root / "val", transforms.Compose([
            transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), pil])),
        "train_ddp.py validation": val_set,
    }  # fmt: skip


def decode_jpeg(path):
    return decode_image(read_file(path), mode=ImageReadMode.RGB)


def per_image(dataset, count):
    began = time.perf_counter()
    for i in range(count):
        dataset[i]
    return count / (time.perf_counter() - began)


def through_loader(loader):
    began, count = time.perf_counter(), 0
    for images, _ in loader:
        count += len(images)
    return count / (time.perf_counter() - began)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=512, help="photographs (default 512)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--write-folder", metavar="DIR", help="only write the ImageFolder of photographs there")
    p.add_argument("--val-images", type=int, help="with --write-folder: photographs also in val/ (default: all)")
    args = p.parse_args()
    if args.write_folder:
        return write_photographs(args.write_folder, args.images, args.val_images)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_photographs(root, args.images)
        datasets = pipelines(root)
        loaders = {
            name: DataLoader(datasets[name], batch_size=64, num_workers=2, persistent_workers=True)
            for name in ["PIL recipe (pytorch/examples)", "tensor backend (torchvision references)",
                         "train_ddp.py training"]
        }  # fmt: skip
        for loader in loaders.values():
            through_loader(loader)  # the workers start, and read every file once
        rates = {name: [] for name in [*datasets, *(f"{name}, DataLoader" for name in loaders)]}
        for _ in range(args.rounds):
            for name, dataset in datasets.items():
                rates[name].append(per_image(dataset, args.images))
            for name, loader in loaders.items():
                rates[f"{name}, DataLoader"].append(through_loader(loader))
    median = {name: statistics.median(r) for name, r in rates.items()}
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, {args.images} photographs, 224 px, "
          f"median of {args.rounds} rounds (each round's in brackets); per image: one thread in this process; "
          "DataLoader: 2 workers, batch 64")
    print("| pipeline | images/s | vs PIL recipe | vs decode alone |")
    print("|---|---|---|---|")
    for name, rate in median.items():
        base = "PIL validation (pytorch/examples)" if "validation" in name else "PIL recipe (pytorch/examples)"
        if name.endswith("DataLoader"):
            base += ", DataLoader"
        runs = ", ".join(f"{r:.0f}" for r in rates[name])
        vs_decode = "-" if name.endswith("DataLoader") else f"{rate / median['decode alone (torchvision.io)']:.2f}"
        print(f"| {name} | {rate:.0f} ({runs}) | {rate / median[base]:.2f} | {vs_decode} |")


if __name__ == "__main__":
    main()
