"""Tests for train_ddp.py and launch.sh: real processes, real gloo process groups, on CPU.

Every run uses a tiny configuration (ResNet-18 at 32 px, a few hundred synthetic images), a
free port, tmp_path for its files, and a hard timeout, so a hang fails fast.
"""
import datetime
import json
import math
import re
import socket
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torchvision

from conftest import FAST, ROOT, LAUNCH, RUN_TIMEOUT, TINY, TRAIN, assert_same_weights, clean_env, descendants, \
    finish, free_port, kill_tree, load, metrics, noise_image, ok, place_in_hub_cache, proc_file, run, start, \
    torchrun, write_images

pytestmark = pytest.mark.timeout(300)  # a backstop: every run below has its own RUN_TIMEOUT


@pytest.mark.timeout(900)
def test_the_demo_learns_over_its_three_epochs(tmp_path):
    # `bash launch.sh 4` as the README shows it. The accuracy rises each epoch, to well above chance (10%) but
    # below 100%, and the training loss falls; no validation loss tops 2 ln 10 = 4.6, twice a uniform guess's
    # (before batch norm's statistics were recomputed for validation, epoch 1 showed 2368 at chance).
    ok(run(["bash", LAUNCH, "4", "--checkpoint-dir", tmp_path, "--metrics-file", tmp_path / "m.jsonl"], timeout=800))
    records = metrics(tmp_path / "m.jsonl")
    accuracy, train_loss = [r["val_acc1"] for r in records], [r["train_loss"] for r in records]
    assert len(records) == 3 and accuracy[0] < accuracy[1] < accuracy[2] and 50 < accuracy[2] < 100, records
    assert train_loss[0] > train_loss[1] > train_loss[2] and all(r["val_loss"] < 2 * math.log(10) for r in records)


@pytest.mark.quick
def test_launch_sh_trains_above_chance(uninterrupted):
    records = uninterrupted.metrics
    assert [r["epoch"] for r in records] == [1, 2]
    assert records[-1]["val_acc1"] > 50, records  # chance is 10% with 10 classes
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert "2 x cpu (gloo)" in uninterrupted.stdout


def test_torchrun_launch(tmp_path):
    result = ok(run(torchrun(2, *TINY, "--train-samples", "64", "--epochs", "1", "--checkpoint-dir", tmp_path)))
    assert "2 x cpu (gloo)" in result.stdout and "epoch 1/1 train_loss" in result.stdout
    assert load(tmp_path / "last.pt")["epoch"] == 1


def test_launch_sh_gives_each_process_the_cpus_it_may_use(tmp_path):
    # taskset, SLURM's ConstrainCores and docker --cpuset-cpus give a process fewer CPUs than the machine has:
    # launch.sh counted the machine's (getconf), and OMP_NUM_THREADS oversubscribed the one CPU allowed here.
    env = clean_env()
    del env["OMP_NUM_THREADS"]
    job = start(["taskset", "-c", "0", "bash", LAUNCH, "1", *TINY, "--train-samples", "64", "--epochs", "1",
                 "--checkpoint-dir", tmp_path], env)
    threads, deadline = None, time.monotonic() + 60
    while threads is None and job.poll() is None and time.monotonic() < deadline:
        for pid in descendants(job.pid):
            command = proc_file(pid, "cmdline")
            if b"train_ddp.py" in command and not (b"--dry-run" in command or b"torch.distributed.run" in command):
                environ = dict(v.split(b"=", 1) for v in proc_file(pid, "environ").split(b"\0") if b"=" in v)
                threads = environ.get(b"OMP_NUM_THREADS")
        time.sleep(0.05)
    ok(finish(job, RUN_TIMEOUT))
    assert threads == b"1", threads


def shift_between(train_image, val_image, max_shift):
    """(dy, dx, mirrored) such that train_image is val_image moved by (dy, dx) and maybe mirrored
    (comparing where both have pixels), or None."""
    height, width = val_image.shape[1:]
    for mirrored in (False, True):
        source = val_image.flip(-1) if mirrored else val_image
        for dy in range(-max_shift, max_shift + 1):
            for dx in range(-max_shift, max_shift + 1):
                moved = source[:, max(dy, 0):height + min(dy, 0), max(dx, 0):width + min(dx, 0)]
                kept = train_image[:, max(-dy, 0):height + min(-dy, 0), max(-dx, 0):width + min(-dx, 0)]
                if torch.equal(moved, kept):
                    return dy, dx, mirrored
    return None


@pytest.mark.parametrize("flip", [True, False], ids=["flip", "no-flip"])
def test_small_images_train_whole_padded_and_cropped(tmp_path, flip):
    import train_ddp

    data = write_images(tmp_path, noise_image(32, 32), ["a", "b"], {"train": 1, "val": 1})
    args = train_ddp.parse_args(["--data", str(data), "--arch", "resnet18", "--image-size", "32",
                                 *([] if flip else ["--no-flip"])])
    train_set, val_set = train_ddp.build_datasets(args)
    val_image = val_set[0][0]
    assert torch.equal(val_image, noise_image(32, 32)(0, 0).permute(2, 0, 1)), "validation must see the image as it is"
    torch.manual_seed(0)
    shifts = [shift_between(train_set[0][0], val_image, max_shift=4) for _ in range(40)]
    assert None not in shifts  # never more than 1/8 of 32 px, never scaled
    assert len({(dy, dx) for dy, dx, _ in shifts}) > 10
    assert any(mirrored for *_, mirrored in shifts) == flip and not all(mirrored for *_, mirrored in shifts)
    names = [type(t).__name__ for t in train_set.transform.transforms]
    assert names == ["Resize", "CenterCrop", "RandomCrop"] + ["RandomHorizontalFlip"] * flip


