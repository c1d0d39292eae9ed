"""Tests of guard.py: what needs no process group in this one process, each in milliseconds (or
a Python process of its own, to see what a fresh one reads or how it exits); what gathers, on a
gloo group of one in this process, and where ranks must disagree, on 3 real processes. In
guard.py's order, under its headings."""
import math
import os
import signal
import sys
import textwrap
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from PIL import Image

import guard
import train_ddp
from conftest import ROOT, clean_env, finish, free_port, kill_tree, load, noise_image, place_in_hub_cache, run, \
    start, write_images

pytestmark = [pytest.mark.timeout(120), pytest.mark.quick]


def exit_of(call, capsys):
    """The exit code and stderr of a call that must end the process (guard's fail or rank_error)."""
    with pytest.raises(SystemExit) as ended:
        call()
    return ended.value.code, capsys.readouterr().err


GLOO_WORLD = """
import os, signal, sys, types
import torch
import torch.distributed as dist
import guard
dist.init_process_group("gloo")
rank = dist.get_rank()
try:
{body}
except SystemExit as ended:
    code = ended.code
else:
    code = 0
# Past Python's clean-up, which can abort on a gloo group whose peers have gone.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


def in_gloo_world(body, ranks=3):
    """Each of `ranks` real processes joins a gloo group, then runs `body`; their results by rank.
    LOCAL_RANK is the rank, as on one machine: only rank 0 says what fail() says."""
    code = GLOO_WORLD.format(body=textwrap.indent(textwrap.dedent(body), "    "))
    port = free_port()
    procs = [start([sys.executable, "-c", code], env=clean_env(
        RANK=r, WORLD_SIZE=ranks, LOCAL_RANK=r, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(ranks)]
    try:
        return [finish(proc, 60) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)


# ------------------------------------------------------------------------- one-line failures
def test_world_from_env_reads_torchrun_then_an_srun_task(monkeypatch):
    for name in ["RANK", "WORLD_SIZE", "SLURM_STEP_ID"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert guard.world_from_env() == (0, 1)  # sbatch's script, not an srun task
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert guard.world_from_env() == (3, 8)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert guard.world_from_env() == (1, 2)


def test_stop_on_problems_says_it_and_exits_1(world_of_one, capsys):
    guard.stop_on_problems(None)
    code, err = exit_of(lambda: guard.stop_on_problems("cannot read x.jpg"), capsys)
    assert code == 1 and err == "train_ddp.py: error: rank 0: cannot read x.jpg\n"


def test_stop_on_problems_stops_every_rank_and_rank_0_says_who():
    ranks = in_gloo_world("""
        guard.stop_on_problems(None)
        guard.stop_on_problems("cannot read x.jpg" if rank == 1 else None)
    """)
    assert [r.returncode for r in ranks] == [1, 1, 1]
    assert [r.stderr for r in ranks] == ["train_ddp.py: error: rank 0: stopping: rank 1 failed (see above)\n",
                                         "train_ddp.py: error: rank 1: cannot read x.jpg\n", ""]


def test_load_file_names_a_missing_or_unreadable_file(tmp_path, capsys):
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    code, err = exit_of(lambda: guard.load_file(tmp_path / "none.pt", "--resume", "checkpoint"), capsys)
    assert code == 2
    assert err == f"train_ddp.py: error: --resume {tmp_path}/none.pt: no such file; expected a checkpoint\n"
    code, err = exit_of(lambda: guard.load_file(tmp_path / "bad.pt", "--resume", "checkpoint"), capsys)
    assert code == 2 and f"--resume {tmp_path}/bad.pt: not a readable checkpoint (UnpicklingError: " in err


class MakesADirectoryWhenUnpickled:
    """What a file from elsewhere may hold: an object whose unpickling runs code."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def test_load_file_refuses_a_file_whose_unpickling_would_run_code(tmp_path, capsys):
    # torch.load runs such code unless weights_only, which torch before 2.6 does not default to.
    torch.save({"model": MakesADirectoryWhenUnpickled(tmp_path / "ran")}, tmp_path / "code.pt")
    code, err = exit_of(lambda: guard.load_file(tmp_path / "code.pt", "--resume", "checkpoint"), capsys)
    assert code == 2 and f"--resume {tmp_path}/code.pt: not a readable checkpoint (UnpicklingError: " in err, err
    assert not (tmp_path / "ran").exists()


# -------------------------------------------------------------------- arguments and files
def test_settle_args_completes_the_devices_defaults_and_the_backend():
    args = train_ddp.parse_args(["--arch", "resnet18"])
    for name, value in train_ddp.DEVICE_DEFAULTS["cpu"].items():
        assert getattr(args, name) == value, name
    assert (args.resize, args.backend, args.image_size_given) == (36, "gloo", False)
    args = train_ddp.parse_args(["--arch", "resnet18", "--image-size", "64", "--batch-size", "3"])
    assert (args.image_size, args.resize, args.batch_size, args.image_size_given) == (64, 73, 3, True)
    args = train_ddp.parse_args(["--arch", "resnet18", "--comm-hook", "powersgd", "--amp", "bf16", "--save-every",
                                 "5", "--init-timeout", "0.5", "--collective-timeout", "0.5"])
    assert (args.comm_hook, args.save_every, args.init_timeout) == ("powersgd", 5, 0.5)
    assert train_ddp.parse_args(["--arch", "resnet18", "--comm-hook", "powersgd"]).amp == "off"


