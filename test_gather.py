"""Tests for gather_utils.py, run on every rank of a real process group.

    torchrun --nproc_per_node 3 test_gather.py                  # gloo, CPU tensors
    torchrun --nproc_per_node 2 test_gather.py --device cuda    # gloo, CUDA tensors
    torchrun --nproc_per_node 1 test_gather.py --backend nccl   # NCCL (one process per GPU)

Rank 0 prints each failing check and, last, `N passed, N failed`; the exit code is non-zero
on any failure. Once a check's collectives time out (20 s), every rank stops there, and the
checks after it are reported as not run. With `--report PATH`, rank 0 also writes each check's
result there as JSON.
pytest collects this file too: it starts torchrun once for each world size 1 to 4 on gloo and
reports each check of each launch as a test of its own, runs every check in-process without a
process group (a world of one), and runs the GPU variants when CUDA is present.
"""

import argparse
import copy
import datetime
import functools
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import gather_utils as gu

# Those this torch has: uint16, uint32 and uint64 arrive in torch 2.3.
ALL_DTYPES = [getattr(torch, name) for name in [
    "bool", "uint8", "uint16", "uint32", "uint64",
    "int8", "int16", "int32", "int64", "float8_e4m3fn", "float8_e5m2",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
] if hasattr(torch, name)]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Checks: each runs on every rank with the same arguments. Each rank builds its own input from
# its rank, so every rank also knows what the others sent and what the result must be. The checks
# that take `width` run twice under torchrun: with rows of 3 elements, which ride in the header, and
# with rows of LARGE, which do not fit in its room whatever the dtype, so that the data moves after it.

SMALL, LARGE = 3, 8200
BACKEND = "gloo"  # what this launch moves gather_utils' data with: set by main() from its own arguments


def rows_for(rank, device, dtype=torch.float32, width=SMALL):
    """Rank r sends (r + 1) % 3 rows (rank 2 sends none), each row filled from the rank number."""
    n = (rank + 1) % 3
    values = torch.arange(n * width, dtype=torch.float64).view(n, width) + 100 * rank
    return values.to(dtype).to(device)


def expected_concat(world, device, dtype=torch.float32, width=SMALL):
    return torch.cat([rows_for(r, device, dtype, width) for r in range(world)])


def check_get_rank_and_world_size(device, group=None):
    expected = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    assert (gu.get_rank(group), gu.get_world_size(group)) == expected


def check_all_gather_concat_uneven(device, group=None, width=SMALL):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    out = gu.all_gather_concat(rows_for(rank, device, width=width), group)
    assert torch.equal(out, expected_concat(world, device, width=width)), out
    assert out.device == rows_for(rank, device).device


def check_all_gather_concat_equal(device, group=None, width=SMALL):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    local = torch.full((4, width), float(rank), device=device)
    out = gu.all_gather_concat(local, group)
    assert torch.equal(
        out, torch.arange(world, device=device).repeat_interleave(4).float()[:, None].expand(-1, width)
    )


def check_all_gather_concat_every_dtype(device, group=None, width=SMALL):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    for dtype in ALL_DTYPES:
        out = gu.all_gather_concat(rows_for(rank, device, dtype, width), group)
        assert out.dtype == dtype, dtype
        # Compared as bytes: torch.cat and torch.equal refuse float8 before torch 2.5.
        expected = expected_concat(world, device, width=width).to(dtype)
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), dtype


def check_all_gather_concat_zero_dim(device, group=None):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    out = gu.all_gather_concat(torch.tensor(rank * 1.5, device=device), group)
    assert torch.equal(out, torch.arange(world, device=device) * 1.5)


def check_all_gather_concat_non_contiguous_and_input_unchanged(device, group=None, width=SMALL):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    local = rows_for(rank, device, width=2 * width)[:, ::2]
    assert local.numel() == 0 or not local.is_contiguous()
    before = local.clone()
    out = gu.all_gather_concat(local, group)
    assert torch.equal(out, expected_concat(world, device, width=2 * width)[:, ::2])
    assert torch.equal(local, before)
    out.add_(1)  # the result must not alias the input, even in a world of one
    assert torch.equal(local, before)


def check_all_gather_concat_result_owns_its_memory(device, group=None, width=SMALL):
    """From a contiguous input too, which a world of one could hand back as it is, and from a 0-d
    one, which it could reshape: writing to the result leaves the input as it was."""
    rank = gu.get_rank(group)
    for local in (rows_for(rank, device, width=width), torch.tensor(float(rank), device=device)):
        before = local.clone()
        for async_op in (False, True):
            out = gu.all_gather_concat(local, group, async_op=async_op)
            (out.wait() if async_op else out).add_(1)
            assert torch.equal(local, before), async_op


def check_all_gather_concat_async(device, group=None, width=SMALL):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    handle = gu.all_gather_concat(rows_for(rank, device, width=width), group, async_op=True)
    assert isinstance(handle, gu.GatherHandle)
    out = handle.wait()
    assert torch.equal(out, expected_concat(world, device, width=width))
    assert handle.wait() is out


def poll_until_completed(handle, limit=30):
    """Poll `handle.is_completed()` until it says True or `limit` seconds pass, each call between
    two reads of the handle's collectives, whose states only ever turn true: so it must never say
    True while one of them is still running, nor False once all have finished, whatever the timing.
    Returns what went wrong, or "" if nothing."""
    deadline = time.monotonic() + limit
    while True:
        finished_before = all(work.is_completed() for work in handle._works)
        completed = handle.is_completed()
        finished_after = all(work.is_completed() for work in handle._works)
        if completed and not finished_after:
            return "is_completed() said True while a collective was still running"
        if finished_before and not completed:
            return "is_completed() said False after every collective had finished"
        if completed:
            return ""
        if time.monotonic() > deadline:
            return f"is_completed() still False {limit} s after the call, before wait()"
        time.sleep(0.001)


def check_async_returns_with_the_data_in_flight(device, group=None):
    """Rank 1 sends 256 MiB, which takes it at least a tenth of a second to copy and send: rank
    0's call returns before it can have arrived, with the data collectives issued but unfinished;
    wait() finishes them. Every rank polls is_completed() meanwhile (poll_until_completed): rank
    1's data keeps one collective running on each rank long after the others have finished, the
    window where an is_completed() true too early shows."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    size = 256 << 20 if rank == 1 else 4 * LARGE
    local = torch.full((size // 4,), float(rank), device=device)
    handle, issued = collectives_run(group, functools.partial(gu.all_gather_concat, async_op=True), local)
    in_flight = not handle.is_completed()
    wrong = poll_until_completed(handle)
    assert issued == 1 + data_collectives(world, equal=world == 1)
    out = handle.wait()  # on every rank, so that the group stays aligned whatever this rank saw
    assert not wrong, wrong
    assert all(work.is_completed() for work in handle._works)
    assert in_flight or rank != 0 or world == 1
    sizes = [256 << 20 if r == 1 else 4 * LARGE for r in range(world)]
    assert torch.equal(out, torch.cat([torch.full((n // 4,), float(r), device=device) for r, n in enumerate(sizes)]))


def check_gather_handle_completes_before_wait(device, group=None, width=SMALL):
    """is_completed() turns true once the collectives have finished, without wait(), and never
    before (poll_until_completed): at once where no collective is left to run, as the data came
    with the header, or no process group moves any. A world of one with a process group still
    broadcasts its own data past the header's room."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    handle = gu.all_gather_concat(rows_for(rank, device, width=width), group, async_op=True)
    sizes = [rows_for(r, device, width=width).numel() * 4 for r in range(world)]
    in_header = max(sizes) <= header_room(world)
    at_once = handle.is_completed()
    wrong = poll_until_completed(handle)
    out = handle.wait()  # on every rank, so that the group stays aligned whatever this rank saw
    assert at_once or not (in_header or not dist.is_initialized())
    assert not wrong, wrong
    assert torch.equal(out, expected_concat(world, device, width=width))


def rank_loss(gathered, r):
    """A loss that rank r computes from gathered rows: it weighs each element its own way."""
    weights = torch.arange(gathered.numel(), device=gathered.device).view_as(gathered) % (r + 2)
    return (weights * gathered**2).sum() + r * gathered.sum()