def test_image_sizes_choose_the_recipe(tmp_path):
    # The transforms build_datasets built: up to 64 px the whole image, padded by 1/8 and cropped back; above,
    # ImageNet's random-resized crop, and a validation resize to 256/224 of the size before the center crop.
    import train_ddp
    from torchvision.transforms import v2

    data = write_images(tmp_path, noise_image(40, 48), ["a", "b"], {"train": 1, "val": 1})
    for size in [32, 64, 65, 96]:
        args = train_ddp.parse_args(["--data", str(data), "--arch", "resnet18", "--image-size", str(size)])
        train_set, val_set = train_ddp.build_datasets(args)
        train, val = train_set.transform.transforms, val_set.transform.transforms
        assert [type(t) for t in val] == [v2.Resize, v2.CenterCrop]
        assert val[0].size == [size if size <= 64 else size * 256 // 224] and val[1].size == (size, size)
        if size <= 64:
            assert [type(t) for t in train] == [v2.Resize, v2.CenterCrop, v2.RandomCrop, v2.RandomHorizontalFlip]
            assert train[2].padding == [size // 8] * 4 and train[2].size == (size, size)
        else:
            assert [type(t) for t in train] == [v2.RandomResizedCrop, v2.RandomHorizontalFlip]
            assert train[0].size == (size, size)
        assert train_set[0][0].shape == val_set[0][0].shape == (3, size, size)  # non-square files, square batches
        assert train_set[0][0].dtype == val_set[0][0].dtype == torch.uint8


def test_image_folder_data(tmp_path):
    # Real small files through the whole path: ImageFolder, the small-image recipe, classes from
    # folders; the two classes differ in stripe direction, which no crop or flip changes.
    def stripes(label, i):
        generator = torch.Generator().manual_seed(i)
        wave = (torch.arange(32) // 2 % 2 * 160).to(torch.uint8)
        pattern = (wave[:, None] if label else wave[None, :]).expand(32, 32)
        return (pattern[..., None] + torch.randint(0, 96, (32, 32, 3), generator=generator, dtype=torch.uint8))

    data = write_images(tmp_path / "data", stripes, ["horizontal", "vertical"], {"train": 64, "val": 8}, ".jpg")
    result = ok(run(torchrun(2, "--data", data, "--arch", "resnet18", "--image-size", "32", "--batch-size", "8",
                             "--epochs", "3", "--workers", "1", "--checkpoint-dir", tmp_path,
                             "--metrics-file", tmp_path / "m.jsonl")))
    assert "32 px, Resize > CenterCrop > RandomCrop > RandomHorizontalFlip" in result.stdout
    records = metrics(tmp_path / "m.jsonl")
    assert records[0]["val_samples"] == 16
    assert records[-1]["val_acc1"] >= 87.5, records  # chance is 50%
    assert load(tmp_path / "last.pt")["model"]["fc.weight"].shape[0] == 2  # one output per class folder


def test_validation_preprocessing_equals_pil_within_one_level(tmp_path):
    # On real photographs at ImageNet's size: torchvision.io and v2 on uint8 against pytorch/examples' PIL path.
    import train_ddp
    from benchmarks.bench_data import write_photographs
    from torchvision import transforms

    write_photographs(tmp_path, 8)
    args = train_ddp.parse_args(["--data", str(tmp_path), "--image-size", "224"])
    _, val_set = train_ddp.build_datasets(args)
    pil = torchvision.datasets.ImageFolder(tmp_path / "val", transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.PILToTensor()]))
    for i in range(len(val_set)):
        ours, theirs = val_set[i][0], pil[i][0]
        assert ours.dtype == theirs.dtype == torch.uint8 and ours.shape == theirs.shape == (3, 224, 224)
        assert (ours.int() - theirs.int()).abs().max() <= 1, i


def test_uint8_batches_reach_the_model_as_normalized_float():
    import train_ddp

    batch, labels = torch.randint(0, 256, (2, 3, 5, 4), dtype=torch.uint8), torch.tensor([3, 1])
    for channels_last in (False, True):
        args = train_ddp.parse_args(["--arch", "resnet18", *(["--channels-last"] * channels_last)])
        images, out_labels = train_ddp.ModelInput(args, torch.device("cpu"))(batch, labels)
        mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
        want = (batch.float() / 255 - mean[:, None, None]) / std[:, None, None]
        assert images.dtype == torch.float32 and torch.allclose(images, want, atol=1e-6)
        assert images.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        assert torch.equal(out_labels, labels)
    synthetic, _ = train_ddp.build_datasets(train_ddp.parse_args([]))
    assert synthetic[0][0].dtype == torch.uint8 and synthetic[0][0].shape == (3, 32, 32)


CHECK_SYNCS = ["--arch", "resnet18", "--train-samples", "192", "--val-samples", "16", "--batch-size", "8",
               "--log-every", "4", "--workers", "1"]


EVERYTHING = ["--accum-steps", "2", "--amp", "bf16", "--channels-last", "--comm-hook", "powersgd", "--warmup-epochs",
              "0"]


@pytest.mark.parametrize("extra", [pytest.param([], marks=pytest.mark.quick), EVERYTHING], ids=["plain", "everything"])
def test_no_host_waits_between_log_lines(tmp_path, extra):
    # check_syncs.py runs train_ddp.py under a TorchDispatchMode that sees every operator which on a GPU would make
    # the host wait (a value read on the host, a tensor made from host data) between two log lines: there must be none
    # (before the device kept the normalization's constants, torchvision made 2 tensors from lists per batch).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tools" / "check_syncs.py"), *CHECK_SYNCS, *extra, "--epochs", "2", "--checkpoint-dir", tmp_path]
    result = ok(run(cmd))
    for rank in range(2):
        assert f"check_syncs.py: rank {rank}: 0 host waits between log lines" in result.stdout, result.stdout


# What a step may do that makes a GPU's host wait, planted after each step: (the new line, what check_syncs names).
PLANTED_WAITS = {
    "item": ("loss_sum += step_loss.item()", "aten._local_scalar_dense"),
    "tolist": ("loss_sum += step_loss.tolist()", "Tensor.tolist()"),
    "cpu": ("loss_sum += step_loss.cpu()", "Tensor.cpu()"),
    "mask": ("loss_sum += step_loss + labels[labels > 0].sum()", "aten.index.Tensor with a boolean mask"),
}


@pytest.mark.parametrize("plant", PLANTED_WAITS)
def test_check_syncs_finds_a_host_wait_in_a_step(tmp_path, plant):
    # The same check on a copy of train_ddp.py that makes the host wait after every step: it must name the wait.
    line, named = PLANTED_WAITS[plant]
    source = (ROOT / "train_ddp.py").read_text()
    planted = source.replace("        loss_sum += step_loss\n", f"        {line}\n")
    assert planted != source
    (tmp_path / "tools").mkdir()
    for name, text in [("train_ddp.py", planted), ("guard.py", None), ("gather_utils.py", None),
                       ("tools/check_syncs.py", None)]:
        (tmp_path / name).write_text(text or (ROOT / name).read_text())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(tmp_path / "tools" / "check_syncs.py"), *CHECK_SYNCS, "--epochs", "1", "--checkpoint-dir", tmp_path]
    result = run(cmd, cwd=tmp_path)
    assert result.returncode != 0
    # 12 steps, a log line every 4: watched from the first log line's step to the last step, the waits after
    # steps 4 to 11 (the log lines' own reads are in log_step).
    assert "check_syncs.py: rank 0: 8 host waits between log lines" in result.stdout, result.stdout
    assert f"the host waits between log lines: {named}" in result.stderr and line in result.stderr, result.stderr