def test_settle_args_takes_named_weights_recipe_sizes_unless_given(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # the weights there, as if downloaded: check_args loads them
    place_in_hub_cache(tmp_path, "resnet50", torchvision.models.ResNet50_Weights.IMAGENET1K_V2)
    place_in_hub_cache(tmp_path, "swin_v2_t", torchvision.models.Swin_V2_T_Weights.IMAGENET1K_V1)
    args = train_ddp.parse_args(["--weights", "ResNet50_Weights.IMAGENET1K_V2"])
    assert (args.image_size, args.resize, args.interpolation) == (224, 232, "bilinear")
    args = train_ddp.parse_args(["--arch", "swin_v2_t", "--weights", "IMAGENET1K_V1"])
    assert (args.image_size, args.resize, args.interpolation) == (256, 260, "bicubic")
    assert train_ddp.parse_args(["--weights", "DEFAULT", "--image-size", "64"]).image_size == 64


CHECK_ARGS_FAILURES = {
    "--epochs 0": "--epochs must be 1 or more, got 0",
    "--accum-steps -1": "--accum-steps must be 1 or more, got -1",
    "--train-samples 0": "--train-samples must be 1 or more, got 0",
    "--val-samples 0": "--val-samples must be 1 or more, got 0",
    "--image-size 0": "--image-size must be 1 or more, got 0",
    "--log-every 0": "--log-every must be 1 or more, got 0",
    "--num-classes 1": "--num-classes must be 2 or more, got 1",
    "--workers -1": "--workers must be 0 or more, got -1",
    "--init-timeout 0": "--init-timeout must be more than 0 seconds, got 0",
    "--collective-timeout -1": "--collective-timeout must be more than 0 seconds, got -1",
    "--arch inception_v3 --image-size 32": "--arch inception_v3 cannot train on 32 px images",
    "--arch resnet18 --batch-size 1": "--arch resnet18 cannot train on 32 px images (ValueError: Expected more than 1 "
                                      "value per channel when training, got input size torch.Size([1, 512, 1, 1])); "
                                      "expected --batch-size 2 or more, a larger --image-size or another --arch",
    "--metrics-file .": "--metrics-file .: a directory; expected a file to append to",
    "--backend nccl": "--backend nccl needs CUDA GPUs and none is visible",
    "--sync-bn": "--sync-bn needs CUDA GPUs (torch's SyncBatchNorm runs on GPUs only); drop it on CPUs",
    "--evaluate": "--evaluate needs --resume PATH or --weights",
    "--resume a.pt --weights DEFAULT": "--resume or --weights, not both: a resume continues",
    "--weights IMAGENET1K_V3": "--weights IMAGENET1K_V3: no such file, nor weights of --arch "
                               "resnet50; expected a file or one of IMAGENET1K_V1, IMAGENET1K_V2, DEFAULT",
    "--weights ResNet18_Weights.DEFAULT": "nor weights of --arch resnet50",
}


GPU_ONLY = ["--backend nccl", "--sync-bn"]
VALID_WITH_A_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="valid with a GPU")


@pytest.mark.parametrize("argv", [pytest.param(argv, marks=VALID_WITH_A_GPU if argv in GPU_ONLY else ())
                                  for argv in CHECK_ARGS_FAILURES])
def test_check_args_rejects_each_bad_value_with_one_line(argv, capsys):
    code, err = exit_of(lambda: train_ddp.parse_args(argv.split()), capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("train_ddp.py: error: ") and CHECK_ARGS_FAILURES[argv] in err, err


def test_check_arch_trains_takes_one_image_per_batch_where_batch_norm_still_sees_two_values():
    # At 64 px ResNet's last batch norm sees 2 x 2 values per channel; --evaluate, none.
    for argv in ["--image-size 64", "--evaluate --resume unread.pt"]:
        assert train_ddp.parse_args(["--arch", "resnet18", "--batch-size", "1", *argv.split()]).batch_size == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="--sync-bn needs CUDA GPUs")
def test_check_arch_trains_counts_every_ranks_values_with_sync_bn(monkeypatch, capsys):
    # One 32 px image per rank: ResNet's last batch norm sees one value per channel, one per rank with --sync-bn.
    argv = ["--arch", "resnet18", "--image-size", "32", "--batch-size", "1", "--sync-bn"]
    code, err = exit_of(lambda: train_ddp.parse_args(argv), capsys)  # a world of one: its own value only
    assert code == 2 and "Expected more than 1 value per channel" in err, err
    assert train_ddp.parse_args(argv + ["--dry-run"]).batch_size == 1  # launch.sh's: each rank checks again
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_ddp.parse_args(argv).batch_size == 1


def test_check_args_wants_every_interface_gloo_socket_ifname_names(monkeypatch, capsys):
    # A list too (eth0,eth1: gloo spreads its connections over both); a name missing here fails in one line,
    # before any process group, not at gloo's start on every rank.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert train_ddp.parse_args(["--arch", "resnet18"]).arch == "resnet18"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,nonexistent9")
    code, err = exit_of(lambda: train_ddp.parse_args(["--arch", "resnet18"]), capsys)
    assert code == 2 and err.startswith("train_ddp.py: error: GLOO_SOCKET_IFNAME=lo,nonexistent9 names "
                                        "'nonexistent9', which this machine lacks; expected some of its "
                                        "interfaces: "), err
    assert "lo" in err.split(": ")[-1].split(), err


