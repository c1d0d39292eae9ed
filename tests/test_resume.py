"""Tests of train_ddp.py's resume that need no process group: one process, each in seconds."""
import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.utils.data.distributed import DistributedSampler

import guard
import train_ddp
from conftest import ROOT, clean_env, ok, run

pytestmark = [pytest.mark.timeout(120), pytest.mark.quick]


@pytest.mark.parametrize("before, after", [((2, 4, 1), (3, 2, 2)), ((4, 2, 1), (1, 8, 1)), ((3, 4, 1), (2, 3, 2)),
                                           ((3, 2, 2), (2, 4, 1))], ids=["2to3", "4to1", "3to2", "3to2-tail"])
def test_rest_of_epoch_trains_each_image_of_the_epoch_once_at_another_world_size(before, after):
    # An epoch of 96 images cut after a few optimizer steps of (world size, batch, accumulation) `before`, resumed at
    # `after`: the images trained are the epoch's own, each once, and all of them where the new step divides what is
    # left, as in an uninterrupted epoch; otherwise all but a tail shorter than one new step (3to2-tail: 36 + 56).
    images, epoch = list(range(96)), 5
    whole = DistributedSampler(images, num_replicas=1, rank=0, seed=0)
    whole.set_epoch(epoch)
    order = list(whole)

    def shards(layout, samples):
        world, batch, accum = layout
        for rank in range(world):
            sampler = DistributedSampler(images, num_replicas=world, rank=rank, seed=0)
            sampler.set_epoch(epoch)
            run = SimpleNamespace(samples=samples, steps_per_epoch=len(sampler) // (batch * accum),
                                  images_per_step=batch * accum * world)
            before_call = dict(vars(run))
            shard, step = train_ddp.rest_of_epoch(sampler, run)
            assert vars(run) == before_call  # unchanged
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


@pytest.mark.parametrize("warmup_epochs, samples, steps", [(0.3, 0, 21), (1, 112, 12)], ids=["fractional", "resumed"])
def test_learning_rate_warms_up_to_lr_and_never_above_it(warmup_epochs, samples, steps):
    # The warm-up's last step can end past --warmup-epochs: a warm-up of 0.3 epochs of 21 steps of 12 images, or a
    # resume after 112 images of 256 at 3 ranks x 4 (rest_of_epoch's 12 steps, to 256 images where 21 steps make
    # 252). That step takes --lr, not more; then the cosine.
    args = SimpleNamespace(lr=0.1, epochs=2, warmup_epochs=warmup_epochs)
    run = SimpleNamespace(epoch=0, samples=samples, steps_per_epoch=21, images_per_step=12)
    rates = []
    for run.epoch, steps_left in enumerate([steps, 21]):
        for _ in range(steps_left):
            rates.append(train_ddp.learning_rate(run, args))
            run.samples += run.images_per_step
        run.samples = 0
    peak = rates.index(max(rates))
    assert max(rates) == pytest.approx(args.lr) and max(rates) <= args.lr, rates
    assert rates[0] == pytest.approx(args.lr * (samples / 252 + 1 / 21) / warmup_epochs)
    assert rates[:peak + 1] == sorted(rates[:peak + 1]) and rates[peak:] == sorted(rates[peak:], reverse=True)


def test_load_checkpoint_reads_the_jobs_last_pt_once(tmp_path):
    # A restart resumes from its job's own last.pt: the file that decides it is this job's is the one
    # loaded, read once (a ResNet-50's is 190 MB, read by every rank of every node).
    last = tmp_path / "last.pt"
    args = {"arch": "resnet18", "batch_size": 8, "accum_steps": 1, "image_size": 32}
    model = torchvision.models.resnet18(num_classes=10).state_dict()
    torch.save({**dict.fromkeys(guard.CHECKPOINT_KEYS), "model": model, "args": args, "run_id": "job-7"}, last)
    code = f"""if True:
        import types, torch, train_ddp
        real_load, reads = torch.load, []
        def counted(*args, **kwargs):
            reads.append(args[0])
            return real_load(*args, **kwargs)
        torch.load = counted
        args = types.SimpleNamespace(checkpoint_dir={str(tmp_path)!r}, evaluate=False, resume=None,
                                     arch="resnet18", image_size_given=True, data=None, num_classes=10)
        path, checkpoint = train_ddp.load_checkpoint(args)
        print(path, checkpoint["run_id"], len(reads))"""
    env = clean_env(TORCHELASTIC_RUN_ID="job-7", TORCHELASTIC_RESTART_COUNT=1)
    result = ok(run([sys.executable, "-c", code], env=env, cwd=ROOT))
    assert result.stdout.split() == [str(last), "job-7", "1"], result.stdout


def test_load_checkpoint_refuses_a_model_for_other_classes_with_one_line(tmp_path, capsys):
    # Without the check, every rank's load_state_dict raised its size mismatch in the process group.
    path = tmp_path / "last.pt"
    model = torchvision.models.resnet18(num_classes=10).state_dict()
    args = {"arch": "resnet18", "batch_size": 8, "accum_steps": 1, "image_size": 32}
    torch.save({**dict.fromkeys(guard.CHECKPOINT_KEYS), "model": model, "args": args}, path)
    argv = ["--arch", "resnet18", "--resume", str(path), "--image-size", "32"]
    assert train_ddp.load_checkpoint(train_ddp.parse_args(argv))[0] == path
    with pytest.raises(SystemExit) as exit:
        train_ddp.load_checkpoint(train_ddp.parse_args(argv + ["--num-classes", "5"]))
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1, err
    assert (f"--resume {path}: fc is for 10 classes, not 5; expected the classes it was trained on "
            "(--num-classes, or the class folders of --data)") in err, err


def test_append_metrics_writes_null_for_a_figure_of_no_step_and_makes_its_folder(tmp_path):
    # An epoch resumed with less than a step left trains none: its train_loss is nan, which JSON parsers refuse.
    path = tmp_path / "new" / "m.jsonl"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        train_ddp.append_metrics(SimpleNamespace(metrics_file=str(path)), {"epoch": 2, "train_loss": math.nan})
    finally:
        dist.destroy_process_group()
    assert json.loads(path.read_text(), parse_constant=pytest.fail) == {"epoch": 2, "train_loss": None}


@pytest.mark.parametrize("saved", ["momentum 0", "some buffers"])
def test_a_resume_with_momentum_gives_every_parameter_a_buffer_zeros_where_the_checkpoint_has_none(
        saved, world_of_one):
    # A checkpoint saved with --momentum 0 has no momentum buffers, and one whose model had parameters that got no
    # gradient has some only. Resumed with momentum, fused SGD would make the missing ones with empty_like at its
    # first step (garbage, kept when the GradScaler skips that step), or, with some there, raise. Loaded as
    # train_ddp.restore_training_state loads it, every parameter has a buffer in its layout: the
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
    guard.settle_momentum_buffers(optimizer)
    run = SimpleNamespace(optimizer=optimizer, scaler=None)
    saved_state = {"optimizer": checkpoint, "scaler": {}, "rng": [], "epoch": 0, "samples": 0}
    train_ddp.restore_training_state(saved_state, run)
    for i, p in enumerate(model.parameters()):
        buffer = optimizer.state[p].get("momentum_buffer")
        assert buffer is not None and buffer.stride() == p.stride(), i
        want = checkpoint["state"][i]["momentum_buffer"] if i in had else torch.zeros_like(p)
        torch.testing.assert_close(buffer, want, rtol=0, atol=0, msg=str(i))