def test_metrics_file_has_every_field(uninterrupted):
    for record in uninterrupted.metrics:
        for key in ["epoch", "train_loss", "data_wait", "val_loss", "val_acc1", "val_acc5", "val_samples",
                    "images_per_sec", "epoch_seconds"]:
            assert isinstance(record[key], (int, float)), (key, record)
        assert record["val_samples"] == 50 and 0 <= record["data_wait"] < 1
        assert 0 <= record["val_acc1"] <= record["val_acc5"] <= 100


def test_log_shows_step_loss_throughput_and_eta(uninterrupted):
    lines = [line for line in uninterrupted.stdout.splitlines() if " step " in line]
    assert lines and all(re.search(r" loss \S+ lr \S+ .* img/s data \d+% eta ", line) for line in lines), lines
    assert any("img/s" in line and "eta 0:" in line for line in lines)
    # Rank 0 logs alone: 2 epochs of 16 steps, a line every 4, once each.
    assert len(lines) == 8 and len(set(lines)) == 8, lines


EACH_RANK_SAVES = """
import os, sys, torch
sys.path.insert(0, {root!r})
import train_ddp
save_checkpoint = train_ddp.save_checkpoint
def and_each_ranks_weights(run, args):
    save_checkpoint(run, args)
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    torch.save(run.model_without_ddp.state_dict(), os.path.join(args.checkpoint_dir, f"rank{{os.environ['RANK']}}.pt"))
train_ddp.save_checkpoint = and_each_ranks_weights
train_ddp.main(sys.argv[1:])
"""