def test_check_writable_names_the_file_in_the_way(tmp_path, capsys):
    guard.check_writable(tmp_path / "new" / "deeper", "--checkpoint-dir")
    (tmp_path / "a_file").write_text("")
    code, err = exit_of(lambda: guard.check_writable(tmp_path / "a_file" / "ck", "--metrics-file"), capsys)
    assert code == 2 and f"--metrics-file: cannot write under {tmp_path}/a_file;" in err


def test_check_image_folder_wants_images_and_the_same_classes_in_both_splits(tmp_path, capsys):
    write_images(tmp_path / "data", noise_image(8, 8), ["cat", "dog"], {"train": 1, "val": 1})
    guard.check_image_folder(tmp_path / "data")
    (tmp_path / "data" / "val" / "cow").mkdir()
    code, err = exit_of(lambda: guard.check_image_folder(tmp_path / "data"), capsys)
    assert code == 2 and "(only in train/: []; only in val/: ['cow'])" in err
    for image in (tmp_path / "data" / "val").glob("*/*"):
        image.rename(image.with_suffix(".txt"))
    code, err = exit_of(lambda: guard.check_image_folder(tmp_path / "data"), capsys)
    assert code == 2 and f"{tmp_path}/data/val holds no images" in err


def test_check_checkpoint_wants_train_ddp_pys_keys_and_this_arch(tmp_path, capsys):
    torch.save({**dict.fromkeys(guard.CHECKPOINT_KEYS), "args": {"arch": "resnet18"},
                "model": torchvision.models.resnet18(num_classes=10).state_dict()}, tmp_path / "last.pt")
    checkpoint = guard.load_file(tmp_path / "last.pt", "--resume", "checkpoint")  # names unpickled, as in a run
    args = train_ddp.parse_args(["--arch", "resnet18", "--dry-run"])
    guard.check_checkpoint(checkpoint, "last.pt", args)
    code, err = exit_of(lambda: guard.check_checkpoint({"model": {}}, "w.pt", args), capsys)
    assert code == 2 and err == ("train_ddp.py: error: --resume w.pt: not a train_ddp.py checkpoint (expected the keys "
                                 "args, epoch, model, optimizer, rng, samples, scaler, step, world_size)\n"), err
    for arch in ["resnet101", "resnet34"]:  # sorted before the checkpoint's, and after
        args.arch = arch
        code, err = exit_of(lambda: guard.check_checkpoint(checkpoint, "last.pt", args), capsys)
        assert code == 2 and err == ("train_ddp.py: error: --resume last.pt holds a resnet18 model but --arch is "
                                     f"{arch}\n"), err


def test_num_classes_counts_the_train_folders(tmp_path):
    write_images(tmp_path, noise_image(8, 8), ["a", "b", "c"], {"train": 1, "val": 1})
    args = train_ddp.parse_args(["--arch", "resnet18", "--data", str(tmp_path), "--num-classes", "7"])
    assert guard.num_classes(args) == 3
    assert guard.num_classes(train_ddp.parse_args(["--arch", "resnet18", "--num-classes", "7"])) == 7


def test_weights_for_takes_every_layer_but_a_classifier_of_another_size(tmp_path):
    torch.manual_seed(0)
    theirs = torchvision.models.resnet18(num_classes=1000).state_dict()
    del theirs["bn1.num_batches_tracked"]  # as weights saved before torch 0.4.1
    torch.save(theirs, tmp_path / "weights.pt")
    torch.save({"model": theirs, "step": 3}, tmp_path / "last.pt")
    for name in ["weights.pt", "last.pt"]:
        args = train_ddp.parse_args(["--arch", "resnet18", "--weights", str(tmp_path / name)])
        model = torchvision.models.resnet18(num_classes=10)
        state, new_layers = guard.weights_for(model, tmp_path / name, args)
        assert new_layers == ["fc"] and torch.equal(state["fc.weight"], model.fc.weight)
        assert all(torch.equal(state[key], theirs[key]) for key in theirs if not key.startswith("fc"))
        model.load_state_dict(state, strict=False)


WEIGHTS_FAILURES = {
    "a conv of another shape": (lambda s: s.update({"conv1.weight": s["conv1.weight"][:, :1]}),
                                "conv1.weight has shape [64, 1, 7, 7], expected [64, 3, 7, 7]"),
    "a classifier of another width": (lambda s: s.update({"fc.weight": s["fc.weight"][:, :256]}),
                                      "fc.weight has shape [1000, 256], expected [10, 512]"),
    "a wider classifier": (lambda s: s.update({"fc.weight": s["fc.weight"].repeat(1, 2)}),
                           "fc.weight has shape [1000, 1024], expected [10, 512]"),
    "a key missing": (lambda s: s.pop("layer1.0.conv1.weight"),
                      "missing keys ['layer1.0.conv1.weight'], unexpected keys []"),
    "a key too many": (lambda s: s.update({"head.weight": s["fc.weight"]}),
                       "missing keys [], unexpected keys ['head.weight']"),
}


