"""All-gather helpers for torch.distributed: sizes may differ between ranks, bad input never hangs.

Copy this file alone into your project: it imports only torch and the standard library. Every public function
- works unchanged when torch.distributed is not initialized, as a world of one;
- works on gloo (CPU or CUDA tensors), on NCCL (CUDA tensors: give each rank its GPU first, as torch requires, with
  `torch.cuda.set_device` or `init_process_group(device_id=...)`; a rank with bad input sends its header from there
  too), on both in one group ("cpu:gloo,cuda:nccl": tensors over NCCL, objects over gloo) and on subgroups;
- starts with one all-gather of a small fixed-size header per rank (error flag, dtype, shape), which is also the size
  exchange: if any rank's input is bad, or the ranks disagree, every rank raises before any data moves, so the
  collectives stay aligned and the group keeps working. Data that fits in the header's room (8 KiB per rank: see
  `_HEADER_ROOM_BYTES`) rides in it, so small payloads take one collective in all.

Tensors move as raw bytes, so every dtype works (bool, complex, 8/16-bit floats, ...).
`all_gather_concat` and `all_gather_tensors` are differentiable when their input requires grad.
"""

import array
import bisect
import functools
import hashlib
import io
import itertools
import math
import pickle
import typing

import torch
import torch.distributed as dist

__all__ = [
    "get_rank",
    "get_world_size",
    "all_gather_concat",
    "all_gather_tensors",
    "all_gather_object",
    "all_reduce_mean",
    "gather_for_metrics",
    "GatherHandle",
]

# Every rank runs the same torch, so a dtype's position in this tuple identifies it.
_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
# A header row: _HEADER_LEN int64 [failed, dtype code, ndim, setting, *shape, zero padding], then room for the
# rank's data (see _exchange_headers).
_HEADER_LEN = 16
_HEADER_BYTES = _HEADER_LEN * 8
_SHAPE_AT = 4  # where the shape starts in a row
_MAX_NDIM = _HEADER_LEN - _SHAPE_AT
# A small all-gather costs its latency, not its bytes (bench_gather.py measures where that ends), so a rank's data of
# up to 8 KiB rides in its header: room for losses, metrics and a few rows, while the large calls, whose data moves
# after the header, send few idle bytes. Past 8 ranks the room per rank shrinks, to 64 KiB in all.
_HEADER_ROOM_BYTES = 8 << 10
_HEADER_MAX_ROOM_TOTAL = 64 << 10
# Backends whose list-form all_gather accepts different sizes per rank (gloo raises).
_UNEVEN_BACKENDS = ("nccl",)
# On 2 to 4 gloo ranks one broadcast per rank, all in flight at once, beats gloo's own all-gather even for equal
# sizes (bench_gather.py). Gloo's broadcast is a binomial tree of log2(world) steps, though, and its two worker
# threads run two collectives at a time, so the gain shrinks as ranks grow: on more ranks than were measured, equal
# sizes keep the all-gather.
_GLOO_BROADCAST_MAX_WORLD = 4


def _initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None):
    """This process's rank in `group` (no collective); 0 when torch.distributed is unavailable or not initialized."""
    return dist.get_rank(group) if _initialized() else 0


def get_world_size(group=None):
    """The number of ranks in `group` (no collective); 1 when torch.distributed is unavailable or not initialized."""
    return dist.get_world_size(group) if _initialized() else 1


class GatherHandle:
    """What `all_gather_concat(..., async_op=True)` returns while the data is in flight.

    `wait()` returns the gathered tensor (the same one on every call). Where the data moves on the CPU (gloo, whatever
    the input's device) it blocks the host until every byte has arrived and, for a GPU result, until the copy from the
    CPU to the GPU is done. On NCCL it does not block the host at all: it makes the current CUDA stream wait for the
    transfer. So work queued later on that stream sees the complete result, and so does reading it on the host
    (`.item()`, `.cpu()`); make another stream wait first: `stream.wait_stream(torch.cuda.current_stream())`.

    `is_completed()` never blocks. True means the collectives have finished (on NCCL, on the GPU), so `wait()` will not
    wait for the network, though a copy into a GPU result may still be running; data that came with the header is
    True at once. Take the result only from `wait()`.
    """

    def __init__(self, works, finish):
        self._works = works
        self._finish = finish
        self._result = None

    def is_completed(self):
        return self._result is not None or all(w.is_completed() for w in self._works)

    def wait(self):
        if self._result is None:
            for work in self._works:
                work.wait()
            self._result = self._finish()
        return self._result