def torchrun_each_rank_saves(nproc, *args):
    """torchrun of train_ddp.py that also saves each rank's own weights at each checkpoint, in --checkpoint-dir as
    rank<R>.pt: what DDP keeps equal on every rank."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--no-python", sys.executable, "-c", EACH_RANK_SAVES.format(root=str(ROOT)), *map(str, args)]


def test_parameters_identical_on_every_rank(tmp_path):
    ok(run(torchrun_each_rank_saves(2, *TINY, "--epochs", "1", "--train-samples", "128", "--checkpoint-dir",
                                    tmp_path)))
    assert_same_weights(load(tmp_path / "rank0.pt"), load(tmp_path / "rank1.pt"))
    assert_same_weights(load(tmp_path / "rank0.pt"), load(tmp_path / "last.pt")["model"])


def test_checkpoint_loads_with_weights_only(uninterrupted):
    out = uninterrupted.folder
    checkpoint = load(out / "last.pt")
    assert {"model", "optimizer", "scaler", "epoch", "samples", "step", "args", "rng"} <= checkpoint.keys()
    assert "scheduler" not in checkpoint  # the lr is a function of the images trained: nothing to load
    assert not any(k.startswith("module.") for k in checkpoint["model"])
    assert (checkpoint["epoch"], checkpoint["samples"], checkpoint["step"]) == (2, 0, 0)
    assert type(checkpoint["args"]) is dict and checkpoint["args"]["arch"] == "resnet18"
    assert len(checkpoint["rng"]) == 2 and checkpoint["optimizer"]["state"]
    assert not list(out.glob("*.tmp"))


def test_plain_python_runs_as_one_process(tmp_path):
    result = ok(run([sys.executable, TRAIN, *TINY, "--epochs", "1", "--checkpoint-dir", tmp_path,
                     "--metrics-file", tmp_path / "m.jsonl"]))
    assert "1 x cpu (gloo)" in result.stdout and metrics(tmp_path / "m.jsonl")[0]["epoch"] == 1


@pytest.mark.quick
def test_one_process_without_a_launcher_takes_the_collective_timeout(monkeypatch):
    # Its process group is made from a store in memory, and returned before --collective-timeout was set: it kept
    # torch's default (30 min), where a GPU hang would sit.
    import train_ddp

    for name in ["WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID"]:
        monkeypatch.delenv(name, raising=False)
    args = train_ddp.parse_args(["--arch", "resnet18", "--collective-timeout", "7"])
    train_ddp.init_distributed(args, torch.device("cpu"))
    try:
        timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    finally:
        dist.destroy_process_group()
    assert timeout == datetime.timedelta(seconds=7)


@pytest.mark.quick
def test_local_rank_comes_from_the_flag_else_the_launchers(monkeypatch):
    # The legacy launcher passes --local-rank (or --local_rank) and sets LOCAL_RANK too: the flag alone must do.
    import train_ddp

    for name in ["LOCAL_RANK", "SLURM_LOCALID"]:
        monkeypatch.delenv(name, raising=False)
    assert train_ddp.parse_args(["--local-rank", "1"]).local_rank == 1
    assert train_ddp.parse_args(["--local_rank=3"]).local_rank == 3
    assert train_ddp.parse_args([]).local_rank == 0
    monkeypatch.setenv("SLURM_LOCALID", "5")
    assert train_ddp.parse_args([]).local_rank == 5
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert train_ddp.parse_args([]).local_rank == 2


def test_legacy_launcher_passes_local_rank(tmp_path):
    # torch.distributed.launch passes --local-rank=N on the command line (torch >= 2.0).
    cmd = [sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node", "2", "--master-port", str(free_port()),
           TRAIN, *TINY, "--epochs", "1", "--checkpoint-dir", tmp_path, "--metrics-file", tmp_path / "m.jsonl"]
    result = ok(run(list(map(str, cmd))))
    assert "2 x cpu (gloo)" in result.stdout
    assert metrics(tmp_path / "m.jsonl")[0]["val_samples"] == 50


@pytest.mark.quick
def test_distributed_validation_equals_single_process(tmp_path):
    # 50 val images on 3 ranks: DistributedSampler pads to 51; the duplicate must not count.
    ok(run(torchrun(3, *TINY, "--epochs", "1", "--checkpoint-dir", tmp_path, "--metrics-file", tmp_path / "m.jsonl")))
    distributed = metrics(tmp_path / "m.jsonl")[0]
    ok(run([sys.executable, TRAIN, *TINY, "--evaluate", "--resume", str(tmp_path / "last.pt"),
            "--batch-size", "7", "--metrics-file", str(tmp_path / "single.jsonl")]))
    single = metrics(tmp_path / "single.jsonl")[0]
    assert distributed["val_samples"] == single["val_samples"] == 50
    assert distributed["val_acc1"] == single["val_acc1"] and distributed["val_acc5"] == single["val_acc5"]
    assert distributed["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    assert single["epoch"] == 1


@pytest.mark.quick
def test_resume_equals_uninterrupted(uninterrupted, tmp_path):
    proc = start(torchrun(2, *FAST, "--checkpoint-dir", tmp_path))
    began = time.monotonic()
    while not (tmp_path / "last.pt").exists():  # the end of epoch 1
        assert proc.poll() is None and time.monotonic() - began < RUN_TIMEOUT, "no checkpoint appeared"
        time.sleep(0.05)
    kill_tree(proc)
    proc.communicate()
    assert load(tmp_path / "last.pt")["epoch"] == 1
    result = ok(run(torchrun(2, *FAST, "--checkpoint-dir", tmp_path, "--resume", tmp_path / "last.pt",
                             "--metrics-file", tmp_path / "resumed.jsonl")))
    # What only a resume does (a fresh start would end with the same weights: CPU training is deterministic):
    # it says so, and trains the second epoch alone.
    assert f"resumed from {tmp_path / 'last.pt'} at epoch 2 step 0" in result.stdout
    assert "epoch 1/2" not in result.stdout and [r["epoch"] for r in metrics(tmp_path / "resumed.jsonl")] == [2]
    assert_same_weights(load(tmp_path / "last.pt")["model"], uninterrupted.weights)


def test_resume_on_one_rank_keeps_the_schedule(tmp_path):
    # 2 ranks take 32 steps per epoch, 1 rank 64: resumed after epoch 1 of 2, the schedule must
    # go on from step 64 of 128 and end at lr 0, not from the 32 steps the checkpoint counted.
    ok(run(torchrun(2, *TINY, "--epochs", "1", "--checkpoint-dir", tmp_path / "two")))
    result = ok(run([sys.executable, TRAIN, *TINY, "--resume", str(tmp_path / "two" / "last.pt"),
                     "--checkpoint-dir", str(tmp_path / "one")]))
    assert "at epoch 2 step 0" in result.stdout
    # The schedule is placed by the images trained, not saved: the lr of the 4th step after the resume is that of
    # step 68 of 128 (cosine after 64 warm-up steps), and the last step's is 1 / 64 of a half period short of 0.
    assert re.search(r"step 4/64 \(68/128\) loss \S+ lr 0.01989 ", result.stdout), result.stdout
    assert re.search(r"step 64/64 \(128/128\) loss \S+ lr 1.205e-05 ", result.stdout), result.stdout


def test_resume_trains_with_this_runs_optimizer_settings(tmp_path):
    # A resume's optimizer state carries the old run's lr, momentum and weight decay: the new flags win, and the
    # resume line says which changed.
    tiny = [*TINY, "--train-samples", "64", "--checkpoint-dir", tmp_path]
    ok(run([sys.executable, TRAIN, *tiny, "--epochs", "1"]))
    result = ok(run([sys.executable, TRAIN, *tiny, "--resume", tmp_path / "last.pt", "--lr", "0.04",
                     "--momentum", "0.5", "--weight-decay", "0"]))
    assert "at epoch 2 step 0; with --lr 0.04 (was 0.02), --momentum 0.5 (was 0.9), --weight-decay 0 (was 0.0001)" \
        in result.stdout, result.stdout
    # 8 warm-up steps of 16, then cosine from the new peak: step 12 of 16 is 3/8 of the way down.
    assert re.search(r"step 4/8 \(12/16\) loss \S+ lr 0.02765 ", result.stdout), result.stdout
    group = load(tmp_path / "last.pt")["optimizer"]["param_groups"][0]
    assert (group["momentum"], group["weight_decay"]) == (0.5, 0.0)


def test_a_resume_takes_this_runs_fused_flag_and_momentum_layout(tmp_path):
    # A checkpoint written on GPUs holds fused SGD's flag, which load_state_dict brings back: on the
    # CPU that ran the fused kernel beside momentum in the old layout (computing wrongly after a switch
    # to --channels-last). The resume trains as this run's optimizer would: as one from a checkpoint
    # without the flag, bit for bit, and saves this run's settings.
    tiny = [*TINY, "--train-samples", "64"]
    ok(run([sys.executable, TRAIN, *tiny, "--epochs", "1", "--checkpoint-dir", tmp_path / "first"]))
    saved = load(tmp_path / "first" / "last.pt")
    for group in saved["optimizer"]["param_groups"]:
        group["fused"] = True
    torch.save(saved, tmp_path / "from_gpu.pt")

    def resumed(path, out):
        ok(run([sys.executable, TRAIN, *tiny, "--channels-last", "--resume", path, "--checkpoint-dir", out]))
        return load(out / "last.pt")

    plain = resumed(tmp_path / "first" / "last.pt", tmp_path / "plain")
    from_gpu = resumed(tmp_path / "from_gpu.pt", tmp_path / "gpu")
    assert [group["fused"] for group in from_gpu["optimizer"]["param_groups"]] == [False]
    assert_same_weights(plain["model"], from_gpu["model"])


@pytest.mark.quick
def test_build_optimizer_starts_momentum_at_zero():
    # torch's fused SGD leaves garbage momentum after a first step that the GradScaler skips (fp16's
    # first steps overflow by design); zeros from the start leave nothing for it to make.
    import train_ddp
    args = train_ddp.parse_args(["--arch", "resnet18"])
    optimizer, _ = train_ddp.build_optimizer(torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last), args)
    buffers = [optimizer.state[p]["momentum_buffer"] for p in optimizer.param_groups[0]["params"]]
    assert len(buffers) == 2 and not any(b.any() for b in buffers)
    assert buffers[0].is_contiguous(memory_format=torch.channels_last)


def test_fp16_hook_casts_before_it_divides():
    # docs/training.md: a gradient above fp16's range becomes inf under --comm-hook fp16 (torch's hook casts, then
    # divides by the world size), and stays finite under bf16. One process, train_ddp.py's own hook registration.
    code = """if True:
        import types, torch, torch.distributed as dist, train_ddp
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        for hook in ["fp16", "bf16"]:
            model = train_ddp.DDP(torch.nn.Linear(1, 1, bias=False))
            train_ddp.register_comm_hook(model, types.SimpleNamespace(comm_hook=hook), run=None)
            model(torch.full((1, 1), 1e5)).sum().backward()
            print(hook, model.module.weight.grad.item())
        dist.destroy_process_group()"""
    result = ok(run([sys.executable, "-c", code]))
    assert result.stdout.split() == ["fp16", "inf", "bf16", "99840.0"], result.stdout


def test_clean_env_drops_what_launchers_set():
    # conftest.clean_env run inside a real torchrun worker: nothing torchrun set may reach the tests' processes.
    code = """if True:
        import os, conftest
        added = set(os.environ) - set(os.environ["PARENT_VARIABLES"].split(","))
        assert "TORCHELASTIC_RESTART_COUNT" in added and "LOCAL_WORLD_SIZE" in added, sorted(added)
        print(sorted(added & set(conftest.clean_env()) - {"OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"}))"""
    env = clean_env()
    env["PARENT_VARIABLES"] = ",".join([*env, "PARENT_VARIABLES"])
    result = ok(run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                     "--no-python", sys.executable, "-c", code], env=env, cwd=ROOT / "tests"))
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize("hook, extra", [
    ("fp16", []),
    ("bf16", ["--amp", "bf16", "--channels-last"]),
    ("powersgd", ["--accum-steps", "2", "--warmup-epochs", "0"]),
])
def test_comm_hook_trains(tmp_path, hook, extra, uninterrupted):
    with_hook, without = tmp_path / "hook", uninterrupted.folder  # the run without a hook, where nothing is extra
    result = ok(run(torchrun_each_rank_saves(2, *FAST, "--comm-hook", hook, *extra, "--checkpoint-dir", with_hook,
                                             "--metrics-file", tmp_path / "hook.jsonl")))
    if extra:
        without = tmp_path / "none"
        ok(run(torchrun(2, *FAST, *extra, "--checkpoint-dir", without, "--metrics-file", without / "m.jsonl")))
    records, plain = metrics(tmp_path / "hook.jsonl"), metrics(without / "m.jsonl")
    # The loss falls; with the casting hooks, which only round the gradients, to within 0.25 of the plain
    # all-reduce's (0.16 measured). PowerSGD's rank-1 gradients learn these noisy images more slowly.
    assert records[-1]["train_loss"] < records[0]["train_loss"], records
    if hook != "powersgd":
        assert abs(records[-1]["train_loss"] - plain[-1]["train_loss"]) < 0.25, (records, plain)
    assert_same_weights(load(with_hook / "rank0.pt"), load(with_hook / "rank1.pt"))
    assert "nan" not in result.stdout
    # CPU training is deterministic: only a hook that really changed the gradients changes the weights.
    a, b = load(with_hook / "last.pt")["model"], load(without / "last.pt")["model"]
    assert any(not torch.equal(a[key], b[key]) for key in a)


def test_a_resume_past_the_warm_up_goes_on_compressing_with_powersgd(tmp_path):
    # A new PowerSGDState counts from 0: every resume went back to plain all-reduce for the warm-up's steps (an
    # epoch by default). Resumed after the warm-up, it compresses from the third step (DDP rebuilds its buckets
    # after the first), so its weights differ from a resume with no hook; in one process too, where the
    # compression is the only difference.
    args = [sys.executable, TRAIN, "--arch", "resnet18", "--train-samples", "128",
            "--val-samples", "16", "--batch-size", "16", "--warmup-epochs", "1"]
    ok(run([*args, "--epochs", "1", "--comm-hook", "powersgd", "--checkpoint-dir", tmp_path / "first"]))
    for hook in "powersgd", "none":
        ok(run([*args, "--epochs", "2", "--comm-hook", hook, "--resume", tmp_path / "first" / "last.pt",
                "--checkpoint-dir", tmp_path / hook]))
    compressed, plain = (load(tmp_path / hook / "last.pt")["model"]
                         for hook in ("powersgd", "none"))
    assert all(tensor.isfinite().all() for tensor in compressed.values())
    assert any(not torch.equal(compressed[key], plain[key]) for key in compressed)


def assert_scaler_ran_from_its_defaults(scaler, steps):
    """From 2**16, each step whose fp16 gradients overflow halves the scale and is skipped; each other one counts
    up `_growth_tracker` (2000 in a row double the scale), which a skip sets back to 0. Which steps overflow
    depends on the CPU's fp16 kernels: the test asks only that the scaler took every step from its defaults."""
    skipped = math.log2(2.0 ** 16 / scaler["scale"])
    assert skipped == int(skipped) and 1 <= skipped + scaler["_growth_tracker"] <= steps, scaler