@pytest.mark.parametrize("case", WEIGHTS_FAILURES)
def test_weights_for_refuses_weights_that_do_not_fit(case, tmp_path, capsys):
    change, message = WEIGHTS_FAILURES[case]
    state = torchvision.models.resnet18(num_classes=1000).state_dict()
    change(state)
    torch.save(state, tmp_path / "w.pt")
    args = train_ddp.parse_args(["--arch", "resnet18", "--dry-run"])
    args.weights = str(tmp_path / "w.pt")
    model = torchvision.models.resnet18(num_classes=10)
    code, err = exit_of(lambda: guard.weights_for(model, tmp_path / "w.pt", args), capsys)
    assert code == 2 and f"--weights {tmp_path}/w.pt does not fit --arch resnet18: {message}" in err, err


def test_check_args_takes_a_weights_file_for_a_model_the_meta_device_cannot_build(tmp_path):
    # The regnets compute while they build: their --weights fit was checked on the meta device, which raised there.
    torch.save(torchvision.models.regnet_y_400mf(num_classes=10).state_dict(), tmp_path / "w.pt")
    args = train_ddp.parse_args(["--arch", "regnet_y_400mf", "--weights", str(tmp_path / "w.pt")])
    assert guard.meta_model(args) is None and args.weights == str(tmp_path / "w.pt")


def test_weights_for_refuses_a_classifier_for_other_classes_to_evaluate(tmp_path, capsys):
    torch.save(torchvision.models.resnet18(num_classes=7).state_dict(), tmp_path / "w.pt")
    argv = ["--arch", "resnet18", "--weights", str(tmp_path / "w.pt"), "--evaluate", "--dry-run"]
    assert train_ddp.parse_args(argv + ["--num-classes", "7"]).num_classes == 7
    code, err = exit_of(lambda: train_ddp.parse_args(argv + ["--num-classes", "5"]), capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"train_ddp.py: error: --evaluate --weights {tmp_path}/w.pt: fc is for 7 classes, not 5; expected "
        "the classes it was trained on (--num-classes, or the class folders of --data)"], err