def all_gather_concat(tensor, group=None, async_op=False):
    """Concatenate every rank's `tensor` along dim 0, in rank order.

    Every rank gets the same new tensor, on its input's device. Dim-0 sizes may differ (0 included); the other sizes
    and the dtype must match. A 0-d tensor counts as shape (1,). The input is never modified.

    Collectives: the header all-gather, which is all when every rank's data fits in the header. Else the data, straight
    into the result: one all-gather, or on gloo, for uneven sizes and for any sizes on up to 4 ranks, one broadcast per
    rank that has data.

    `async_op=True` returns a `GatherHandle` once the data is in flight, whose `wait()` returns the result; leave the
    input unchanged until then.

    Gradients: when `tensor` requires grad (and grad mode is on), the result is differentiable, also through `wait()`:
    each rank's `tensor` gets the sum over ranks of the gradient of its rows, by one all-reduce in the backward, which
    every rank must therefore run. Under DDP, which averages gradients, a loss computed on every rank from the result
    thus gets the gradient of that loss's mean over ranks. Without grad, the result has none.

    Raises on every rank: TypeError on a rank that passed a non-tensor (ValueError naming that rank on the others);
    ValueError when dtypes or sizes after dim 0 differ, or when the input requires grad on some ranks only.
    """
    name = "all_gather_concat"
    device = _collective_device(name, group, tensor)
    if isinstance(tensor, torch.Tensor) and tensor.dim() == 0 and tensor.layout == torch.strided:
        tensor = tensor.reshape(1)
    requires_grad = _wants_grad(tensor)
    read_input = functools.partial(_input_bytes, name, tensor, device)
    headers, payload, carried = _exchange_headers(name, group, device, read_input, tensor, requires_grad)
    if len({(header.dtype, header.shape[1:]) for header in headers}) > 1:
        raise ValueError(f"{name}: every rank needs the same dtype and sizes after dim 0; got {_describe(headers)}")
    _check_grad_agrees(name, headers)
    row_shape, counts, row_bytes = _rows(headers, tensor.element_size())

    def to_result(packed):
        out = packed.view(tensor.dtype).view(sum(counts), *row_shape).to(tensor.device)
        return _DifferentiableGather.apply(tensor, out, counts, group, device) if requires_grad else out

    handle = _gather_bytes(payload, [n * row_bytes for n in counts], group, carried, to_result)
    return handle if async_op else handle.wait()


def all_gather_tensors(tensor, group=None):
    """Gather every rank's `tensor`, each keeping its own shape.

    Every rank gets the same list of `world_size` tensors in rank order, on its input's device: views into one buffer.
    Any size, and the number of dims, may differ between ranks. Collectives, gradients (each rank's `tensor` gets the
    sum over ranks of its tensor's gradient, by one all-reduce) and errors as in `all_gather_concat`, except that only
    the dtypes must match.
    """
    name = "all_gather_tensors"
    device = _collective_device(name, group, tensor)
    requires_grad = _wants_grad(tensor)
    read_input = functools.partial(_input_bytes, name, tensor, device)
    headers, payload, carried = _exchange_headers(name, group, device, read_input, tensor, requires_grad)
    if len({header.dtype for header in headers}) > 1:
        raise ValueError(f"{name}: every rank needs the same dtype; got {_describe(headers)}")
    _check_grad_agrees(name, headers)
    shapes = [header.shape for header in headers]
    numels = [math.prod(shape) for shape in shapes]
    packed = _gather_bytes(payload, [n * tensor.element_size() for n in numels], group, carried).wait()
    flat = packed.view(tensor.dtype).to(tensor.device)
    if requires_grad:  # one differentiable tensor of every rank's elements, so that the backward runs once
        flat = _DifferentiableGather.apply(tensor.reshape(-1), flat, numels, group, device)
    return [chunk.view(shape) for chunk, shape in zip(flat.split(numels), shapes)]