def test_amp_fp16_runs_with_grad_scaler(tmp_path):
    # fp16 autocast is slow on CPU: 4 steps only, to check that the GradScaler really runs.
    ok(run(torchrun(2, "--arch", "resnet18", "--train-samples", "64", "--val-samples", "10", "--batch-size", "8",
                    "--epochs", "1", "--amp", "fp16", "--checkpoint-dir", tmp_path)))
    assert_scaler_ran_from_its_defaults(load(tmp_path / "last.pt")["scaler"], steps=4)


def test_resume_with_amp_fp16_from_a_checkpoint_without_it(tmp_path):
    # A checkpoint written without --amp fp16 holds an empty scaler state: the resumed run's
    # GradScaler must start from its defaults instead of failing to load it.
    tiny = ["--arch", "resnet18", "--train-samples", "32", "--val-samples", "4", "--batch-size", "8"]
    ok(run([sys.executable, TRAIN, *tiny, "--epochs", "1", "--checkpoint-dir", str(tmp_path)]))
    assert load(tmp_path / "last.pt")["scaler"] == {}
    result = ok(run([sys.executable, TRAIN, *tiny, "--epochs", "2", "--amp", "fp16", "--checkpoint-dir", str(tmp_path),
                     "--resume", str(tmp_path / "last.pt")]))
    assert "resumed from" in result.stdout and "epoch 2/2 train_loss" in result.stdout
    assert_scaler_ran_from_its_defaults(load(tmp_path / "last.pt")["scaler"], steps=4)  # epoch 2's