def test_weights_file_finds_named_weights_in_the_hub_cache_and_weights_for_names_a_bad_file_there(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    placed = place_in_hub_cache(tmp_path, "resnet18", torchvision.models.ResNet18_Weights.IMAGENET1K_V1)
    args = train_ddp.parse_args(["--arch", "resnet18", "--weights", "IMAGENET1K_V1", "--num-classes", "1000"])
    cached = tmp_path / "hub" / "checkpoints" / os.path.basename(torchvision.models.ResNet18_Weights.DEFAULT.url)
    assert guard.weights_file(args) == (cached, None)
    state, new_layers = guard.weights_for(torchvision.models.resnet18(), cached, args)
    assert new_layers == [] and torch.equal(state["fc.weight"], placed["fc.weight"])
    cached.write_bytes(b"placed by hand, and wrong")  # where the download's failure line says to place it
    code, err = exit_of(lambda: guard.weights_for(torchvision.models.resnet18(), cached, args), capsys)
    assert code == 2 and err.startswith(f"train_ddp.py: error: --weights {cached}: not a readable state dict ("), err


def test_weights_file_says_how_to_work_offline_when_a_download_fails(tmp_path, monkeypatch):
    # A proxy where nothing listens: the download fails at once, as without a network. In a new TORCH_HOME, and in
    # one whose hub cache already holds other weights.
    monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{free_port()}")
    args = train_ddp.parse_args(["--arch", "resnet18", "--weights", "IMAGENET1K_V1"])
    url = torchvision.models.ResNet18_Weights.DEFAULT.url
    for home, others in [(tmp_path / "new", []), (tmp_path / "used", ["resnet50.pth"])]:
        monkeypatch.setenv("TORCH_HOME", str(home))
        for name in others:
            (home / "hub" / "checkpoints").mkdir(parents=True, exist_ok=True)
            (home / "hub" / "checkpoints" / name).write_bytes(b"")
        path, problem = guard.weights_file(args)
        cached = home / "hub" / "checkpoints" / os.path.basename(url)
        assert path is None and "\n" not in problem, problem
        assert problem.startswith(f"--weights IMAGENET1K_V1: could not download {url} (URLError: "), problem
        assert problem.endswith(f"; without a network, place that file at {cached}, or pass --weights PATH to a "
                                "state dict"), problem
        assert sorted(p.name for p in cached.parent.iterdir()) == others  # no partial file left


# --------------------------------------------------------------------------------- images
def test_read_image_gives_rgb_uint8_from_every_format(tmp_path):
    # JPEG (also grayscale and CMYK) and PNG (also with alpha) by torchvision.io, BMP by PIL: 3-channel uint8, the
    # pixels PIL gives (JPEG within one level: two libjpeg builds); damaged files raise UnreadableImage naming the file.
    pixels = noise_image(24, 40)(0, 0).numpy()
    for name, mode, tolerance in [("rgb.jpg", "RGB", 1), ("gray.jpg", "L", 1), ("cmyk.jpg", "CMYK", 1),
                                  ("rgba.png", "RGBA", 0), ("palette.png", "P", 0), ("rgb.bmp", "RGB", 0)]:
        Image.fromarray(pixels).convert(mode).save(tmp_path / name, quality=95)
        image = guard.read_image(tmp_path / name)
        want = torch.from_numpy(np.array(Image.open(tmp_path / name).convert("RGB"))).permute(2, 0, 1)
        assert image.dtype == torch.uint8 and image.shape == (3, 24, 40), name
        assert (image.int() - want.int()).abs().max() <= tolerance, name
    # 16 bits a channel, which torchvision.io gives as uint16: each pixel's high byte, not its low one.
    gray = pixels[..., 0].astype(np.uint16)
    Image.fromarray(gray * 256 + 255 - gray).save(tmp_path / "gray16.png")
    image = guard.read_image(tmp_path / "gray16.png")
    assert image.dtype == torch.uint8 and torch.equal(image, torch.from_numpy(pixels[..., 0]).expand(3, -1, -1))
    jpeg = (tmp_path / "rgb.jpg").read_bytes()
    (tmp_path / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (tmp_path / "text.jpg").write_text("not an image")
    for name, reason in [("truncated.jpg", "truncated"), ("text.jpg", "cannot identify image file")]:
        with pytest.raises(guard.UnreadableImage, match=f"{tmp_path / name} .*{reason}"):
            guard.read_image(tmp_path / name)


def test_read_or_problem_names_the_file_also_from_a_dataloader_workers_text():
    def raise_(text):
        raise guard.UnreadableImage(text)

    # DataLoader raises a worker's error again as its type, with the worker's traceback in front.
    worker = ("Caught UnreadableImage in DataLoader worker process 0.\nOriginal Traceback ...\n"
              "guard.UnreadableImage: /data/x.jpg (OSError: truncated)\n")
    assert guard.read_or_problem(lambda: raise_(worker)) == (
        None, "cannot read /data/x.jpg (OSError: truncated); remove or replace that file")
    assert guard.read_or_problem(lambda: raise_("/d/y.png (SyntaxError: bad)"))[1].startswith("cannot read /d/y.png")
    assert guard.read_or_problem(lambda: [1, 2]) == ([1, 2], None)


# ----------------------------------------------------------------- the device, the process group
NCCL_VARIABLES = ["TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                  "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "NCCL_ASYNC_ERROR_HANDLING",
                  "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_ON_TIMEOUT"]


def test_raise_nccl_timeouts_sets_what_the_user_did_not(tmp_path, monkeypatch):
    for name in NCCL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    args = train_ddp.parse_args(["--arch", "resnet18", "--checkpoint-dir", str(tmp_path / "ck")])
    for given, kept in [(None, "2"), ("1", "2"), ("0", "0"), ("3", "3")]:
        if given is not None:
            monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", given)
        guard.raise_nccl_timeouts(args)
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == kept, given
    trace = os.environ[guard.TRACE_FILE_NAMES[0]]
    assert trace == f"{tmp_path}/ck/nccl_trace_rank_" and (tmp_path / "ck").is_dir()
    for name in NCCL_VARIABLES[1:]:
        monkeypatch.setenv(name, "mine")
    guard.raise_nccl_timeouts(args)
    assert all(os.environ[name] == "mine" for name in NCCL_VARIABLES[1:])


def test_raise_nccl_timeouts_takes_the_users_values_under_the_older_names(tmp_path, monkeypatch):
    # torch reads the first name set (c10d/Utils.hpp): train_ddp.py's default under the new name hid a user's
    # path under the older one, and torchrun's 1 under the new name a user's legacy NCCL_ASYNC_ERROR_HANDLING.
    for name in NCCL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    args = train_ddp.parse_args(["--arch", "resnet18", "--checkpoint-dir", str(tmp_path / "ck")])
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/mine/trace_")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # torchrun's
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "3")
    guard.raise_nccl_timeouts(args)
    assert os.environ[guard.TRACE_FILE_NAMES[0]] == "/mine/trace_"  # what this torch reads first
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_torch_release_takes_a_source_builds_version_for_its_release():
    # NGC's containers ship builds such as 2.11.0a0+git...: a pre-release of 2.11 by version rules, 2.11 in what it
    # holds, whose flight recorder reads the new names first.
    code = ("import torch; torch.__version__ = torch.torch_version.TorchVersion('2.11.0a0+git1a2b3c4'); "
            "import guard; print(*guard.TORCH_RELEASE, guard.TRACE_FILE_NAMES[0])")
    result = run([sys.executable, "-c", code], env=clean_env(), cwd=ROOT, timeout=60)
    assert result.stdout.split() == ["2", "11", "TORCH_FR_DUMP_TEMP_FILE"], result.stderr[-2000:]


def test_store_of_this_attempt_prefixes_each_restart_and_drops_the_old_nccl_signals(monkeypatch):
    store = dist.HashStore()
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert guard.store_of_this_attempt(store) is store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for key in guard.NCCL_SIGNAL_KEYS:
        store.set(key, "1")
    for attempt in ["0", "1"]:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        guard.store_of_this_attempt(store).set("ready", attempt)
        assert store.get(f"attempt_{attempt}/ready") == attempt.encode()
        assert store.check(guard.NCCL_SIGNAL_KEYS) == (attempt == "0")


def test_init_failure_says_what_to_change(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    args = train_ddp.parse_args(["--arch", "resnet18", "--init-timeout", "30"])
    nccl = RuntimeError("ncclInvalidUsage\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000\n")
    assert guard.init_failure(nccl, args, 2) == (
        "two ranks share one GPU (Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000); "
        "give each process a GPU of its own (srun --gpus-per-task=1, or one launch.sh per node)")
    timeout = guard.init_failure(TimeoutError("timed out\nmore"), args, 4)
    assert timeout == ("the process group did not form within --init-timeout 30 s: expected WORLD_SIZE=4 "
                       "ranks at node0:29500, and not all came or could connect (timed out)")
    gloo = guard.init_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:144] connect: refused"), args, 2)
    assert gloo.endswith("set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on)")


def test_a_launcher_variable_missing_is_named_in_one_line(tmp_path):
    # torch's env:// rendezvous names the variable; the line adds where it comes from.
    env = clean_env(RANK=1, WORLD_SIZE=2, MASTER_PORT=29500)
    result = run([sys.executable, ROOT / "train_ddp.py", "--checkpoint-dir", tmp_path], env=env)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "train_ddp.py: error: rank 1: Error initializing torch.distributed using env:// rendezvous: "
        "environment variable MASTER_ADDR expected, but not set; expected MASTER_ADDR and a MASTER_PORT "
        "number from the launcher (under srun, export both: docs/launching.md)"], result.stderr