def all_gather_object(obj, group=None):
    """Gather any picklable object from every rank.

    Every rank gets the same list of `world_size` objects in rank order. Tensors inside arrive on the CPU, so none lands
    on another rank's GPU; a `torch.nn.Parameter` stays one, with its `requires_grad`.

    Collectives: as in `all_gather_concat`, on the CPU whenever possible, so that no `torch.cuda.set_device` is needed:
    on a group with a CPU backend (gloo), that one; on an NCCL-only group of every rank, a gloo group over the same
    ranks, created by the first call (with torch's default gloo timeout) and reused. An NCCL-only group of fewer ranks
    sends through its GPU, so set the device first: a group created for some ranks only would hang later `new_group`s.

    Raises on every rank: TypeError on a rank whose object cannot be pickled (ValueError naming it on the others).
    """
    name = "all_gather_object"
    transport_group, device = _object_transport(name, group)
    read_input = functools.partial(_pickled_bytes, name, obj, device)
    headers, payload, carried = _exchange_headers(name, transport_group, device, read_input)
    sizes = [header.shape[0] for header in headers]
    chunks = _gather_bytes(payload, sizes, transport_group, carried).wait().cpu().split(sizes)
    return [pickle.loads(chunk.numpy().tobytes()) for chunk in chunks]


def all_reduce_mean(value, group=None):
    """The mean over ranks of a tensor, or of each entry of a dict.

    - A tensor: every rank gets a new tensor of its shape, on its device. Floating and complex dtypes are kept (floats
      under 32 bits are summed in float32, complex32 in complex64); integer and bool inputs give float64.
    - A dict of str -> real number or one-element tensor (any shape): every rank gets a dict of Python floats with the
      same keys, summed in float64 so that counts and sums stay exact. Key order may differ by rank.

    Collectives: 1 when the values, in the dtype they are summed in, fit in the header (every rank then sums them
    itself, in rank order); else the header all-gather and an all-reduce (and, only to report key sets that differ,
    `all_gather_object`'s).

    Raises on every rank: ValueError when shapes or dtypes (tensor), key sets (dict) or the kind of input differ between
    ranks; TypeError on a rank that passed anything else (ValueError naming that rank on the others).
    """
    name = "all_reduce_mean"
    device = _collective_device(name, group, value)
    is_dict = isinstance(value, dict)
    if is_dict:
        keys = sorted(value) if all(isinstance(key, str) for key in value) else None
        read_input = functools.partial(_dict_bytes, name, value, keys, device)
        described, kind = None, _keys_hash(keys)  # the header describes the values' bytes; kind >= 0: a dict, its keys
    else:
        read_input = functools.partial(_sum_input_bytes, name, value, device)
        described, kind = value, -1
    headers, payload, carried = _exchange_headers(name, group, device, read_input, described, kind)
    if len({header.setting < 0 for header in headers}) > 1:
        kinds = "; ".join(
            f"rank {r}: {'a tensor' if header.setting < 0 else 'a dict'}" for r, header in enumerate(headers)
        )
        raise ValueError(f"{name}: every rank needs the same kind of input; got {kinds}")
    if is_dict and len({(header.setting, header.shape) for header in headers}) > 1:
        listing = "; ".join(f"rank {r}: {k}" for r, k in enumerate(all_gather_object(keys, group)))
        raise ValueError(f"{name}: every rank needs the same keys; got {listing}")
    if not is_dict and len({(header.dtype, header.shape) for header in headers}) > 1:
        raise ValueError(f"{name}: every rank needs the same shape and dtype; got {_describe(headers)}")
    total = payload.view(torch.float64) if is_dict else payload.view(_sum_dtype(value)).view(value.shape)
    if carried is not None and payload.numel() <= carried.shape[1]:  # every rank's values came with the header
        total = carried[:, : payload.numel()].contiguous().view(total.dtype).sum(0).view(total.shape)
    elif carried is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    total /= get_world_size(group)
    if not is_dict:
        out_dtype = value.dtype if value.is_floating_point() or value.is_complex() else torch.float64
        return total.to(device=value.device, dtype=out_dtype)
    means = dict(zip(keys, total.tolist()))
    return {key: means[key] for key in value}