# ---------------------------------------------------------------- --weights and --compile
class ConnectionCounter:
    """A proxy that answers nothing: https_proxy pointed here makes every download fail at once, and counts them."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.connections = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            connection, _ = self.server.accept()
            self.connections += 1
            connection.close()

    def env(self, **extra):
        return clean_env(https_proxy=f"http://127.0.0.1:{self.server.getsockname()[1]}", **extra)


def test_weights_by_name_load_from_the_hub_cache_and_get_a_new_classifier(tmp_path):
    # IMAGENET1K_V1 with 10 synthetic classes, no network (a download would fail through the proxy): every layer
    # but the classifier holds the placed weights (--lr 0 keeps them), and the start line says fc is new.
    placed = place_in_hub_cache(tmp_path / "torch", "resnet18", torchvision.models.ResNet18_Weights.IMAGENET1K_V1)
    proxy = ConnectionCounter()
    result = ok(run(torchrun(2, *TINY, "--epochs", "1", "--train-samples", "32", "--lr", "0", "--weight-decay", "0",
                             "--image-size", "32", "--weights", "IMAGENET1K_V1", "--checkpoint-dir", tmp_path),
                    env=proxy.env(TORCH_HOME=tmp_path / "torch")))
    assert "resnet18 from IMAGENET1K_V1 (new fc) on 2 x cpu (gloo)" in result.stdout, result.stdout
    assert proxy.connections == 0
    trained = load(tmp_path / "last.pt")["model"]
    assert trained["fc.weight"].shape == (10, 512)
    for key in ["conv1.weight", "layer4.1.conv2.weight", "layer2.0.downsample.0.weight"]:
        assert torch.equal(trained[key], placed[key]), key


def test_weights_by_name_set_the_validation_recipe_unless_image_size_is_given(tmp_path, monkeypatch):
    import train_ddp

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # the weights there, as if downloaded
    place_in_hub_cache(tmp_path, "resnet50", torchvision.models.ResNet50_Weights.IMAGENET1K_V2)
    place_in_hub_cache(tmp_path, "efficientnet_b3", torchvision.models.EfficientNet_B3_Weights.DEFAULT)
    args = train_ddp.parse_args(["--arch", "resnet50", "--weights", "IMAGENET1K_V2"])
    assert (args.image_size, args.resize, args.interpolation) == (224, 232, "bilinear")
    args = train_ddp.parse_args(["--arch", "efficientnet_b3", "--weights", "EfficientNet_B3_Weights.DEFAULT"])
    assert (args.image_size, args.resize, args.interpolation) == (300, 320, "bicubic")
    args = train_ddp.parse_args(["--arch", "resnet50", "--weights", "DEFAULT", "--image-size", "32"])
    assert (args.image_size, args.resize, args.interpolation) == (32, 36, "bilinear")


@pytest.mark.parametrize("arch", ["resnet18", "regnet_y_400mf"])  # a regnet computes as it builds: no meta check
def test_weights_download_once_per_machine_and_say_how_to_work_offline(tmp_path, arch):
    # Nothing in the hub cache, and no network: launch.sh's dry run tries to download, once for the machine, before
    # any rank starts, and its one line names the URL and where to put the file.
    proxy = ConnectionCounter()
    url = torchvision.models.get_model_weights(arch).IMAGENET1K_V1.url
    result = run(["bash", LAUNCH, "2", *TINY, "--arch", arch, "--weights", "IMAGENET1K_V1", "--checkpoint-dir",
                  tmp_path], env=proxy.env(TORCH_HOME=tmp_path / "torch"))
    assert result.returncode == 2 and proxy.connections == 1, (proxy.connections, result.stderr[-3000:])
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"train_ddp.py: error: --weights IMAGENET1K_V1: could not download {url} ("), line
    assert line.endswith(f"without a network, place that file at {tmp_path / 'torch' / 'hub' / 'checkpoints'}/"
                         f"{url.rpartition('/')[2]}, or pass --weights PATH to a state dict"), line


def test_fine_tuning_from_weights_that_know_the_data_beats_training_from_scratch(tmp_path):
    # Stripes of four directions and widths; a model trained on them, then fine-tuned from its last.pt on two of
    # those classes (a new classifier) against the same run from scratch: after one short epoch (2 steps), the one
    # that already knows the stripes is far ahead. Horizontal against vertical is easy enough that scratch may reach
    # 90% too, so the margin is in the validation loss: measured 0.018 against 0.29, and on another CPU, whose
    # kernels round differently, 0.079 against 0.34.
    def stripes(label, i):
        wave = (torch.arange(32) // (2 + label // 2 * 2) % 2 * 160).to(torch.uint8)
        pattern = (wave[:, None] if label % 2 else wave[None, :]).expand(32, 32)
        noise = torch.randint(0, 96, (32, 32, 3), generator=torch.Generator().manual_seed(i), dtype=torch.uint8)
        return pattern[..., None] + noise

    four = write_images(tmp_path / "four", stripes, ["h2", "v2", "h4", "v4"], {"train": 32, "val": 4})
    two = write_images(tmp_path / "two", lambda label, i: stripes(label + 2, i + 1000), ["h4", "v4"],
                       {"train": 16, "val": 16})
    common = ["--arch", "resnet18", "--image-size", "32", "--batch-size", "8", "--lr", "0.02"]
    ok(run(torchrun(2, *common, "--data", four, "--epochs", "3", "--checkpoint-dir", tmp_path / "pre")))
    results, logs = {}, {}
    for begin in ["weights", "scratch"]:
        weights = ["--weights", tmp_path / "pre" / "last.pt"] if begin == "weights" else []
        logs[begin] = ok(run(torchrun(2, *common, "--data", two, "--epochs", "1", "--warmup-epochs", "0", *weights,
                                      "--checkpoint-dir", tmp_path / begin,
                                      "--metrics-file", tmp_path / f"{begin}.jsonl"))).stdout
        results[begin] = metrics(tmp_path / f"{begin}.jsonl")[0]
    assert f"resnet18 from {tmp_path / 'pre' / 'last.pt'} (new fc) on 2 x cpu" in logs["weights"], logs["weights"]
    assert results["weights"]["val_acc1"] >= max(90, results["scratch"]["val_acc1"]), results
    assert results["weights"]["val_loss"] < results["scratch"]["val_loss"] / 2, results


# inductor on the CPU (the machine's gcc), 2 ranks, with accumulation, bf16 autocast and PowerSGD all on
COMPILED = ["--arch", "resnet18", "--train-samples", "128", "--val-samples", "16", "--batch-size", "8", "--lr", "0.002",
            "--log-every", "1", "--accum-steps", "2", "--amp", "bf16", "--comm-hook", "powersgd", "--warmup-epochs",
            "0"]


# Run under torchrun as train_ddp.py is, noting the group's collective timeout at each optimizer step and
# validation, and, once main() returns, the DDP models and gloo threads left.
AFTER_MAIN = f"""
import gc, json, os, sys
sys.path.insert(0, {str(ROOT)!r})
import torch, torch.distributed as dist, train_ddp
from torch.optim.optimizer import register_optimizer_step_pre_hook
timeouts = []
def note(what):
    timeouts.append([what, dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.seconds])