COLLECTIVE_FAILED = """
import atexit, sys, types
import torch.distributed as dist
import guard
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
atexit.register(print, "Python's clean-up ran")  # which a broken group can block
guard.collective_failed(RuntimeError(sys.argv[1]), types.SimpleNamespace(collective_timeout=600))
"""


@pytest.mark.parametrize("text", [f"{words}\nException raised from checkAndAbortIfTimedOutOrError"
                                  for words in guard.NCCL2_FAILURES])
def test_collective_failed_takes_nccl2s_runtime_error_for_a_rank_gone(text):
    # torch 2.15's ProcessGroupNCCL2 raises a RuntimeError at the collective after a timeout, not the old class's
    # DistBackendError: still one line from the rank, and exit 1, not a traceback.
    result = run([sys.executable, "-c", COLLECTIVE_FAILED, text], env=clean_env(), cwd=ROOT, timeout=60)
    assert result.returncode == 1 and result.stdout == "", result.stderr
    assert result.stderr.splitlines() == [
        "train_ddp.py: error: rank 0: a collective failed: another rank stopped, or stopped answering for "
        f"--collective-timeout 600 s; look for its own error ({text.splitlines()[0]})"]


@pytest.mark.parametrize("text", ["[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                                  "waiting 10000ms for recv operation to complete",
                                  "Application timeout caused pair closure"])
def test_collective_failed_takes_gloos_errors_for_a_rank_gone(text):
    # The second is what gloo tells the group's other operations when a receive times out: a link cut mid-step
    # gave it to DDP's backward on rank 0, which raised it with a traceback.
    result = run([sys.executable, "-c", COLLECTIVE_FAILED, text], env=clean_env(), cwd=ROOT, timeout=60)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "train_ddp.py: error: rank 0: a collective failed: another rank stopped, or stopped answering for "
        f"--collective-timeout 600 s; look for its own error ({text})"], result.stderr


def test_collective_failed_raises_any_other_error_as_it_is():
    result = run([sys.executable, "-c", COLLECTIVE_FAILED, "CUDA out of memory"], env=clean_env(), cwd=ROOT,
                 timeout=60)
    assert result.returncode == 1 and result.stderr.splitlines()[-1].endswith("RuntimeError: CUDA out of memory")


def test_check_same_start_stops_every_rank_naming_each_start():
    # Rank 0 stands where ranks 1 and 2 do, but in another job: its node's own disk holds that job's last.pt.
    ranks = in_gloo_world("""
        guard.check_same_start(None)  # the same on every rank
        checkpoint = {"epoch": 1, "step": 5, "samples": 40, "run_id": f"job-{min(rank, 1)}"}
        guard.check_same_start(checkpoint if rank < 3 else None)
    """, ranks=4)
    assert [r.returncode for r in ranks] == [2, 2, 2, 2] and [r.stderr for r in ranks[1:]] == ["", "", ""]
    assert ranks[0].stderr.startswith(
        "train_ddp.py: error: the ranks would resume from different checkpoints (rank 0: epoch 1 step 5, "
        "samples 40, run id job-0; ranks 1, 2: epoch 1 step 5, samples 40, run id job-1; rank 3: a fresh start); "
        "give every node the same --resume file"), ranks[0].stderr


def test_check_finite_stops_on_a_loss_of_nan_or_inf(tmp_path, capsys):
    args = train_ddp.parse_args(["--arch", "resnet18", "--checkpoint-dir", str(tmp_path)])
    run = types.SimpleNamespace(epoch=1, step=40)
    guard.check_finite(math.isfinite(2.5), "the loss is 2.5", run, args)
    for loss in [float("nan"), float("inf")]:
        code, err = exit_of(lambda: guard.check_finite(math.isfinite(loss), f"the loss is {loss}", run, args),
                            capsys)
        assert code == 1 and err == (f"train_ddp.py: error: the loss is {loss} at epoch 2 step 40: training "
                                     f"diverged; lower --lr (0.005 now) or check the data; {tmp_path}/last.pt keeps "
                                     "the last save\n")