def check_all_gather_concat_gradient(device, group=None, width=SMALL):
    """Each rank's input gets the gradient of the sum of every rank's loss, as one process
    computing all of them on the concatenated rows would give it (uneven rows, 0 included)."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    everyone = expected_concat(world, device, torch.float64, width).requires_grad_()
    (want,) = torch.autograd.grad(sum(rank_loss(everyone, r) for r in range(world)), everyone)
    start = sum(len(rows_for(r, device)) for r in range(rank))
    want = want[start : start + len(rows_for(rank, device))]
    for async_op in (False, True):
        local = rows_for(rank, device, torch.float64, width).requires_grad_()
        out = gu.all_gather_concat(local, group, async_op=async_op)
        out = out.wait() if async_op else out
        assert torch.equal(out.detach(), everyone.detach())
        (grad,) = torch.autograd.grad(rank_loss(out, rank), local)
        assert torch.allclose(grad, want), (grad, want)
    local = rows_for(rank, device, torch.float64, width).requires_grad_()
    out = gu.all_gather_concat(local, group).mul_(2)  # in place, as any result allows
    (grad,) = torch.autograd.grad(rank_loss(out / 2, rank), local)
    assert torch.allclose(grad, want), (grad, want)
    local = torch.tensor(float(rank), device=device, requires_grad=True)  # 0-d: one row
    (grad,) = torch.autograd.grad(gu.all_gather_concat(local, group)[0], local)  # every rank's loss: row 0
    assert grad.item() == (world if rank == 0 else 0)


def check_all_gather_concat_gradient_leaves_the_incoming_one_alone(device, group=None):
    """The backward sums a copy of the gradient it is given: autograd may hand that same tensor
    to another branch of the graph, or it is the caller's own `grad_outputs`; either keeps its
    values."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    weights = torch.arange(3 * world, dtype=torch.float64, device=device).view(world, 3) + 1
    local = torch.full((1, 3), float(rank), dtype=torch.float64, device=device, requires_grad=True)
    other = torch.zeros(world, 3, dtype=torch.float64, device=device, requires_grad=True)
    twice = other * 2  # before the gather, so that its backward runs after the gather's
    ((gu.all_gather_concat(local, group) + twice) * weights).sum().backward()
    want = world * weights[rank : rank + 1]
    assert torch.equal(other.grad, 2 * weights) and torch.equal(local.grad, want)
    given = weights.clone()
    local.grad = None
    gu.all_gather_concat(local, group).backward(given)
    assert torch.equal(given, weights) and torch.equal(local.grad, want)


def check_all_gather_tensors_gradient(device, group=None):
    rank, world = gu.get_rank(group), gu.get_world_size(group)

    def tensor_for(r):  # a different shape on each rank, rank 1's empty
        values = torch.arange(0 if r == 1 else r + 1, dtype=torch.float64, device=device) + r
        return values.view(-1, 1) if r % 2 == 0 else values

    def loss(tensors, r):
        return sum(rank_loss(t, r + q) for q, t in enumerate(tensors))

    everyone = [tensor_for(r).requires_grad_() for r in range(world)]
    want = torch.autograd.grad(sum(loss(everyone, r) for r in range(world)), everyone)[rank]
    local = tensor_for(rank).requires_grad_()
    out = gu.all_gather_tensors(local, group)
    assert all(torch.equal(t.detach(), tensor_for(r)) for r, t in enumerate(out))
    (grad,) = torch.autograd.grad(loss(out, rank), local)
    assert torch.allclose(grad, want), (grad, want)


def check_no_grad_path_unchanged(device, group=None, width=SMALL):
    """Inputs that do not require grad give results without grad, and gather_for_metrics never
    keeps a graph, from an input that requires grad too. Under no_grad no backward will run, so
    the input may require grad on some ranks only: both gathers take it, with every rank's rows.
    (That results made under no_grad have no grad is torch's own rule, not gather_utils'.)"""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    plain = rows_for(rank, device, width=width)
    everyone = expected_concat(world, device, width=width)
    outputs = [gu.all_gather_concat(plain, group), *gu.all_gather_tensors(plain, group)]
    with torch.no_grad():
        for local in (plain.clone().requires_grad_(), plain.clone().requires_grad_(rank == 1)):
            assert torch.equal(gu.all_gather_concat(local, group), everyone)
            out = gu.all_gather_tensors(local, group)
            assert all(torch.equal(t, rows_for(r, device, width=width)) for r, t in enumerate(out))
    indices = torch.arange(rank, 3 * world, world, device=device)
    scores = (indices[:, None] * 1.5).requires_grad_()
    outputs.append(gu.gather_for_metrics(scores, indices, 3 * world, group))
    assert torch.equal(outputs[-1], torch.arange(3 * world, device=device)[:, None] * 1.5)
    assert all(not t.requires_grad and t.grad_fn is None for t in outputs)


def contrastive_loss(model, x1, x2, gather, offset):
    """InfoNCE summed over this rank's rows: view 1 of each row against view 2 of every row."""
    z1, z2 = F.normalize(model(x1), dim=1), F.normalize(model(x2), dim=1)
    logits = z1 @ gather(z2).T / 0.1
    labels = torch.arange(len(z1), device=z1.device) + offset
    return F.cross_entropy(logits, labels, reduction="sum")


def check_contrastive_loss_under_ddp(device, group=None):
    """DDP with a global-batch contrastive loss through all_gather_concat, uneven rows per rank:
    after 3 SGD steps, the same weights as one process training on the whole batch."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    counts = [2 + r % 2 for r in range(world)]
    total, start = sum(counts), sum(counts[:rank])
    generator = torch.Generator().manual_seed(0)
    x1 = torch.randn(total, 5, generator=generator, dtype=torch.float64).to(device)
    x2 = x1 + 0.3 * torch.randn(total, 5, generator=generator, dtype=torch.float64).to(device)
    torch.manual_seed(0)
    reference = torch.nn.Linear(5, 4).double().to(device)
    initial = copy.deepcopy(reference)
    model = DDP(
        copy.deepcopy(reference),
        process_group=group,
        device_ids=[device] if device.type == "cuda" else None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    mine = slice(start, start + counts[rank])
    for _ in range(3):
        optimizer.zero_grad()
        # DDP averages the ranks' gradients: scaled so, the average is that of the global mean.
        loss = contrastive_loss(model, x1[mine], x2[mine], lambda z: gu.all_gather_concat(z, group), start)
        (loss * world / total).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        (contrastive_loss(reference, x1, x2, lambda z: z, 0) / total).backward()
        ref_optimizer.step()
    for trained, want, before in zip(model.module.parameters(), reference.parameters(), initial.parameters()):
        assert not torch.allclose(want, before)
        assert torch.allclose(trained, want, rtol=0, atol=1e-12), (trained, want)


def check_bad_input_requires_grad_on_one_rank(device, group=None):
    rank = gu.get_rank(group)
    local = torch.zeros(2, device=device, requires_grad=rank == 1)
    for fn in (gu.all_gather_concat, gu.all_gather_tensors):
        expect_error(ValueError, lambda: fn(local, group), "on every rank or on none", "rank 1: yes", "rank 0: no")
    check_group_still_works(device, group)


def check_all_gather_tensors_any_shape(device, group=None):
    rank, world = gu.get_rank(group), gu.get_world_size(group)

    def tensor_for(r):  # rank 0 sends a 0-d tensor, rank 1 an empty one, rank r > 1 has r dims
        if r == 0:
            return torch.tensor(7, device=device)
        if r == 1:
            return torch.zeros(0, 2, dtype=torch.int64, device=device)
        return torch.arange(2**r, device=device).view([2] * r)

    out = gu.all_gather_tensors(tensor_for(rank), group)
    assert len(out) == world
    for r in range(world):
        assert out[r].shape == tensor_for(r).shape, (r, out[r].shape)
        assert torch.equal(out[r], tensor_for(r))
    # 12 dims, the most a header's shape holds.
    deep = gu.all_gather_tensors(torch.full([1] * 11 + [rank + 1], rank, device=device), group)
    assert [t.shape for t in deep] == [(1,) * 11 + (r + 1,) for r in range(world)]
    assert all(torch.equal(t, torch.full_like(t, r)) for r, t in enumerate(deep))


def check_all_gather_tensors_results_own_their_memory(device, group=None, width=SMALL):
    """The results are views into one new buffer, none into another's or the input's: writing to
    each changes that one alone."""
    rank = gu.get_rank(group)
    local = rows_for(rank, device, width=width)
    before = local.clone()
    out = gu.all_gather_tensors(local, group)
    for t in out:
        t.add_(1)
    assert torch.equal(local, before)
    assert all(torch.equal(t, rows_for(r, device, width=width) + 1) for r, t in enumerate(out))


def check_all_gather_object(device, group=None, width=SMALL):
    rank, world = gu.get_rank(group), gu.get_world_size(group)

    def obj_for(r):
        if r == 1:
            return None
        weight = torch.nn.Parameter(torch.full((2,), float(r)), requires_grad=r % 2 == 0)
        return {"rank": r, "name": "x" * r * width, "t": torch.full((r,), float(r)), "p": weight}

    local = obj_for(rank)
    if local is not None:
        local["t"] = local["t"].to(device)
        local["p"] = torch.nn.Parameter(local["p"].to(device), local["p"].requires_grad)
    out = gu.all_gather_object(local, group)
    assert len(out) == world
    for r in range(world):
        want = obj_for(r)
        if want is None:
            assert out[r] is None
            continue
        assert out[r]["rank"] == r and out[r]["name"] == want["name"]
        assert out[r]["t"].device.type == out[r]["p"].device.type == "cpu"  # never another rank's GPU
        assert torch.equal(out[r]["t"], want["t"])
        # A Parameter stays one, from a GPU too, with its requires_grad.
        assert type(out[r]["p"]) is torch.nn.Parameter and out[r]["p"].requires_grad == (r % 2 == 0)
        assert torch.equal(out[r]["p"].detach(), want["p"].detach())


def check_all_reduce_mean_tensor(device, group=None):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    mean = sum(range(world)) / world
    local = torch.full((2, 3), float(rank), device=device, requires_grad=True) * 1  # a live tensor
    out = gu.all_reduce_mean(local, group)
    assert not out.requires_grad and out.shape == (2, 3) and out.dtype == torch.float32
    assert torch.allclose(out, torch.full((2, 3), mean, device=device))
    assert torch.equal(local, torch.full((2, 3), float(rank), device=device))  # input untouched
    ints = gu.all_reduce_mean(torch.tensor([rank, 1], device=device), group)
    assert ints.dtype == torch.float64 and ints.tolist() == [mean, 1.0]
    # Floats under 32 bits are summed in float32. Summed in bfloat16, 256 + 1 would round back to 256, and from 3
    # ranks on the mean of [256, 1, 1, ...] would come out lower; in float8_e5m2, 57344 + 57344 would be inf.
    half = gu.all_reduce_mean(torch.tensor(256.0 if rank == 0 else 1.0, dtype=torch.bfloat16, device=device), group)
    assert half.dtype == torch.bfloat16 and half.item() == torch.tensor((255 + world) / world).bfloat16().item()
    assert world < 3 or half.item() != torch.tensor(256 / world).bfloat16().item()
    eighth = gu.all_reduce_mean(torch.tensor(57344.0, device=device).to(torch.float8_e5m2), group)
    assert eighth.dtype == torch.float8_e5m2 and eighth.float().item() == 57344
    # The CPU cannot sum complex32: it is summed as complex64 and returned as complex32. torch warns once, at
    # the first complex32 tensor, that the dtype is experimental: this test's choice, not gather_utils' doing.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "ComplexHalf support is experimental")
        chalf = gu.all_reduce_mean(torch.full((2,), complex(rank, 1), device=device).to(torch.complex32), group)
    assert chalf.dtype == torch.complex32
    assert torch.equal(chalf.to(torch.complex64), torch.full((2,), complex(mean, 1), device=device))
    # Past the header's room, and column-major on even ranks: values must meet by index, not by memory.
    values = torch.arange(64 * 64, dtype=torch.float32, device=device).view(64, 64)
    local = values * (rank + 1)
    local = local.t().contiguous().t() if rank % 2 == 0 else local
    assert torch.equal(gu.all_reduce_mean(local, group), values * (sum(range(1, world + 1)) / world))
    assert gu.all_reduce_mean(torch.zeros(0, 3, device=device), group).shape == (0, 3)


def check_all_reduce_mean_leaves_its_input_alone(device, group=None, width=SMALL):
    """Also where the sum runs in the input's own dtype, in place past the header's room, the input
    keeps its values, and the result is new memory, in a world of one too."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    values = torch.arange(4 * width, device=device).view(4, width)
    for dtype in (torch.float32, torch.float64, torch.complex64):
        local = (values + rank).to(dtype)
        before = local.clone()
        out = gu.all_reduce_mean(local, group)
        assert torch.equal(local, before), dtype
        # Close, not equal: torch 2.3 divides complex64 by a scalar up to 1 ulp off.
        assert torch.allclose(out, (values + (world - 1) / 2).to(dtype)), dtype
        out.add_(1)
        assert torch.equal(local, before), dtype