def gather_for_metrics(results, indices, num_samples, group=None):
    """Put the per-sample results of a sharded evaluation back into dataset order.

    `results` holds one row per sample this rank evaluated, `indices` each row's dataset index (e.g.
    `torch.tensor(list(iter(sampler)))` for a `DistributedSampler`), `num_samples` the dataset's length. Every rank gets
    the same new tensor of shape `(num_samples, *results.shape[1:])` on the input's device, whose row i is the result
    for sample i: each sample once, shuffled or not, the duplicates a `DistributedSampler` pads with dropped (the row
    kept is the lowest rank's, the first on that rank). `num_samples` may be below the world size.

    Collectives: as in `all_gather_concat`, results and indices together.

    Raises on every rank: ValueError when dtypes, sizes after dim 0 or `num_samples` differ between ranks, when an index
    is outside `range(num_samples)`, or when no rank holds a sample; TypeError or ValueError on a rank whose arguments
    are wrong: not tensors, or not one index per row (ValueError naming that rank on the others).
    """
    name = "gather_for_metrics"
    device = _collective_device(name, group, results)
    read_input = functools.partial(_metrics_bytes, name, results, indices, num_samples, device)
    headers, payload, carried = _exchange_headers(name, group, device, read_input, results, num_samples)
    if len({(header.dtype, header.setting, header.shape[1:]) for header in headers}) > 1:
        numbers = ", ".join(str(header.setting) for header in headers)
        raise ValueError(
            f"{name}: every rank needs the same dtype, sizes after dim 0 and num_samples; got {_describe(headers)}; "
            f"num_samples {numbers}"
        )
    row_shape, counts, row_bytes = _rows(headers, results.element_size())
    sizes = [n * (row_bytes + 8) for n in counts]
    chunks = _gather_bytes(payload, sizes, group, carried).wait().split(sizes)
    # cat() copies into fresh memory, aligned for the int64 view.
    all_indices = torch.cat([chunk[n * row_bytes :] for chunk, n in zip(chunks, counts)]).view(torch.int64)
    all_rows = torch.cat([chunk[: n * row_bytes] for chunk, n in zip(chunks, counts)]).view(sum(counts), row_bytes)
    outside = ((all_indices < 0) | (all_indices >= num_samples)).nonzero().flatten()
    if outside.numel():
        position = outside[0].item()
        rank = bisect.bisect_right(list(itertools.accumulate(counts)), position)
        raise ValueError(
            f"{name}: rank {rank} holds index {all_indices[position].item()}, outside range(num_samples={num_samples})"
        )
    # For each sample, the first row that holds it: a gather, so that duplicates cannot mix bytes.
    first = torch.full((num_samples,), len(all_indices), dtype=torch.int64, device=device)
    first.scatter_reduce_(0, all_indices, torch.arange(len(all_indices), device=device), reduce="amin")
    missing = (first == len(all_indices)).nonzero().flatten()
    if missing.numel():
        raise ValueError(
            f"{name}: {missing.numel()} of {num_samples} samples are held by no rank, "
            f"e.g. indices {missing[:8].tolist()}"
        )
    ordered = all_rows[first].reshape(-1).view(results.dtype).view(num_samples, *row_shape)
    return ordered.to(results.device)