# ------------------------------------------------------------------------- stopping together
def test_stop_agreement_stops_on_a_sigterm_and_exits_on_a_problem(world_of_one, capsys):
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = guard.StopAgreement()
        assert not stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        stop.send()
        assert stop.agreed() and stop.stopped_by == "SIGTERM" and not stop.ending
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # launch.sh's repeats cannot kill it
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # a Ctrl-C then stops at once
        stop.send("cannot read x.jpg")
        code, err = exit_of(stop.agreed, capsys)
        assert code == 1 and "rank 0: cannot read x.jpg" in err
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_stop_agreement_names_a_ctrl_c_and_a_second_one_ends_the_process_at_once():
    # Real processes: the second SIGINT's default action ends the process, as in a terminal.
    code = """if True:
        import os, signal, time, torch.distributed as dist, guard
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        stop = guard.StopAgreement()
        os.kill(os.getpid(), signal.SIGINT)
        print(stop.agreed(), stop.stopped_by, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        print("not stopped", flush=True)"""
    result = run([sys.executable, "-c", code], env=clean_env(), cwd=ROOT, timeout=60)
    assert result.returncode == -signal.SIGINT and result.stdout == "True SIGINT\n", result


@pytest.mark.parametrize("where", ["a terminal", "SLURM", "launch.sh"])
def test_stop_agreement_exits_75_after_a_stop_0_under_slurm_and_launch_sh(tmp_path, where):
    # launch.sh's torchrun would take 75 for a failure: its workers exit 0 and touch STOP_FILE,
    # by which launch.sh exits 75; its file goes when a later round trains to the end.
    env = {"a terminal": {}, "SLURM": {"SLURM_JOB_ID": "7"}, "launch.sh": {"STOP_FILE": tmp_path / "f"}}
    code = """if True:
        import os, signal, types, torch.distributed as dist, guard
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        args = types.SimpleNamespace(checkpoint_dir="ck")
        done = guard.StopAgreement()
        done.agreed()
        done.exit(args)
        print("STOP_FILE" in os.environ and os.path.exists(os.environ["STOP_FILE"]), flush=True)
        stop = guard.StopAgreement()
        os.kill(os.getpid(), signal.SIGTERM)
        stop.agreed()
        stop.exit(args)"""
    (tmp_path / "f").touch()  # an earlier round's stop
    result = run([sys.executable, "-c", code], env=clean_env(**env[where]), cwd=ROOT, timeout=60)
    assert result.stdout == "False\n", result  # the round that trained to the end removed it
    assert result.returncode == {"a terminal": 75, "SLURM": 0, "launch.sh": 0}[where], result
    if where == "launch.sh":
        assert (tmp_path / "f").exists()


@pytest.mark.parametrize("on_the_rendezvous_host", [True, False])
def test_stop_agreement_stops_every_rank_for_one_ranks_sigterm(on_the_rendezvous_host):
    # Then, in an elastic job, the ranks without a SIGTERM wait for one (a join), else exit 1 for
    # torchrun to go on without the node that left; with the rendezvous host gone, all end, saved.
    ranks = in_gloo_world(f"""
        os.environ.update(NNODES="1:2", RDZV_HOST=str(int(rank == 1 and {on_the_rendezvous_host})))
        stop = guard.StopAgreement()
        before = stop.agreed()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        print(before, stop.agreed(), stop.stopped_by, stop.ending, bool(stop.requested), flush=True)
        stop.exit(types.SimpleNamespace(checkpoint_dir="ck"))
    """)
    ending = on_the_rendezvous_host
    assert [r.stdout for r in ranks] == [f"False True SIGTERM {ending} {rank == 1}\n" for rank in range(3)]
    if ending:  # every rank saved and stopped, the job not done
        assert [r.returncode for r in ranks] == [75, 75, 75], ranks
        assert "got a SIGTERM and left, and the elastic job ends with it; go on with --resume ck/last.pt" in \
            ranks[0].stderr
    else:
        assert [r.returncode for r in ranks] == [1, 75, 1] and ranks[0].seconds > guard.ELASTIC_WAIT, ranks
        assert "another node left the elastic job (a SIGTERM there, none here in 10 s): exit 1" in ranks[0].stderr
    assert ranks[1].stderr == ranks[2].stderr == ""


# ------------------------------------------------------------------------ batch norm's statistics
def test_recalibrate_batch_norm_averages_the_first_bn_images_in_whole_batches(world_of_one):
    # Of 1100 images, the first BN_IMAGES (1024) in the sampler's order: 128 batches of 8, whose means and
    # unbiased variances are averaged (update_bn's momentum None), on one rank of one.
    images = torch.randint(0, 256, (1100, 3, 2, 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.zeros(1100, dtype=torch.long)
    order = torch.randperm(1100, generator=torch.Generator().manual_seed(1)).tolist()
    args = types.SimpleNamespace(batch_size=8, workers=0, seed=0, channels_last=False)
    to_input = train_ddp.ModelInput(args, torch.device("cpu"))
    model = nn.Sequential(nn.BatchNorm2d(3))
    guard.recalibrate_batch_norm(model, torch.utils.data.TensorDataset(images, labels), order, args, to_input)
    batches = [to_input(batch, labels[:8])[0] for batch in images[order[:guard.BN_IMAGES]].split(8)]
    means = torch.stack([batch.mean((0, 2, 3)) for batch in batches]).mean(0)
    variances = torch.stack([batch.var((0, 2, 3)) for batch in batches]).mean(0)
    assert torch.allclose(model[0].running_mean, means) and torch.allclose(model[0].running_var, variances)


# ------------------------------------------------------------------------ checkpoint writes
def test_checkpoint_writer_writes_each_state_as_it_was_when_given(tmp_path):
    state = {"w": torch.zeros(3)}
    with guard.CheckpointWriter() as writer:
        writer.write(state, tmp_path / "a.pt")
        state["w"].add_(1)
        writer.write(state, tmp_path / "b.pt")
        state["w"].add_(1)
    assert torch.equal(load(tmp_path / "a.pt")["w"], torch.zeros(3))
    assert torch.equal(load(tmp_path / "b.pt")["w"], torch.ones(3))


def test_on_host_copies_tensors_in_nested_dicts_and_lists():
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"state": [torch.zeros(1), 5]}, "args": {"lr": 0.1}}
    host = guard.on_host(state)
    state["model"]["w"].add_(1)
    state["optimizer"]["state"][0].add_(1)
    assert torch.equal(host["model"]["w"], torch.ones(2))
    assert torch.equal(host["optimizer"]["state"][0], torch.zeros(1))
    assert host["optimizer"]["state"][1] == 5 and host["args"] == {"lr": 0.1}


