"""Tests of guard.py's functions that need no process group: one process, each in milliseconds,
except those that start a Python process of their own to see what a fresh one reads."""
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image

import guard
from conftest import ROOT, clean_env, noise_image, run

pytestmark = [pytest.mark.timeout(120), pytest.mark.quick]


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