# ---------------------------------------------------------------------------------------------------------------------
# Internals. Every error is raised, never returned. Bad input on one rank: the reader that finds it raises TypeError or
# ValueError inside _exchange_headers, which sends the rank's error flag and re-raises after the header all-gather,
# while the other ranks raise a ValueError naming that rank. Ranks that disagree, which only the headers show: every
# rank raises the same ValueError.


class _Header(typing.NamedTuple):
    """One rank's header, as every rank receives it."""

    failed: bool  # that rank's input was bad: it raises its own error
    dtype: torch.dtype
    shape: tuple
    # What every rank must send the same: requires grad (the gathers), the kind of input and its keys (all_reduce_mean),
    # num_samples (gather_for_metrics).
    setting: int


def _exchange_headers(name, group, device, read_input, described=None, setting=0):
    """All-gather every rank's `_Header` on `device` (one collective); a rank's data rides along when it fits.

    `read_input()` returns this rank's data as flat uint8 on `device`, or raises for bad input. The header describes
    the tensor `described` (default: that data) and carries `setting`. Returns (every rank's `_Header`, this rank's
    data, `carried`): `carried[r]` starts with rank r's data if it fitted (None without a process group).
    """
    try:
        payload, error = read_input(), None
        described = payload if described is None else described
        row = [0, _DTYPE_CODES[described.dtype], described.dim(), setting, *described.shape]
    except (TypeError, ValueError) as exc:
        payload, error, row = None, exc, [1]
    row += [0] * (_HEADER_LEN - len(row))
    rows, carried = [row], None
    if _initialized():
        world = dist.get_world_size(group)
        room = _header_room(world)
        # A tiny call's tensor operations cost about as much as its collective (bench_gather.py --only tiny), hence
        # few: the header's bytes straight from the ints, one cat for the row.
        head = torch.frombuffer(array.array("q", row), dtype=torch.uint8).to(device)
        data = payload if payload is not None and payload.numel() <= room else head[:0]
        padding = torch.zeros(room - data.numel(), dtype=torch.uint8, device=device)
        local = torch.cat([head, data, padding])
        gathered = torch.empty(world * local.numel(), dtype=torch.uint8, device=device)
        _all_gather_equal(gathered, local, group).wait()
        gathered = gathered.view(world, local.numel())
        rows = gathered.narrow(1, 0, _HEADER_BYTES).view(torch.int64).tolist()
        carried = gathered.narrow(1, _HEADER_BYTES, room)
    if error is not None:
        raise error
    headers = [
        _Header(row[0] == 1, _DTYPES[row[1]], tuple(row[_SHAPE_AT : _SHAPE_AT + row[2]]), row[3]) for row in rows
    ]
    failed = [str(rank) for rank, header in enumerate(headers) if header.failed]
    if failed:
        raise ValueError(
            f"{name}: rank {', '.join(failed)} passed invalid input (its own error says why); no data was exchanged"
        )
    return headers, payload, carried