def check_all_reduce_mean_sums_integers_exactly(device, group=None, width=SMALL):
    """Integer and bool tensors are summed in float64, exact for any count: past 2**24, float32
    would round."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    counts = torch.full((width,), 2**24 + 1 + 2 * rank, dtype=torch.int64, device=device)
    out = gu.all_reduce_mean(counts, group)
    assert out.dtype == torch.float64 and out.tolist() == [float(2**24 + world)] * width
    flags = gu.all_reduce_mean(torch.tensor([rank % 2 == 0, True], device=device), group)
    assert flags.dtype == torch.float64 and flags.tolist() == [(world + 1) // 2 / world, 1.0]
    full_bytes = gu.all_reduce_mean(torch.full((2,), 255, dtype=torch.uint8, device=device), group)
    assert full_bytes.tolist() == [255.0, 255.0]


def check_all_reduce_mean_keeps_64_bit_precision(device, group=None):
    """float64 and complex128 are summed in their own dtype: in 32 bits, 1 + 2**-40 would round
    to 1."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    tiny, share = 2.0**-40, (rank + 1) * 2.0**-40
    mean = 1 + tiny * (world + 1) / 2
    local = torch.tensor([1 + share], dtype=torch.float64, device=device)
    out = gu.all_reduce_mean(local, group)
    assert out.dtype == torch.float64 and abs(out.item() - mean) < tiny / 16, (out.item(), mean)
    local = torch.tensor([complex(-share, 1 + share)], dtype=torch.complex128, device=device)
    out = gu.all_reduce_mean(local, group)
    assert out.dtype == torch.complex128, out.dtype
    assert abs(out.item() - complex(1 - mean, mean)) < tiny / 16, out


def check_all_reduce_mean_dict(device, group=None):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    # Keys in a different order on each rank; a count that float32 could not hold exactly.
    # One-element tensors of any shape count as numbers, as detectron2's reduce_dict passes them.
    items = [
        ("count", 2**40 + rank),
        ("loss", torch.tensor(float(rank), device=device)),
        ("flag", True),
        ("acc", torch.tensor([[rank]], dtype=torch.int32, device=device)),
        ("lr", torch.tensor([0.5], device=device)),
    ]
    local = dict(items[rank % 5 :] + items[: rank % 5])
    out = gu.all_reduce_mean(local, group)
    assert list(out) == list(local)
    assert all(isinstance(v, float) for v in out.values())
    assert out["count"] == (world * 2**40 + sum(range(world))) / world
    assert out["loss"] == out["acc"] == sum(range(world)) / world
    assert out["flag"] == 1.0 and out["lr"] == 0.5
    assert gu.all_reduce_mean({}, group) == {}


def check_all_gather_concat_lazy_views(device, group=None):
    """conj() and neg-bit views hold no plain bytes until resolved; they must gather like any tensor."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    local = torch.full((2,), complex(rank, 1), device=device).conj()
    want = torch.tensor([complex(r, -1) for r in range(world) for _ in range(2)], device=device)
    assert torch.equal(gu.all_gather_concat(local, group), want)
    assert torch.equal(gu.all_gather_concat(local.imag, group), want.imag)  # a neg-bit view
    assert torch.equal(gu.all_reduce_mean(local, group), want.mean().expand(2))


def check_gather_for_metrics_zero_width_rows(device, group=None):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    out = gu.gather_for_metrics(torch.empty(1, 0, device=device), torch.tensor([rank]), world, group)
    assert out.shape == (world, 0)


def check_gather_for_metrics_keeps_first_duplicate(device, group=None):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    results = torch.tensor([[rank, 0], [rank, 1], [rank, 2]], device=device)
    indices = torch.tensor([rank, rank, world], device=device)  # sample `world` on every rank
    out = gu.gather_for_metrics(results, indices, world + 1, group)
    want = [[r, 0] for r in range(world)] + [[0, 2]]
    assert out.tolist() == want


def gather_for_metrics_case(device, group, num_samples, shuffle, width=SMALL):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    sampler = DistributedSampler(range(num_samples), num_replicas=world, rank=rank, shuffle=shuffle, seed=3)
    indices = torch.tensor(list(iter(sampler)), dtype=torch.int64)
    # Row i is the "prediction" for sample i: `width` columns, recoverable from i alone. Built in a
    # few tensor operations, not one per column: past the header's room a row has 8,200 columns.
    def rows(i):
        first_two = torch.stack([i * 10, i % 7], dim=1)
        return torch.cat([first_two, i[:, None] + torch.arange(width - 2)], dim=1)

    out = gu.gather_for_metrics(rows(indices).to(device), indices.to(device), num_samples, group)
    assert out.shape == (num_samples, width) and out.device.type == device.type
    assert torch.equal(out.cpu(), rows(torch.arange(num_samples)))


def check_gather_for_metrics_drops_sampler_padding(device, group=None, width=SMALL):
    for num_samples in (1, 2, 5, 11, 12, 1031):  # not divisible by 2, 3 or 4, below the world size, and large
        for shuffle in (False, True):
            gather_for_metrics_case(device, group, num_samples, shuffle, width)


def check_gather_for_metrics_every_dtype(device, group=None):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    indices = torch.arange(rank, 5, world)  # 5 samples dealt out, none on ranks past 4

    def rows(i, dtype):
        return (i.double()[:, None] * torch.tensor([1.0, 3.0], dtype=torch.float64) + 0.5).to(dtype)

    for dtype in ALL_DTYPES:
        out = gu.gather_for_metrics(rows(indices, dtype).to(device), indices.to(device), 5, group)
        assert out.dtype == dtype and out.shape == (5, 2), dtype
        # Compared as bytes: torch.equal refuses float8 before torch 2.5.
        want = rows(torch.arange(5), dtype)
        assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8)), dtype


def check_gather_for_metrics_takes_any_integer_indices(device, group=None):
    """Indices of any integer dtype, or a list of ints, give what int64 indices give."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    indices = torch.arange(world - 1 - rank, 3 * world, world)  # rank 0 holds the last samples
    results = (indices * 10).float()[:, None].to(device)
    want = (torch.arange(3 * world) * 10).float()[:, None]
    for form in (torch.int32, torch.int16, torch.uint8, list):
        given = indices.tolist() if form is list else indices.to(form).to(device)
        out = gu.gather_for_metrics(results, given, 3 * world, group)
        assert torch.equal(out.cpu(), want), form


