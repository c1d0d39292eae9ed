"""Tests of guard.py's functions that need no process group: one process, each in milliseconds,
except those that start a Python process of their own to see what a fresh one reads."""
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image
from torch.utils.data.distributed import DistributedSampler

import guard
from conftest import ROOT, clean_env, noise_image, ok, run

pytestmark = [pytest.mark.timeout(120), pytest.mark.quick]


@pytest.mark.parametrize("before, after", [((2, 4, 1), (3, 2, 2)), ((4, 2, 1), (1, 8, 1)), ((3, 4, 1), (2, 3, 2)),
                                           ((3, 2, 2), (2, 4, 1))], ids=["2to3", "4to1", "3to2", "3to2-tail"])
def test_remaining_shard_trains_each_image_of_the_epoch_once_at_another_world_size(before, after):
    # An epoch of 96 images cut after a few optimizer steps of (world size, batch, accumulation) `before`, resumed at
    # `after`: the images trained are the epoch's own, each once, and all of them where the new step divides what is
    # left, as in an uninterrupted epoch; otherwise all but a tail shorter than one new step (3to2-tail: 36 + 56).
    images, epoch = list(range(96)), 5
    whole = DistributedSampler(images, num_replicas=1, rank=0, seed=0)
    whole.set_epoch(epoch)
    order = list(whole)

    def shards(layout, samples):
        world, batch, accum = layout
        args = SimpleNamespace(batch_size=batch, accum_steps=accum)
        for rank in range(world):
            sampler = DistributedSampler(images, num_replicas=world, rank=rank, seed=0)
            sampler.set_epoch(epoch)
            run = SimpleNamespace(samples=samples, steps_per_epoch=len(sampler) // (batch * accum))
            shard, step = guard.remaining_shard(sampler, run, args)
            assert vars(run) == {"samples": samples, "steps_per_epoch": run.steps_per_epoch}  # unchanged
            yield shard, step

    cut_steps = {(2, 4, 1): 6, (4, 2, 1): 5, (3, 4, 1): 2, (3, 2, 2): 3}[before]
    done = [i for shard, _ in shards(before, 0) for i in shard[: cut_steps * before[1] * before[2]]]
    cut = len(done)
    rest = [(shard, step) for shard, step in shards(after, cut)]
    seen = done + [i for shard, _ in rest for i in shard]
    assert len(seen) == len(set(seen))  # none twice
    assert sorted(seen) == sorted(order[: len(seen)])  # the epoch's order, from its start
    new_step = math.prod(after)
    assert len(images) - len(seen) < new_step and len({step for _, step in rest}) == 1
    if (len(images) - cut) % new_step == 0:
        assert sorted(seen) == images
        uninterrupted = [i for shard, _ in shards(after, 0) for i in shard]
        assert sorted(uninterrupted) == sorted(seen)


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


def test_load_checkpoint_reads_the_jobs_last_pt_once(tmp_path):
    # A restart resumes from its job's own last.pt: the file that decides it is this job's is the one
    # loaded, read once (a ResNet-50's is 190 MB, read by every rank of every node).
    last = tmp_path / "last.pt"
    args = {"arch": "resnet18", "batch_size": 8, "accum_steps": 1, "image_size": 32}
    torch.save({**dict.fromkeys(guard.CHECKPOINT_KEYS), "args": args, "run_id": "job-7"}, last)
    code = f"""if True:
        import types, torch, guard
        real_load, reads = torch.load, []
        def counted(*args, **kwargs):
            reads.append(args[0])
            return real_load(*args, **kwargs)
        torch.load = counted
        args = types.SimpleNamespace(checkpoint_dir={str(tmp_path)!r}, evaluate=False, resume=None,
                                     arch="resnet18", image_size_given=True)
        path, checkpoint = guard.load_checkpoint(args)
        print(path, checkpoint["run_id"], len(reads))"""
    env = clean_env(TORCHELASTIC_RUN_ID="job-7", TORCHELASTIC_RESTART_COUNT=1)
    result = ok(run([sys.executable, "-c", code], env=env, cwd=ROOT))
    assert result.stdout.split() == [str(last), "job-7", "1"], result.stdout


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
    jpeg = (tmp_path / "rgb.jpg").read_bytes()
    (tmp_path / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (tmp_path / "text.jpg").write_text("not an image")
    for name, reason in [("truncated.jpg", "truncated"), ("text.jpg", "cannot identify image file")]:
        with pytest.raises(guard.UnreadableImage, match=f"{tmp_path / name} .*{reason}"):
            guard.read_image(tmp_path / name)


@pytest.mark.skipif(not hasattr(torch, "_fused_sgd_"), reason="this torch has no fused SGD kernel on the CPU")
def test_start_momentum_at_zero_keeps_fused_sgd_right_after_a_skipped_step():
    # The CPU's fused SGD kernel, as CUDA's: a first step that the GradScaler skips (an inf in the
    # gradients) must leave the next steps as plain SGD takes them.
    def trained(fused):
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
        guard.start_momentum_at_zero(optimizer)
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


COLLECTIVE_FAILED = """
import sys, types
import torch.distributed as dist
import guard
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
guard.collective_failed(RuntimeError(sys.argv[1]), types.SimpleNamespace(collective_timeout=600))
"""


@pytest.mark.parametrize("text", [f"{words}\nException raised from checkAndAbortIfTimedOutOrError"
                                  for words in guard.NCCL2_FAILURES])
def test_collective_failed_takes_nccl2s_runtime_error_for_a_rank_gone(text):
    # torch 2.15's ProcessGroupNCCL2 raises a RuntimeError at the collective after a timeout, not the old class's
    # DistBackendError: still one line from the rank, and exit 1, not a traceback.
    result = run([sys.executable, "-c", COLLECTIVE_FAILED, text], env=clean_env(), cwd=ROOT, timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        "train_ddp.py: error: rank 0: a collective failed: another rank stopped, or stopped answering for "
        f"--collective-timeout 600 s; look for its own error ({text.splitlines()[0]})"]


def test_collective_failed_raises_any_other_error_as_it_is():
    result = run([sys.executable, "-c", COLLECTIVE_FAILED, "CUDA out of memory"], env=clean_env(), cwd=ROOT,
                 timeout=60)
    assert result.returncode == 1 and result.stderr.splitlines()[-1].endswith("RuntimeError: CUDA out of memory")


@pytest.mark.parametrize("saved", ["momentum 0", "some buffers"])
def test_a_resume_with_momentum_gives_every_parameter_a_buffer_zeros_where_the_checkpoint_has_none(saved):
    # A checkpoint saved with --momentum 0 has no momentum buffers, and one whose model had parameters that got no
    # gradient has some only. Resumed with momentum, fused SGD would make the missing ones with empty_like at its
    # first step (garbage, kept when the GradScaler skips that step), or, with some there, raise. Loaded as
    # train_ddp.py's restore_training_state loads it, every parameter has a buffer in its layout: the
    # checkpoint's where it had one, zeros where not.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    model = model.to(memory_format=torch.channels_last)
    # Saved by an earlier version, which left the buffers to SGD (today's start with all of them).
    before = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if saved == "momentum 0" else 0.9)
    trained = model if saved == "momentum 0" else model[0]  # the rest gets no gradient, and no buffer
    trained(torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)).square().sum().backward()
    before.step()
    checkpoint = before.state_dict()
    had = {i for i, state in checkpoint["state"].items() if state.get("momentum_buffer") is not None}
    assert len(had) == (0 if saved == "momentum 0" else 2), checkpoint["state"]

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard.start_momentum_at_zero(optimizer)
    settings = guard.optimizer_settings(optimizer)
    optimizer.load_state_dict(checkpoint)
    guard.restore_optimizer_settings(optimizer, settings)
    for i, p in enumerate(model.parameters()):
        buffer = optimizer.state[p].get("momentum_buffer")
        assert buffer is not None and buffer.stride() == p.stride(), i
        want = checkpoint["state"][i]["momentum_buffer"] if i in had else torch.zeros_like(p)
        torch.testing.assert_close(buffer, want, rtol=0, atol=0, msg=str(i))