class Versioned(nn.Linear):
    """A module whose state dict format changed: its loader reads the version it was saved at."""
    _version = 3
    loaded_versions = []

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        Versioned.loaded_versions.append(local_metadata.get("version"))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_on_host_keeps_the_module_versions_of_a_state_dict(tmp_path):
    # The copy that the writer thread saves must keep the state dict's _metadata, or a module like
    # Versioned would load its own checkpoint as if it were of an old format.
    state = guard.on_host({"model": Versioned(2, 2).state_dict(), "step": 7})
    guard.write_atomically(state, tmp_path / "last.pt")
    saved = torch.load(tmp_path / "last.pt", map_location="cpu", weights_only=True)
    Versioned.loaded_versions.clear()
    Versioned(2, 2).load_state_dict(saved["model"])
    assert Versioned.loaded_versions == [3] and saved["step"] == 7


def test_write_atomically_replaces_the_file_and_leaves_no_temporary(tmp_path):
    guard.write_atomically({"step": 1}, tmp_path / "ck" / "last.pt")
    guard.write_atomically({"step": 2}, tmp_path / "ck" / "last.pt")
    assert load(tmp_path / "ck" / "last.pt") == {"step": 2}
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["last.pt"]


def test_write_atomically_ends_the_process_with_one_line_when_it_cannot_write(tmp_path):
    (tmp_path / "a_file").write_text("")
    code = f"import pathlib, guard; guard.write_atomically({{}}, pathlib.Path({str(tmp_path)!r}, 'a_file', 'last.pt'))"
    result = run([sys.executable, "-c", code], env=clean_env(), cwd=ROOT, timeout=60)
    assert result.returncode == 1 and result.stderr.startswith(
        f"train_ddp.py: error: rank 0: could not write {tmp_path}/a_file/last.pt (FileExistsError: "), result.stderr
    assert result.stderr.count("\n") == 1


def test_settle_momentum_buffers_gives_zeros_where_missing_in_the_parameters_layout():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9)
    optimizer.state[conv.weight]["momentum_buffer"] = torch.ones(4, 3, 3, 3)  # a contiguous one, as loaded
    guard.settle_momentum_buffers(optimizer)
    weight, bias = (optimizer.state[p]["momentum_buffer"] for p in [conv.weight, conv.bias])
    assert weight.is_contiguous(memory_format=torch.channels_last) and torch.equal(weight, torch.ones(4, 3, 3, 3))
    assert torch.equal(bias, torch.zeros(4))
    plain = torch.optim.SGD(conv.parameters(), lr=0.1)
    guard.settle_momentum_buffers(plain)
    assert not any(plain.state[p] for p in conv.parameters())


@pytest.mark.skipif(not hasattr(torch, "_fused_sgd_"), reason="this torch has no fused SGD kernel on the CPU")
def test_settle_momentum_buffers_keeps_fused_sgd_right_after_a_skipped_step():
    # The CPU's fused SGD kernel, as CUDA's: a first step that the GradScaler skips (an inf in the
    # gradients) must leave the next steps as plain SGD takes them.
    def trained(fused):
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
        guard.settle_momentum_buffers(optimizer)
        scaler = torch.amp.GradScaler("cpu")
        for x in [torch.full((2, 8), float("inf")), torch.ones(2, 8), -torch.ones(2, 8)]:
            optimizer.zero_grad()
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()
        return model.state_dict()

    fused, plain = trained(fused=True), trained(fused=False)
    for key in plain:
        torch.testing.assert_close(fused[key], plain[key], msg=key)


# ------------------------------------------------------------------------ communication hooks
def test_powersgd_hook_for_gloo_too_takes_one_bucket_at_a_time_on_gloo():
    # Eleven buckets of other sizes, compressed from the third step: had a rank's next bucket come before the last
    # one's second all-reduce, gloo would pair collectives of other buckets, and the ranks would wait for each other
    # until a timeout.
    ranks = in_gloo_world("""
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        torch.manual_seed(0)
        widths = [16 + 8 * i for i in range(12)]
        layers = [torch.nn.Linear(widths[i], widths[i + 1], bias=False) for i in range(11)]
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=0.001)
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                            min_compression_rate=0, use_error_feedback=False, warm_start=False)
        model.register_comm_hook(state, guard.powersgd_hook_for_gloo_too)
        guard.set_collective_timeout(10)
        for step in range(6):
            model.zero_grad()
            inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * rank + step))
            model(inputs).square().sum().backward()
        print(sum(p.grad.double().sum().item() for p in model.parameters()))
    """, ranks=2)
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr[-2000:]
    assert ranks[0].stdout == ranks[1].stdout != "", [r.stdout for r in ranks]