def _header_room(world):
    """Bytes of data each rank's header row carries (see _HEADER_ROOM_BYTES): the same on every rank of a group."""
    # A multiple of 16 keeps every row, and the int64 header at its start, aligned.
    return min(_HEADER_ROOM_BYTES, _HEADER_MAX_ROOM_TOTAL // world) // 16 * 16


def _rows(headers, element_size):
    """(shape after dim 0, every rank's dim-0 size, bytes per row) of tensors gathered along dim 0."""
    row_shape = headers[0].shape[1:]
    return row_shape, [header.shape[0] for header in headers], math.prod(row_shape) * element_size


def _describe(headers):
    return "; ".join(
        f"rank {r}: {str(header.dtype).replace('torch.', '')}{list(header.shape)}" for r, header in enumerate(headers)
    )


def _all_gather_equal(out, inp, group):
    """Start an all-gather of equal-size `inp` from every rank into `out` with the best collective."""
    if hasattr(dist, "all_gather_single"):  # torch >= 2.13
        return dist.all_gather_single(out, inp, group=group, async_op=True)
    if hasattr(dist, "all_gather_into_tensor"):  # torch 1.13 to 2.12
        try:
            return dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
        except RuntimeError as e:  # gloo before torch 2.2 refuses it before sending anything, on every rank
            if "_allgather_base" not in str(e):
                raise
    return dist.all_gather(list(out.split(inp.numel())), inp, group=group, async_op=True)


def _gather_bytes(payload, sizes, group, carried, to_result=lambda packed: packed):
    """Start gathering every rank's data, `sizes[r]` bytes from rank r, after `_exchange_headers` returned `payload`
    and `carried`. Returns a GatherHandle whose `wait()` gives `to_result(packed)`, all ranks' bytes in rank order."""
    if carried is None:  # no process group
        return GatherHandle([], lambda: to_result(payload.clone()))
    largest = max(sizes)
    if largest <= carried.shape[1]:  # every rank's data came with the header
        if largest == min(sizes):  # one copy, not one slice per rank
            packed = carried.narrow(1, 0, largest).reshape(-1)
        else:
            packed = torch.cat([carried[r, :n] for r, n in enumerate(sizes)])
        return GatherHandle([], lambda: to_result(packed))
    out = torch.empty(sum(sizes), dtype=torch.uint8, device=payload.device)
    backend = _device_backends(group).get(payload.device.type)
    few_gloo_ranks = backend == "gloo" and len(sizes) <= _GLOO_BROADCAST_MAX_WORLD
    if largest == min(sizes) and not few_gloo_ranks:
        works = [_all_gather_equal(out, payload, group)]
    elif backend in _UNEVEN_BACKENDS:
        works = [dist.all_gather(list(out.split(sizes)), payload, group=group, async_op=True)]
    else:
        # gloo (see _GLOO_BROADCAST_MAX_WORLD): one broadcast per rank, all in flight at once. For uneven sizes that
        # moves each rank's bytes once, where padding to one all-gather would move world x the largest.
        parts = out.split(sizes)
        parts[dist.get_rank(group)].copy_(payload)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        works = [
            dist.broadcast(part, src=ranks[r], group=group, async_op=True)
            for r, part in enumerate(parts)
            if part.numel()
        ]
    return GatherHandle(works, lambda: to_result(out))


def _collective_device(name, group, tensor=None):
    """The device this rank's collectives on `group` use; ValueError when this rank is not in `group`.

    Decided by the group alone, whatever the input, so that every rank picks the same backend: the GPU when the group
    has a GPU backend (NCCL, alone or beside gloo as in "cpu:gloo,cuda:nccl"), else the CPU. On the GPU, the tensor's
    own if it is on one, else the GPU the group is bound to, else the current GPU.
    """
    if not _initialized():
        return torch.device("cpu")
    if group is not None and dist.get_rank(group) < 0:  # every rank is in the default group
        raise ValueError(f"{name}: this rank is not a member of the given group")
    if not _has_gpu_backend(_device_backends(group)):
        return torch.device("cpu")
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        return tensor.device
    bound = getattr(group or dist.group.WORLD, "bound_device_id", None)
    return bound or torch.device("cuda", torch.cuda.current_device())


def _has_gpu_backend(backends):
    """Whether {device type: backend} names a backend for CUDA tensors other than the CPU's: NCCL, where gloo would
    copy them through host memory (gloo alone serves both devices, through the host)."""
    return backends.get("cuda") not in (None, backends.get("cpu"))


def _device_backends(group):
    """{device type: backend name} of `group`, e.g. {"cpu": "gloo", "cuda": "nccl"}: from the backend config, not
    `get_backend`, which says "undefined" for a group made by `init_process_group()` without a backend (on torch 2.14:
    gloo on a machine without GPUs, NCCL alone on one with them)."""
    config = str(dist.get_backend_config(group)) if hasattr(dist, "get_backend_config") else ""
    backends = _parse_backend_config(config)
    if backends is not None:
        return backends
    backend = dist.get_backend(group)  # older torch, or a config without device names
    return {"cuda": backend} if backend == "nccl" else {"cpu": backend, "cuda": backend}


@functools.lru_cache(maxsize=64)
def _parse_backend_config(config):
    """{device type: backend} from e.g. "cpu:gloo,cuda:nccl"; None without device names. Cached because every call
    of every function reads it, and parsing cost more than the lookup."""
    pairs = [pair.partition(":") for pair in config.split(",")]
    if all(separator for _, separator, _ in pairs):
        return {device: backend for device, _, backend in pairs}
    return None


def _object_transport(name, group):
    """(group, device) that all_gather_object's bytes move on for `group`: the CPU whenever it can."""
    device = _collective_device(name, group)
    if device.type == "cpu" or "cpu" in _device_backends(group):  # no process group, or one with a CPU backend
        return group, torch.device("cpu")
    group = group or dist.group.WORLD
    if dist.get_process_group_ranks(group) == list(range(dist.get_world_size())):
        # Every rank is in this call, in the same order as in a new group, so creating one here stays collective and
        # keeps the results in the group's rank order.
        return _cached_gloo_group(group), torch.device("cpu")
    # An NCCL-only subgroup. A gloo group over its ranks alone would advance torch's group counter on them alone, and
    # a later new_group on all ranks would then hang.
    return group, device


@functools.lru_cache(maxsize=None)
def _cached_gloo_group(group):
    # Keyed on the group object itself, so that a re-initialized process group gets a new one.
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo")


def _wants_grad(tensor):
    """Whether the gather must be differentiable: the header carries it, so that every rank agrees."""
    return int(isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled())


def _check_grad_agrees(name, headers):
    if len({header.setting for header in headers}) > 1:
        ranks = "; ".join(f"rank {r}: {'yes' if header.setting else 'no'}" for r, header in enumerate(headers))
        raise ValueError(
            f"{name}: the input must require grad on every rank or on none, as the backward is a collective; "
            f"requires grad: {ranks}"
        )


class _DifferentiableGather(torch.autograd.Function):
    """`gathered`, every rank's rows of `tensor` (`counts[r]` from rank r), as a result whose backward gives this
    rank's rows the sum over ranks of their gradient: one all-reduce of the whole gradient, which unlike a
    reduce-scatter takes any row counts, on gloo too."""

    @staticmethod
    def forward(ctx, tensor, gathered, counts, group, device):
        rank = get_rank(group)
        start = sum(counts[:rank])
        ctx.group, ctx.device, ctx.rows = group, device, slice(start, start + counts[rank])
        # detach(): the same memory, but not a view of an input, which autograd would forbid to modify in place.
        return gathered.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        total = grad.to(device=ctx.device, memory_format=torch.contiguous_format, copy=True)
        if _initialized():
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total[ctx.rows].to(grad.device), None, None, None, None


# Reading this rank's input into flat bytes on `device`: each reader raises TypeError or ValueError for bad input.


def _check_tensor(name, tensor, expected):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected {expected}, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense tensor, got layout {tensor.layout}")
    if tensor.dim() > _MAX_NDIM:
        raise ValueError(f"{name}: at most {_MAX_NDIM} dims are supported, got {tensor.dim()}")


def _input_bytes(name, tensor, device):
    _check_tensor(name, tensor, "a torch.Tensor")
    try:
        return _as_bytes(tensor, device)
    except RuntimeError as exc:  # e.g. a meta tensor, or no memory left on the device
        raise ValueError(f"{name}: could not read this rank's tensor: {exc}") from exc


def _as_bytes(tensor, device):
    """The tensor's data as a flat uint8 tensor on `device`, without copying when it can."""
    dense = tensor.detach() if tensor.requires_grad else tensor
    if dense.is_conj() or dense.is_neg():  # lazy conj/neg views have no plain bytes
        dense = dense.resolve_conj().resolve_neg()
    if dense.device != device:
        dense = dense.to(device)
    return dense.contiguous().view(-1).view(torch.uint8)


class _CpuPickler(pickle.Pickler):
    """Pickles every tensor as a CPU tensor, so that no rank unpickles onto another rank's GPU."""

    def reducer_override(self, obj):
        # A Parameter pickles as its `.data`, a plain tensor that then comes here: moving that one keeps a GPU
        # Parameter a Parameter, as a CPU one stays (`.cpu()` would drop it).
        if isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter) and obj.device.type != "cpu":
            return obj.cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _pickled_bytes(name, obj, device):
    buffer = io.BytesIO()
    try:
        _CpuPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
        return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)
    except Exception as exc:  # pickling raises many types: PicklingError, TypeError, AttributeError
        raise TypeError(f"{name}: could not pickle {type(obj).__name__}: {exc}") from exc