def check_gather_for_metrics_ranks_with_nothing(device, group=None, width=SMALL):
    """Ranks without rows take part: every sample on the last rank, then none at all (num_samples
    0). The result is the caller's own: writing to it leaves the input as it was, also where the
    rows are in dataset order, which a world of one could hand back as they are."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    none = torch.zeros(0, dtype=torch.int64)
    for order in ([3, 0, 4, 1, 2], [0, 1, 2, 3, 4]):
        indices = torch.tensor(order) if rank == world - 1 else none
        results = (indices[:, None] * width + torch.arange(width)).float().to(device)
        before = results.clone()
        out = gu.gather_for_metrics(results, indices.to(device), 5, group)
        assert torch.equal(out, torch.arange(5 * width, device=device).view(5, -1).float()), order
        out.add_(1)
        assert torch.equal(results, before), order
    empty = torch.zeros(0, width, device=device)
    out = gu.gather_for_metrics(empty, torch.zeros(0, dtype=torch.int64, device=device), 0, group)
    assert out.shape == (0, width) and out.dtype == torch.float32


def check_gather_for_metrics_names_the_rank_of_a_bad_index(device, group=None):
    """An index outside range(num_samples), below or past it, is named with the rank that holds it,
    the same on every rank: also as that rank's first row, after a rank with no rows (rank 1)."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    counts = [0 if r == 1 else 2 for r in range(world)]
    num_samples = sum(counts)
    results = torch.zeros(counts[rank], 1, device=device)
    for culprit in [r for r in range(world) if counts[r]]:
        for bad in (-1, num_samples):
            indices = torch.arange(sum(counts[:rank]), sum(counts[: rank + 1]), device=device)
            if rank == culprit:
                indices[0] = bad
            expect_error(
                ValueError,
                lambda: gu.gather_for_metrics(results, indices, num_samples, group),
                f"rank {culprit} holds index {bad}, outside range(num_samples={num_samples})",
            )


def expect_error(exc_type, fn, *words):
    try:
        fn()
    except exc_type as error:
        message = str(error)
    else:
        raise AssertionError(f"no {exc_type.__name__} raised")
    for word in words:
        assert word in message, (word, message)


def expect_rank_1_error(group, exc_type, fn, *words):
    """Rank 1 passed bad input: it raises `exc_type` naming `words`, every other rank a ValueError
    naming rank 1."""
    if gu.get_rank(group) == 1:
        expect_error(exc_type, fn, *words)
    else:
        expect_error(ValueError, fn, "rank 1 passed invalid input")


def check_group_still_works(device, group=None):
    """After a raised error, the next collectives on the same group must still line up, in and after the header."""
    check_all_gather_concat_uneven(device, group)
    check_all_gather_concat_uneven(device, group, LARGE)
    check_all_reduce_mean_dict(device, group)


def check_bad_input_dtype_mismatch(device, group=None):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    local = torch.zeros(2, 3, device=device, dtype=torch.float32 if rank else torch.float64)
    expect_error(
        ValueError,
        lambda: gu.all_gather_concat(local, group),
        "rank 0: float64[2, 3]",
        f"rank {world - 1}: float32[2, 3]",
    )
    expect_error(ValueError, lambda: gu.all_gather_tensors(local, group), "same dtype", "rank 0: float64")
    expect_error(ValueError, lambda: gu.all_reduce_mean(local, group), "same shape and dtype")
    indices = torch.tensor([rank, rank + world], device=device)
    gather = functools.partial(gu.gather_for_metrics, local, indices, 2 * world, group)
    expect_error(ValueError, gather, "rank 0: float64[2, 3]")
    check_group_still_works(device, group)


def check_bad_input_trailing_shape_mismatch(device, group=None):
    rank = gu.get_rank(group)
    local = torch.zeros(2, 3 + rank, device=device)
    expect_error(
        ValueError,
        lambda: gu.all_gather_concat(local, group),
        "rank 0: float32[2, 3]",
        "rank 1: float32[2, 4]",
    )
    world = gu.get_world_size(group)
    indices = torch.tensor([rank, rank + world], device=device)
    gather = functools.partial(gu.gather_for_metrics, local, indices, 2 * world, group)
    expect_error(ValueError, gather, "rank 1: float32[2, 4]")
    check_group_still_works(device, group)


def check_bad_input_ndim_mismatch_same_numel(device, group=None):
    rank = gu.get_rank(group)
    local = torch.zeros(6, device=device) if rank == 1 else torch.zeros(2, 3, device=device)
    expect_error(
        ValueError, lambda: gu.all_gather_concat(local, group), "rank 0: float32[2, 3]", "rank 1: float32[6]"
    )
    expect_error(ValueError, lambda: gu.all_reduce_mean(local, group), "rank 1: float32[6]")
    check_group_still_works(device, group)


def check_bad_input_not_a_tensor_on_one_rank(device, group=None):
    rank = gu.get_rank(group)
    local = [1, 2, 3] if rank == 1 else torch.zeros(3, device=device)
    for fn in (gu.all_gather_concat, gu.all_gather_tensors, gu.all_reduce_mean):
        expect_rank_1_error(group, TypeError, lambda: fn(local, group), "expected a torch.Tensor", "got list")
    unpicklable = (lambda: 0) if rank == 1 else rank
    expect_rank_1_error(
        group, TypeError, lambda: gu.all_gather_object(unpicklable, group), "could not pickle"
    )
    check_group_still_works(device, group)