register_optimizer_step_pre_hook(lambda *_: note("step"))
validate = train_ddp.validate
train_ddp.validate = lambda *args: note("validation") or validate(*args)
train_ddp.main(sys.argv[1:])
models = [o for o in gc.get_objects() if isinstance(o, train_ddp.DDP)]
threads = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
with open(os.environ["LEFT"] + os.environ["RANK"], "w") as f:
    json.dump({{"models": len(models), "group_threads": threads.count("pt_gloo_runloop"), "timeouts": timeouts}}, f)
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """COMPILED's runs: eager; compiled, --collective-timeout 30 (4 steps); compiled, resuming the eager run's
    last.pt for an epoch of 1 step; compiled, --collective-timeout 3600 (1 step); the eager model validating
    the compiled run's last.pt. Each compiled run's stdout, and what AFTER_MAIN noted on each rank."""
    out = tmp_path_factory.mktemp("compiled")
    script = out / "after_main.py"
    script.write_text(AFTER_MAIN)
    runs = {"eager": ["--epochs", "1"],
            "compiled": ["--compile", "--epochs", "1", "--collective-timeout", "30"],
            "resumed": ["--compile", "--epochs", "2", "--collective-timeout", "30", "--train-samples", "32",
                        "--resume", out / "eager" / "last.pt"],
            "patient": ["--compile", "--epochs", "1", "--collective-timeout", "3600", "--train-samples", "32"],
            "evaluated": ["--evaluate", "--resume", out / "compiled" / "last.pt"]}
    results = {}
    for name, flags in runs.items():
        directory = out / ("eager" if name == "resumed" else name)
        stdout = ok(run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         script, *COMPILED, *map(str, flags), "--checkpoint-dir", directory],
                        env=clean_env(LEFT=out / f"{name}_left"), timeout=300)).stdout
        left = [json.loads((out / f"{name}_left{rank}").read_text()) for rank in range(2)]
        results[name] = stdout, left
    return out, results