def _sum_dtype(tensor):
    # At least 32 bits for floats and complex, as the CPU cannot sum complex32; float64 holds any count exactly.
    if tensor.is_floating_point():
        return torch.float32 if tensor.element_size() < 4 else tensor.dtype
    if tensor.is_complex():
        return torch.complex64 if tensor.element_size() < 8 else tensor.dtype
    return torch.float64


def _sum_input_bytes(name, tensor, device):
    """A copy of the tensor in its `_sum_dtype`, for the all-reduce to sum into."""
    _check_tensor(name, tensor, "a torch.Tensor or a dict")
    try:
        # Contiguous, so that every rank's all-reduce pairs elements by index, whatever the input's strides.
        dense = tensor.detach().resolve_conj().resolve_neg()
        total = dense.to(device=device, dtype=_sum_dtype(tensor), memory_format=torch.contiguous_format, copy=True)
    except RuntimeError as exc:
        raise ValueError(f"{name}: could not read this rank's tensor: {exc}") from exc
    return total.view(-1).view(torch.uint8)


def _dict_bytes(name, value, keys, device):
    """The dict's values in the order of `keys` (its sorted keys; None when some key is not a str), as float64."""
    try:
        if keys is None:
            raise TypeError("keys must be str")
        numbers = torch.tensor([_number(key, value[key]) for key in keys], dtype=torch.float64, device=device)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise TypeError(f"{name}: expected a dict of str -> real number or one-element tensor ({exc})") from exc
    return numbers.view(torch.uint8)