def check_bad_input_on_several_ranks(device, group=None):
    """Every rank that passed bad input is named, on the ranks that did not."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    local = [1, 2] if rank > 0 else torch.zeros(2, device=device)
    bad = ", ".join(str(r) for r in range(1, world))
    gather = functools.partial(gu.all_gather_concat, local, group)
    if rank == 0:
        expect_error(ValueError, gather, f"rank {bad} passed invalid input")
    else:
        expect_error(TypeError, gather, "expected a torch.Tensor")
    check_group_still_works(device, group)


def check_bad_input_tensor_and_dict_mixed(device, group=None):
    rank = gu.get_rank(group)
    local = {"loss": 1.0} if rank == 1 else torch.ones(1, device=device)
    expect_error(
        ValueError, lambda: gu.all_reduce_mean(local, group), "same kind of input", "rank 0: a tensor; rank 1: a dict"
    )
    check_group_still_works(device, group)


def check_bad_input_dict_keys_differ(device, group=None):
    rank = gu.get_rank(group)
    local = {"loss": 1.0, "extra": 2.0} if rank == 1 else {"loss": 1.0}
    expect_error(
        ValueError, lambda: gu.all_reduce_mean(local, group), "same keys", "rank 1: ['extra', 'loss']"
    )
    renamed = {"acc": 1.0} if rank == 1 else {"loss": 1.0}  # as many keys, other names
    expect_error(ValueError, lambda: gu.all_reduce_mean(renamed, group), "rank 1: ['acc']")
    for bad, words in [
        ("high", "got a str value"),
        (1j, "got a complex value"),
        (10**400, "too large"),
        (torch.tensor([1.0, 2.0], device=device), "key 'loss' holds a tensor of shape [2], not one element"),
        (torch.zeros(0, device=device), "shape [0]"),
        (torch.tensor([1j], device=device), "got a complex value"),
        (torch.zeros((), device="meta"), "expected a dict of str -> real number"),  # item() raises
    ]:
        not_a_number = {"loss": bad} if rank == 1 else {"loss": 1.0}
        expect_rank_1_error(group, TypeError, lambda: gu.all_reduce_mean(not_a_number, group), words)
    some_not_str = {"loss": 1.0, 0: 2.0} if rank == 1 else {"loss": 1.0}
    expect_rank_1_error(
        group, TypeError, lambda: gu.all_reduce_mean(some_not_str, group), "keys must be str"
    )
    check_group_still_works(device, group)


def check_bad_input_unreadable_tensor_on_one_rank(device, group=None):
    """Failures found while reading the tensor must reach the other ranks, not strand them."""
    rank = gu.get_rank(group)
    for bad, words in [
        (torch.zeros(1, 1, device=device).to_sparse(), "dense tensor"),
        (torch.zeros((), device=device).to_sparse(), "dense tensor"),
        (torch.zeros([1] * 13, device=device), "at most 12 dims"),
        (torch.empty(2, 1, device="meta"), "could not read"),
    ]:
        local = bad if rank == 1 else torch.zeros(2, 1, device=device)
        error = TypeError if "dense" in words else ValueError
        for fn in (gu.all_gather_concat, gu.all_gather_tensors, gu.all_reduce_mean):
            expect_rank_1_error(group, error, lambda: fn(local, group), words)
    check_group_still_works(device, group)


def check_bad_input_gather_for_metrics(device, group=None):
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    results = torch.zeros(2, 1, device=device)
    own = torch.tensor([rank, rank + world], device=device)  # together: range(2 * world)
    expect_error(
        ValueError,
        lambda: gu.gather_for_metrics(results, own, 2 * world + 1, group),
        "held by no rank",
        f"[{2 * world}]",
    )
    expect_error(
        ValueError,
        lambda: gu.gather_for_metrics(results, own, 2 * world + 10, group),
        f"10 of {2 * world + 10} samples are held by no rank, e.g. indices {list(range(2 * world, 2 * world + 8))}",
    )
    expect_error(
        ValueError,
        lambda: gu.gather_for_metrics(results, own, 2 * world - 1, group),
        f"holds index {2 * world - 1}",
    )
    expect_error(
        ValueError, lambda: gu.gather_for_metrics(results, own, 2 * world + rank, group), "num_samples"
    )
    # An index well past num_samples, with none at it.
    far = torch.tensor([rank, rank + world if rank < world - 1 else 3 * world], device=device)
    expect_error(
        ValueError,
        lambda: gu.gather_for_metrics(results, far, 2 * world, group),
        f"rank {world - 1} holds index {3 * world}, outside range(num_samples={2 * world})",
    )
    zero_d = torch.tensor(0.0, device=device) if rank == 1 else results
    expect_rank_1_error(
        group, TypeError, lambda: gu.gather_for_metrics(zero_d, own, 2 * world, group), "got a 0-d tensor"
    )
    short = own[:1] if rank == 1 else own
    expect_rank_1_error(
        group,
        ValueError,
        lambda: gu.gather_for_metrics(results, short, 2 * world, group),
        "1 indices for 2 result rows",
    )
    long = torch.cat([own, own[:1]]) if rank == 1 else own
    expect_rank_1_error(
        group,
        ValueError,
        lambda: gu.gather_for_metrics(results, long, 2 * world, group),
        "3 indices for 2 result rows",
    )
    for dtype in torch.float32, torch.complex64, torch.bool:
        typed = own.to(dtype) if rank == 1 else own
        expect_rank_1_error(
            group,
            TypeError,
            lambda: gu.gather_for_metrics(results, typed, 2 * world, group),
            f"indices must be a 1-D integer tensor, got {dtype}[2]",
        )
    for shaped, words in [(own.view(1, 2), "torch.int64[1, 2]"), (own[0], "torch.int64[]")]:
        wrong_dims = shaped if rank == 1 else own
        one_row = results[:1] if rank == 1 else results  # the dims wrong, not the count
        expect_rank_1_error(
            group,
            TypeError,
            lambda: gu.gather_for_metrics(one_row, wrong_dims, 2 * world, group),
            f"indices must be a 1-D integer tensor, got {words}",
        )
    sparse = own.to_sparse() if rank == 1 else own
    expect_rank_1_error(
        group, TypeError, lambda: gu.gather_for_metrics(results, sparse, 2 * world, group), "dense tensor"
    )
    meta = own.to("meta") if rank == 1 else own
    expect_rank_1_error(
        group,
        ValueError,
        lambda: gu.gather_for_metrics(results, meta, 2 * world, group),
        "could not read this rank's indices",
    )
    for bad in -1, 4.0, True, 2**63:
        num_samples = bad if rank == 1 else 2 * world
        expect_rank_1_error(
            group,
            TypeError,
            lambda: gu.gather_for_metrics(results, own, num_samples, group),
            f"num_samples must be a non-negative int, got {bad!r}",
        )
    # torch.as_tensor raises ValueError on a ragged list, TypeError on a str.
    for bad in [[0], [1, 2]], "0 1":
        not_indices = bad if rank == 1 else own
        expect_rank_1_error(
            group,
            TypeError,
            lambda: gu.gather_for_metrics(results, not_indices, 2 * world, group),
            f"indices must be a 1-D integer tensor, got {type(bad).__name__}",
        )
    a_list = [0.0, 0.0] if rank == 1 else results
    expect_rank_1_error(
        group, TypeError, lambda: gu.gather_for_metrics(a_list, own, 2 * world, group), "got list"
    )
    check_group_still_works(device, group)


def collectives_run(group, fn, *args, counted=None):
    """(fn(*args, group=group), how many collectives it ran on `counted` (default: `group`)).

    The count is torch's own per-group sequence number, which every collective advances.
    """
    counted = counted or group or dist.group.WORLD
    before = counted._get_sequence_number_for_group()
    result = fn(*args, group=group)
    return result, counted._get_sequence_number_for_group() - before


def full(n, value, device):
    return torch.full((n,), float(value), device=device)


def header_room(world):
    """The bytes of data that ride in each rank's header, by docs/gather.md's rule:
    min(8 KiB, 64 KiB / world), rounded down to a multiple of 16."""
    return min(8 << 10, (64 << 10) // world) // 16 * 16


def data_collectives(world, equal, senders=None):
    """The collectives that move the data after the header: on NCCL one all-gather; on gloo one
    broadcast per rank that has data (`senders`, default all) for uneven sizes, and for equal ones
    on up to 4 ranks (faster there), else one all-gather. BACKEND, from this launch's own
    arguments, says which: the expectation must not come from the code under test."""
    if BACKEND != "gloo" or (equal and world > 4):
        return 1
    return world if senders is None else senders


def check_small_payloads_ride_in_the_header(device, group=None):
    """Data that fits in the header's room comes with it: one collective. One byte more: the header,
    then the data (data_collectives)."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    room = header_room(world)
    floats = functools.partial(full, device=device)

    out, n = collectives_run(group, gu.all_gather_concat, floats(room // 4, rank))
    assert n == 1 and torch.equal(out, torch.cat([floats(room // 4, r) for r in range(world)]))
    out, n = collectives_run(group, gu.all_gather_tensors, floats(room // 4 - rank, rank))
    assert n == 1 and all(torch.equal(t, floats(room // 4 - r, r)) for r, t in enumerate(out))
    out, n = collectives_run(group, gu.all_gather_concat, floats(room // 4, rank).requires_grad_())
    assert n == 1 and out.requires_grad  # a differentiable gather costs no more collectives
    out, n = collectives_run(group, gu.all_gather_concat, floats(room // 4 + 1, rank))
    assert n == 1 + data_collectives(world, equal=True)
    assert torch.equal(out, torch.cat([floats(room // 4 + 1, r) for r in range(world)]))
    # Only the last rank's data is too big: every rank must leave the header path together.
    sizes = [room // 4] * (world - 1) + [room // 4 + 1]
    out, n = collectives_run(group, gu.all_gather_concat, floats(sizes[rank], rank))
    assert n == 1 + data_collectives(world, equal=world == 1)
    assert torch.equal(out, torch.cat([floats(k, r) for r, k in enumerate(sizes)]))

    mean = sum(range(world)) / world
    out, n = collectives_run(group, gu.all_reduce_mean, floats(room // 4, rank))
    assert n == 1 and torch.equal(out, floats(room // 4, mean))
    out, n = collectives_run(group, gu.all_reduce_mean, floats(room // 4 + 1, rank))
    assert n == 2 and torch.equal(out, floats(room // 4 + 1, mean))
    out, n = collectives_run(group, gu.all_reduce_mean, {"loss": rank, "count": 1})
    assert n == 1 and out == {"loss": mean, "count": 1.0}
    indices = torch.arange(rank, 10 * world, world)
    out, n = collectives_run(group, gu.gather_for_metrics, indices.float().to(device), indices, 10 * world)
    assert n == 1 and torch.equal(out, torch.arange(10 * world, device=device).float())
    # all_gather_object moves its bytes on the CPU: on an NCCL group of every rank, not through that group.
    out, n = collectives_run(group, gu.all_gather_object, {"rank": rank})
    assert n == (0 if BACKEND == "nccl" and world == dist.get_world_size() else 1)
    assert out == [{"rank": r} for r in range(world)]


def check_data_collectives_past_the_header_room(device, group=None):
    """Equal and uneven sizes past the header's room, each with its collectives. The launch of 9 gloo ranks runs
    this too, also on 5 of them: there equal sizes take gloo's all-gather, not a broadcast per rank."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    rows = header_room(world) // 4 + 1
    floats = functools.partial(full, device=device)
    out, n = collectives_run(group, gu.all_gather_concat, floats(rows, rank))
    assert n == 1 + data_collectives(world, equal=True)
    assert torch.equal(out, torch.cat([floats(rows, r) for r in range(world)]))
    out, n = collectives_run(group, gu.all_gather_tensors, floats(rows, rank))
    assert n == 1 + data_collectives(world, equal=True)
    assert all(torch.equal(t, floats(rows, r)) for r, t in enumerate(out))
    out, n = collectives_run(group, gu.all_gather_concat, floats(rows + rank, rank))
    assert n == 1 + data_collectives(world, equal=world == 1)
    assert torch.equal(out, torch.cat([floats(rows + r, r) for r in range(world)]))
    # The last rank has nothing: it sends nothing after the header (a world of one: nothing moves).
    sizes = [rows] * (world - 1) + [0]
    out, n = collectives_run(group, gu.all_gather_concat, floats(sizes[rank], rank))
    assert n == 1 + (data_collectives(world, equal=False, senders=world - 1) if world > 1 else 0)
    assert torch.equal(out, torch.cat([floats(k, r) for r, k in enumerate(sizes)]))


def check_subgroup(device, group=None):
    """Ranks 1..world-1 form a subgroup (rank 0 alone in a world of one); every check runs on it."""
    world = dist.get_world_size()
    members = list(range(1, world)) or [0]
    sub = dist.new_group(members)
    if dist.get_rank() not in members:
        expect_error(ValueError, lambda: gu.all_gather_concat(torch.zeros(1), sub), "not a member")
        return
    assert gu.all_gather_concat(torch.tensor([dist.get_rank()], device=device), sub).tolist() == members
    for check in [*plain_checks(len(members)), check_small_payloads_ride_in_the_header,
                  check_data_collectives_past_the_header_room]:
        check(device, sub)


def check_data_collectives_on_five_ranks(device, group=None):
    """Five ranks, the fewest past gloo's broadcast limit of 4, as a subgroup of a larger world."""
    five = dist.new_group(list(range(5)))
    if dist.get_rank() < 5:
        check_data_collectives_past_the_header_room(device, five)


def check_mixed_group_moves_tensors_over_its_gpu_backend(device, group=None):
    """On a group of gloo and NCCL ("cpu:gloo,cuda:nccl"), tensors move over NCCL, forward and backward, whatever
    their device; objects over gloo. Counted by each backend's own sequence number, which each collective advances."""
    group = group or dist.group.WORLD
    gpu, cpu = (group._get_backend(torch.device(kind)) for kind in ("cuda", "cpu"))

    def collectives(fn):
        before = gpu._get_sequence_number_for_group(), cpu._get_sequence_number_for_group()
        fn()
        return gpu._get_sequence_number_for_group() - before[0], cpu._get_sequence_number_for_group() - before[1]

    rank = gu.get_rank(group)
    rows = torch.full((rank + 1, 3), float(rank), device=device, requires_grad=True)
    on_gpu, on_cpu = collectives(lambda: gu.all_gather_concat(rows, group).sum().backward())
    assert on_gpu >= 2 and on_cpu == 0, (on_gpu, on_cpu)  # the header, the backward's all-reduce
    assert torch.equal(rows.grad, torch.full_like(rows, gu.get_world_size(group)))
    on_gpu, on_cpu = collectives(lambda: gu.all_gather_concat(rows.detach().cpu(), group))
    assert on_gpu >= 1 and on_cpu == 0, (on_gpu, on_cpu)
    on_gpu, on_cpu = collectives(lambda: gu.all_gather_object({"rank": rank}, group))
    assert on_gpu == 0 and on_cpu >= 1, (on_gpu, on_cpu)


def spread(n, generator, dtype):
    """n values of both signs from 2**-4 to 2**5: summed in another order, some round otherwise."""
    mantissa = torch.rand(n, generator=generator, dtype=torch.float64) + 1
    sign = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
    return (sign * mantissa * 2.0 ** torch.randint(-4, 5, (n,), generator=generator)).to(dtype)


def result_bytes(value):
    """What a rank got from a call, as bytes to compare with another rank's: tensors' raw bytes
    with their dtype and shape, anything else as its repr, which is exact for Python floats."""
    if isinstance(value, torch.Tensor):
        raw = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return repr((value.dtype, tuple(value.shape))).encode() + raw
    if isinstance(value, list):
        return b"".join(result_bytes(item) + b"," for item in value)
    return repr(value).encode()


def check_every_rank_gets_the_same_bits(device, group=None):
    """Each public function gives every rank the same bits (get_rank aside, which differs by
    design). A rank that summed in an order of its own would get another mean, and a loop that
    branches on it, as early stopping does, would leave that rank's peers waiting. The means are
    of floats whose sum, from 3 ranks on, rounds otherwise in another order, as checked here first:
    in the header's room, where each rank sums the rows itself, and past it (an all-reduce)."""
    rank, world = gu.get_rank(group), gu.get_world_size(group)
    past = header_room(world) // 4 + 1  # float32 values
    every = [torch.Generator().manual_seed(r) for r in range(world)]
    values = {
        name: [spread(n, generator, dtype) for generator in every]
        for name, n, dtype in [("in", 16, torch.float32), ("past", past, torch.float32),
                               ("dict", 16, torch.float64)]
    }
    if world >= 3:
        for name, tensors in values.items():
            in_order = torch.stack(tensors)
            assert not torch.equal(in_order.sum(0), in_order.flip(0).sum(0)), name
    mine = {name: tensors[rank].to(device) for name, tensors in values.items()}
    indices = torch.tensor(list(iter(DistributedSampler(range(11), world, rank, seed=3))))
    results = {
        "get_world_size": gu.get_world_size(group),
        "all_reduce_mean in the header": gu.all_reduce_mean(mine["in"], group),
        "all_reduce_mean past the header": gu.all_reduce_mean(mine["past"], group),
        "all_reduce_mean of bfloat16": gu.all_reduce_mean(mine["in"].bfloat16(), group),
        "all_reduce_mean of a dict": gu.all_reduce_mean(
            {f"key {i}": value for i, value in enumerate(mine["dict"].tolist())}, group
        ),
        "all_gather_concat": gu.all_gather_concat(mine["past"], group),
        "all_gather_concat async": gu.all_gather_concat(mine["in"], group, async_op=True).wait(),
        "all_gather_tensors": gu.all_gather_tensors(mine["in"][: rank + 1], group),
        "all_gather_object": gu.all_gather_object({"r": rank, "x": mine["dict"].tolist()}, group),
        "gather_for_metrics": gu.gather_for_metrics(spread(len(indices), every[rank], torch.float32)
                                                    .to(device), indices.to(device), 11, group),
    }
    digests = {name: hashlib.sha256(result_bytes(got)).hexdigest() for name, got in results.items()}
    everyone = [None] * world
    dist.all_gather_object(everyone, digests, group=group)  # torch's own, not the code under test
    differ = [name for name in digests if len({d[name] for d in everyone}) > 1]
    assert not differ, f"ranks got different bits from {differ}"


def check_default_group(device, group=None):
    """The checks above run on explicit groups; group=None must mean the whole world."""
    check_all_gather_concat_uneven(device, None)
    check_all_gather_object(device, None)
    check_all_reduce_mean_dict(device, None)
    gather_for_metrics_case(device, None, 11, shuffle=True)


CHECKS = [
    check_get_rank_and_world_size,
    check_all_gather_concat_uneven,
    check_all_gather_concat_equal,
    check_all_gather_concat_every_dtype,
    check_all_gather_concat_zero_dim,
    check_all_gather_concat_non_contiguous_and_input_unchanged,
    check_all_gather_concat_result_owns_its_memory,
    check_all_gather_concat_async,
    check_gather_handle_completes_before_wait,
    check_all_gather_tensors_any_shape,
    check_all_gather_tensors_results_own_their_memory,
    check_all_gather_object,
    check_all_reduce_mean_tensor,
    check_all_reduce_mean_dict,
    check_all_reduce_mean_leaves_its_input_alone,
    check_all_reduce_mean_sums_integers_exactly,
    check_all_reduce_mean_keeps_64_bit_precision,
    check_gather_for_metrics_drops_sampler_padding,
    check_gather_for_metrics_keeps_first_duplicate,
    check_gather_for_metrics_zero_width_rows,
    check_gather_for_metrics_every_dtype,
    check_gather_for_metrics_takes_any_integer_indices,
    check_gather_for_metrics_ranks_with_nothing,
    check_gather_for_metrics_names_the_rank_of_a_bad_index,
    check_all_gather_concat_lazy_views,
    check_all_gather_concat_gradient,
    check_all_gather_concat_gradient_leaves_the_incoming_one_alone,
    check_all_gather_tensors_gradient,
    check_no_grad_path_unchanged,
]
# These need at least two ranks to disagree.
MULTI_RANK_CHECKS = [
    check_bad_input_dtype_mismatch,
    check_bad_input_trailing_shape_mismatch,
    check_bad_input_ndim_mismatch_same_numel,
    check_bad_input_not_a_tensor_on_one_rank,
    check_bad_input_on_several_ranks,
    check_bad_input_unreadable_tensor_on_one_rank,
    check_bad_input_tensor_and_dict_mixed,
    check_bad_input_dict_keys_differ,
    check_bad_input_gather_for_metrics,
    check_bad_input_requires_grad_on_one_rank,
]
# These need an initialized process group.
DISTRIBUTED_CHECKS = [
    check_subgroup,
    check_default_group,
    check_every_rank_gets_the_same_bits,
    check_small_payloads_ride_in_the_header,
    check_data_collectives_past_the_header_room,
    check_contrastive_loss_under_ddp,
]
# What the 256 MiB transfer proves does not depend on the world size: one launch runs it.
IN_FLIGHT_WORLD = 3
# A group of gloo and NCCL runs these: the backend each call takes, and the gathers' results on that group.
MIXED_GROUP_CHECKS = [
    "check_mixed_group_moves_tensors_over_its_gpu_backend", "check_all_gather_concat_uneven",
    "check_all_gather_concat_every_dtype", "check_all_gather_concat_gradient", "check_all_gather_object",
    "check_all_reduce_mean_tensor", "check_all_reduce_mean_dict", "check_gather_for_metrics_drops_sampler_padding",
    "check_contrastive_loss_under_ddp",
]
# These take `width`, and run again past the header's room.
WIDE_CHECKS = [check for check in CHECKS if "width" in inspect.signature(check).parameters]


# ---------------------------------------------------------------------------------------------
# Under torchrun: run every check on every rank and report on rank 0.


def past_the_header_room(check):
    """`check` with rows of LARGE elements, too many for the header's room: the data moves after it."""
    run = functools.partial(check, width=LARGE)
    run.__name__ = f"{check.__name__}_past_the_header_room"
    return run


def plain_checks(world):
    """The checks that take any group of `world` ranks (those that need two ranks from 2 up)."""
    return CHECKS + (MULTI_RANK_CHECKS if world > 1 else [])


def checks_for(world):
    """Every check a process group of `world` ranks runs under torchrun."""
    mixed = [check_mixed_group_moves_tensors_over_its_gpu_backend] if BACKEND == "cpu:gloo,cuda:nccl" else []
    five = [check_data_collectives_on_five_ranks] if world > 5 else []
    in_flight = [check_async_returns_with_the_data_in_flight] if world == IN_FLIGHT_WORLD else []
    wide = [past_the_header_room(check) for check in WIDE_CHECKS]
    return plain_checks(world) + DISTRIBUTED_CHECKS + mixed + five + in_flight + wide


# gloo's words for a collective past its group's timeout.
TIMED_OUT = re.compile(r"Timed out waiting \d+ms")


def run_checks(device, report=None, only=None):
    checks = [check for check in checks_for(dist.get_world_size()) if not only or check.__name__ in only]
    failures, timed_out, not_run = {}, torch.zeros(1), []
    for i, check in enumerate(checks):
        # A fresh group per check: if a check fails on one rank only, the others wait on a group
        # that nobody uses again and time out, instead of misaligning every later check.
        group = dist.new_group(timeout=datetime.timedelta(seconds=20))
        try:
            check(device, group)
        except Exception as error:
            failures[check.__name__] = traceback.format_exc(limit=-3)
            timed_out[0] = float(bool(TIMED_OUT.search(str(error))))
        # A hang that every check meets would cost each check its timeout, until the launcher's
        # kill left no report: once a collective has timed out on any rank, every rank stops.
        # torch's own collectives: the report must not depend on the code under test.
        dist.all_reduce(timed_out, op=dist.ReduceOp.MAX)
        if timed_out.item():
            not_run = [later.__name__ for later in checks[i + 1 :]]
            break
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, failures)
    failed = sorted({name for f in every_rank for name in f})
    if dist.get_rank() == 0:
        results = dict.fromkeys(check.__name__ for check in checks)
        for name in failed:
            ranks = [r for r, f in enumerate(every_rank) if name in f]
            # A rank's own error first: the others' timeouts only say that they waited for it.
            shown = min(ranks, key=lambda r: bool(TIMED_OUT.search(every_rank[r][name])))
            results[name] = f"on rank {ranks}:\n{every_rank[shown][name]}"
            print(f"FAILED {name} {results[name]}", flush=True)
        if not_run:
            stop = f"the launch stopped after {check.__name__}, whose collectives timed out"
            print(f"{stop}; the {len(not_run)} checks after it did not run", flush=True)
            results.update(dict.fromkeys(not_run, f"not run: {stop}"))
        passed = f"{len(checks) - len(failed) - len(not_run)} passed, {len(failed)} failed"
        print(passed + (f", {len(not_run)} not run" if not_run else ""), flush=True)
        if report:
            # Written whole, then renamed: a rank killed while writing leaves no half report.
            with open(f"{report}.tmp", "w") as f:
                json.dump(results, f, indent=1)
            os.replace(f"{report}.tmp", report)
    return not failed and not not_run


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--backend",
        choices=["gloo", "nccl", "cpu:gloo,cuda:nccl", "default"],
        default="gloo",
        help="default: init_process_group()'s own; cpu:gloo,cuda:nccl: both, as train_ddp.py's group on GPUs",
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default: cuda for nccl, else cpu"
    )
    parser.add_argument(
        "--report", metavar="PATH", help="also write {check: null, or its failure} as JSON to PATH (rank 0)"
    )
    parser.add_argument("--checks", help="only these checks, comma-separated (cpu:gloo,cuda:nccl: MIXED_GROUP_CHECKS)")
    args = parser.parse_args()
    global BACKEND
    BACKEND = "gloo" if args.backend == "default" else args.backend  # "default" without GPUs is gloo
    device = torch.device(args.device or ("cpu" if BACKEND == "gloo" else "cuda"))
    if device.type == "cuda":
        # gloo may put several ranks on one GPU; NCCL needs one GPU per rank.
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    # A short timeout: a check that breaks the collectives' alignment fails in a minute, not 30.
    backend = None if args.backend == "default" else args.backend
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    try:
        mixed = MIXED_GROUP_CHECKS if BACKEND == "cpu:gloo,cuda:nccl" else None
        ok = run_checks(device, args.report, args.checks.split(",") if args.checks else mixed)
        # As in train_ddp.py's process_group: held until the group is gone, the finishing barrier's
        # work keeps the last collectives' tensors from gloo's worker threads, which could otherwise
        # hang this rank's exit on torch 2.1 to 2.13.
        finished = dist.barrier(async_op=True)
        finished.wait()
    finally:
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":  # torchrun's entry ends here: what follows needs pytest, which it may lack
    main()


# ---------------------------------------------------------------------------------------------
# Under pytest.

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def torchrun(nproc, *args, timeout=240, **env):
    """This file under torchrun on `nproc` ranks: (exit code, stdout, stderr), the exit code None
    when it ran past `timeout` and was killed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    # --standalone rendezvouses on a free local port, so parallel runs never collide.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        __file__,
        *args,
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=os.path.dirname(__file__) or "."
        )
    except subprocess.TimeoutExpired as late:
        # What it printed before the kill comes as bytes, even with text=True.
        stdout, stderr = ((out or b"").decode(errors="replace") for out in (late.stdout, late.stderr))
        return None, stdout, f"{stderr}\nkilled: still running after {timeout} s"
    return proc.returncode, proc.stdout, proc.stderr


def assert_every_check_passed(nproc, *args):
    code, stdout, stderr = torchrun(nproc, *args)
    output = stdout + stderr
    assert code == 0, output
    last = stdout.strip().splitlines()[-1]
    assert last.endswith(" passed, 0 failed"), output


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """launched(nproc, *args, **env): (exit code, output, report) of this file under torchrun, run
    once per configuration for all the tests of its checks, so that a test per check costs no
    launch of its own."""
    launches = {}

    def launch(nproc, *args, **env):
        key = (nproc, args, tuple(sorted(env.items())))
        if key not in launches:
            report = tmp_path_factory.mktemp("report") / "report.json"
            code, stdout, stderr = torchrun(nproc, *args, "--report", str(report), **env)
            launches[key] = code, stdout + stderr, json.loads(report.read_text()) if report.exists() else {}
        return launches[key]

    return launch


def assert_check_passed(launch_result, names, name):
    """The launch reported on the checks `names`, and `name` among them passed."""
    code, output, report = launch_result
    assert sorted(report) == sorted(names), f"exit {code}\n{output}"
    assert report[name] is None, report[name]


def all_checks(world):
    return [check.__name__ for check in checks_for(world)]


def assert_exit_matches_report(launch_result):
    """0 when every check passed, 1 when some failed (their own tests say which): any other exit, a crash
    or a hang at exit, is the launch's own failure."""
    code, output, report = launch_result
    passed = all(failure is None for failure in report.values())
    assert report and code == (0 if passed else 1), f"exit {code}\n{output}"


@pytest.mark.timeout(300)  # the first test of each world size waits for its launch
@pytest.mark.parametrize(
    "world, name", [(world, check.__name__) for world in [1, 2, 3, 4] for check in checks_for(world)]
)
def test_torchrun_gloo_cpu(launched, world, name):
    assert_check_passed(launched(world), all_checks(world), name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.quick), 3, 4])
def test_torchrun_gloo_cpu_exit(launched, world):
    assert_exit_matches_report(launched(world))


@pytest.mark.quick
@pytest.mark.timeout(300)
def test_torchrun_prints_no_warning_of_this_project(launched):
    """Python's warnings name the file that triggered them: none may be one of this project's."""
    _, output, _ = launched(2)
    here = os.path.dirname(os.path.abspath(__file__))
    ours = [line for line in output.splitlines() if re.match(rf"{re.escape(here)}/\S+\.py:\d+: \w*Warning: ", line)]
    assert not ours, "\n".join(ours)


# init_process_group() without a backend on a machine without GPUs: gloo, though get_backend()
# says "undefined" (with GPUs, torch 2.14 makes it NCCL alone). What depends on the backend that
# each call reads from the group's config: the device the collectives run on, forward and
# backward; how the data moves past the header's room (a broadcast per rank or an all-gather);
# all_gather_object's transport; and the default group itself, which init_process_group() made.
DEFAULT_BACKEND_CHECKS = [
    "check_small_payloads_ride_in_the_header", "check_data_collectives_past_the_header_room",
    "check_default_group", "check_all_gather_object_past_the_header_room",
    "check_all_reduce_mean_tensor", "check_all_gather_concat_gradient_past_the_header_room",
]


def launched_default_backend(launched):
    checks = ",".join(DEFAULT_BACKEND_CHECKS)
    return launched(3, "--backend", "default", "--checks", checks, CUDA_VISIBLE_DEVICES="")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", DEFAULT_BACKEND_CHECKS)
def test_torchrun_default_backend(launched, name):
    assert_check_passed(launched_default_backend(launched), DEFAULT_BACKEND_CHECKS, name)


@pytest.mark.timeout(300)
def test_torchrun_default_backend_exit(launched):
    assert_exit_matches_report(launched_default_backend(launched))


# More ranks than the usual launches, few checks: past 8 ranks the header room shrinks, and past
# 4 gloo ranks equal sizes take gloo's all-gather, not a broadcast per rank (also on a subgroup
# of 5).
LARGE_WORLD = 9
LARGE_WORLD_CHECKS = [
    "check_small_payloads_ride_in_the_header", "check_data_collectives_past_the_header_room",
    "check_data_collectives_on_five_ranks", "check_all_gather_concat_equal_past_the_header_room",
    "check_all_gather_concat_uneven_past_the_header_room",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", LARGE_WORLD_CHECKS)
def test_torchrun_gloo_cpu_nine_ranks(launched, name):
    launch = launched(LARGE_WORLD, "--checks", ",".join(LARGE_WORLD_CHECKS))
    assert_check_passed(launch, LARGE_WORLD_CHECKS, name)


@pytest.mark.timeout(300)
def test_torchrun_gloo_cpu_nine_ranks_exit(launched):
    assert_exit_matches_report(launched(LARGE_WORLD, "--checks", ",".join(LARGE_WORLD_CHECKS)))


@pytest.mark.quick
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_world_of_one_without_init(check):
    assert not dist.is_initialized()
    check(torch.device("cpu"))


@pytest.mark.quick
def test_world_of_one_bad_input():
    assert not dist.is_initialized()
    for fn in (gu.all_gather_concat, gu.all_gather_tensors, gu.all_reduce_mean):
        expect_error(TypeError, lambda: fn([1, 2]), "expected a torch.Tensor", "got list")
    expect_error(TypeError, lambda: gu.all_gather_object(lambda: 0), "could not pickle")
    expect_error(TypeError, lambda: gu.all_reduce_mean({"loss": "high"}), "got a str value")
    expect_error(TypeError, lambda: gu.all_reduce_mean({"loss": torch.ones(1, 2)}), "shape [1, 2], not one element")
    expect_error(TypeError, lambda: gu.all_reduce_mean({"loss": 1.0, 0: 2.0}), "keys must be str")
    meta = torch.zeros((), device="meta")  # Tensor.item() raises
    expect_error(TypeError, lambda: gu.all_reduce_mean({"loss": meta}), "or one-element tensor")
    results, indices = torch.zeros(2, 1), torch.tensor([0, 1])
    expect_error(ValueError, lambda: gu.gather_for_metrics(results, indices, 3), "held by no rank", "[2]")
    expect_error(ValueError, lambda: gu.gather_for_metrics(results, indices, 1), "holds index 1")
    expect_error(
        ValueError, lambda: gu.gather_for_metrics(results, indices[:1], 2), "1 indices for 2 result rows"
    )
    expect_error(
        TypeError, lambda: gu.gather_for_metrics(results[:1], indices.view(1, 2), 2), "int64[1, 2]"
    )
    expect_error(
        ValueError, lambda: gu.gather_for_metrics(results, indices.to("meta"), 2), "could not read"
    )


@pytest.mark.quick
@pytest.mark.timeout(120)
def test_gather_utils_copied_alone_into_an_empty_folder(tmp_path):
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gather_utils.py")
    with open(source) as f, open(tmp_path / "gather_utils.py", "w") as g:
        g.write(f.read())
    code = "import gather_utils, torch; print(gather_utils.all_gather_concat(torch.ones(2, 3)).shape)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch.Size([2, 3])"


@needs_cuda
@pytest.mark.timeout(300)
def test_torchrun_nccl_one_rank_per_gpu():
    """NCCL takes one GPU per rank: on a machine of one GPU this is a world of one, where no data crosses between
    ranks and the uneven all-gather never runs (docs/testing.md says what one GPU cannot cover)."""
    assert_every_check_passed(torch.cuda.device_count(), "--backend", "nccl")


@needs_cuda
@pytest.mark.timeout(300)
def test_torchrun_mixed_group_one_rank_per_gpu():
    """train_ddp.py's group on GPUs: tensors over NCCL, objects over gloo."""
    nproc = torch.cuda.device_count()
    assert_every_check_passed(nproc, "--backend", "cpu:gloo,cuda:nccl")  # MIXED_GROUP_CHECKS


def test_tensors_take_the_gpu_backend_of_a_group_that_has_one():
    # The choice behind the test above, on the backend configs torch makes for each spec (a group with NCCL cannot
    # form without a GPU): NCCL when the group has it, else the CPU's gloo, which would copy CUDA tensors through it.
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    for spec, gpu in [("cpu:gloo,cuda:nccl", True), ("nccl", True), ("gloo", False), ("cpu:gloo,cuda:gloo", False)]:
        config = str(BackendConfig(Backend(spec)))
        assert gu._has_gpu_backend(gu._parse_backend_config(config)) is gpu, (spec, config)


@needs_cuda
@pytest.mark.timeout(300)
def test_torchrun_gloo_cuda_tensors():
    assert_every_check_passed(2, "--backend", "gloo", "--device", "cuda")