@pytest.mark.timeout(900)  # the first to ask for `compiled` waits for its runs
@pytest.mark.xdist_group("compiled")  # both tests on one worker, which makes the runs once
def test_compile_trains_as_eager_and_checkpoints_go_both_ways(compiled):
    # Each step's loss within 3% of the eager run's: inductor's fused bf16 kernels round otherwise (0.02% apart
    # before the first update, measured), and each update carries that on: 1.9% apart at most over the 4 steps at
    # this learning rate, 4.5% at 0.02. And each run's checkpoint loads in the other mode: the compiled run resumes
    # the eager one's, and the eager model validates the compiled one's.
    out, results = compiled
    losses = {mode: [float(loss) for loss in re.findall(r" loss (\S+) lr ", results[mode][0])]
              for mode in ["eager", "compiled"]}
    assert "compiled (the first step compiles" in results["compiled"][0]
    assert len(losses["eager"]) == len(losses["compiled"]) == 4, losses
    for eager, compiled_loss in zip(losses["eager"], losses["compiled"]):
        assert abs(compiled_loss - eager) <= 0.03 * eager, losses
    assert load(out / "compiled" / "last.pt")["model"].keys() == load(out / "eager" / "last.pt")["model"].keys()
    assert f"resumed from {out / 'eager' / 'last.pt'} at epoch 2 step 0" in results["resumed"][0]
    assert load(out / "eager" / "last.pt")["epoch"] == 2
    assert json.loads(results["evaluated"][0].splitlines()[-1])["val_samples"] > 0, results["evaluated"][0]


@pytest.mark.timeout(900)
@pytest.mark.xdist_group("compiled")
def test_a_compiled_run_waits_for_every_compile_and_frees_its_group_before_python_exits(compiled):
    # Each rank compiles in its first two steps, minutes apart where their compile caches differ (karpathy/nanochat
    # #722): the group's timeout shows those two steps waiting the longer of COMPILE_TIMEOUT and
    # --collective-timeout, and all else --collective-timeout, also after an epoch of one step (where only the
    # epoch's end can reset it). (On this VM two ranks compiling side by side finished within 2 s of each other:
    # the skew itself is not reproduced here.)
    # A compiled model can leave reference cycles that hold the DDP model and the group past destroy_process_group.
    # Freed at Python's exit, a gloo work thread, releasing a tensor, waits for the GIL of an interpreter that is
    # finalizing, and aborts the process ("terminate called without an active exception"). Once main() returns,
    # neither may be left.
    import train_ddp

    long = train_ddp.COMPILE_TIMEOUT
    expected = {
        "compiled": [["step", long]] * 2 + [["step", 30]] * 2 + [["validation", 30]],
        "resumed": [["step", long], ["validation", 30]],
        "patient": [["step", 3600], ["validation", 3600]],
    }
    _, results = compiled
    for name, timeouts in expected.items():
        for rank in range(2):
            assert results[name][1][rank] == {"models": 0, "group_threads": 0, "timeouts": timeouts}, (name, rank)


def test_every_rank_exits_after_train_resume_and_evaluate(tmp_path):
    # Before torch 2.14 a rank could hang at exit, after its work was done (process_group in
    # train_ddp.py): each run must end, on every rank, well within its timeout. .ci/older_torch.sh
    # repeats this test on older torch, where the hang was seen in 1 run of 5.
    tiny = ["--arch", "resnet18", "--train-samples", "64", "--val-samples", "16", "--batch-size", "8",
            "--checkpoint-dir", tmp_path]
    ok(run(["bash", LAUNCH, "2", *tiny, "--epochs", "1"], timeout=60))
    resumed = ok(run(["bash", LAUNCH, "2", *tiny, "--epochs", "2", "--resume", tmp_path / "last.pt"], timeout=60))
    assert "at epoch 2 step 0" in resumed.stdout and "epoch 2/2 train_loss" in resumed.stdout
    evaluated = ok(run(["bash", LAUNCH, "2", *tiny, "--evaluate", "--resume", tmp_path / "last.pt"], timeout=60))
    assert json.loads(evaluated.stdout.splitlines()[-1])["val_samples"] == 16