def _number(key, v):
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise TypeError(f"key {key!r} holds a tensor of shape {list(v.shape)}, not one element")
        v = v.item()  # a 0-d tensor, or one of shape (1,), (1, 1), ... as detectron2's reduce_dict passes
    if isinstance(v, (bool, int, float)):
        return v
    raise TypeError(f"got a {type(v).__name__} value")


def _keys_hash(keys):
    """A non-negative int64 that differs, but for a 2**-56 chance, when the key lists differ."""
    return int.from_bytes(hashlib.blake2b(repr(keys).encode(), digest_size=7).digest(), "big")


def _metrics_bytes(name, results, indices, num_samples, device):
    """The results' bytes, then the indices' as int64; num_samples is checked here too."""
    if isinstance(results, torch.Tensor) and results.dim() == 0:
        raise TypeError(f"{name}: results must have one row per sample, got a 0-d tensor")
    payload = _input_bytes(name, results, device)
    try:
        indices = torch.as_tensor(indices)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name}: indices must be a 1-D integer tensor, got {type(indices).__name__}") from None
    _check_tensor(name, indices, "1-D integer indices")
    if indices.dim() != 1 or indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise TypeError(f"{name}: indices must be a 1-D integer tensor, got {indices.dtype}{list(indices.shape)}")
    if len(indices) != len(results):
        raise ValueError(f"{name}: {len(indices)} indices for {len(results)} result rows; expected one index per row")
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or not 0 <= num_samples < 2**63:
        raise TypeError(f"{name}: num_samples must be a non-negative int, got {num_samples!r}")
    try:
        return torch.cat([payload, _as_bytes(indices.to(torch.int64), device)])
    except RuntimeError as exc:  # e.g. indices on the meta device
        raise ValueError(f"{name}: could not read this rank's indices: {exc}") from exc
