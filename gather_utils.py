"""All-gather helpers for torch.distributed: sizes may differ between ranks, bad input never hangs.

Copy this file alone into your project: it imports only torch and the standard library.

Every public function
- works unchanged when torch.distributed is not initialized, as a world of one;
- works on gloo (CPU or CUDA tensors) and on NCCL (CUDA tensors; give each rank its GPU with
  `torch.cuda.set_device` or `init_process_group(device_id=...)` first, as torch requires,
  which is also the GPU a rank with bad input sends its header from), and with a subgroup;
- starts with one all-gather of a small fixed-size header per rank (error flag, dtype, shape).
  That header is also the size exchange. If any rank's input is bad, or the ranks disagree,
  every rank raises before any data moves, so the collectives stay aligned and the same
  group keeps working afterwards;
- sends data of up to 8 KiB per rank inside that header, so small payloads take one
  collective in all (past 8 ranks the room per rank shrinks, to stay at 64 KiB in all).

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
# Header layout, one row per rank: _HEADER_LEN int64 [error flag, dtype code, ndim, extra, *shape,
# 0-padding], then room for the rank's data when it is small (see _header_room).
_HEADER_LEN = 16
_ERROR, _DTYPE, _NDIM, _EXTRA, _SHAPE = range(5)  # positions in a header row
_HEADER_BYTES = _HEADER_LEN * 8
_MAX_NDIM = _HEADER_LEN - _SHAPE
# Up to 64 KiB per rank an all-gather costs about what one of 128 bytes costs (bench_gather.py),
# so small payloads ride in the header. 8 KiB of room carries losses, metrics and a few rows,
# while the large calls, whose data moves after the header, send few idle bytes; past 8 ranks
# the room shrinks, to 64 KiB in all.
_HEADER_ROOM_BYTES = 8 << 10
_HEADER_MAX_ROOM_TOTAL = 64 << 10
# Backends whose list-form all_gather accepts different sizes per rank (gloo raises).
_UNEVEN_BACKENDS = ("nccl",)
# On 2 and 4 gloo ranks one broadcast per rank, all in flight at once, beats gloo's own
# all-gather even for equal sizes: about 0.7x to 0.9x its time from 1 to 16 MiB in all
# (bench_gather.py). Gloo's broadcast is a binomial tree of log2(world) steps, though, and its
# two worker threads run two collectives at a time, so the gain shrinks as ranks grow: on more
# ranks than were measured, equal sizes keep the all-gather.
_GLOO_BROADCAST_MAX_WORLD = 4


def _initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None):
    """This process's rank in `group`; 0 when torch.distributed is unavailable or not initialized."""
    return dist.get_rank(group) if _initialized() else 0


def get_world_size(group=None):
    """The number of ranks in `group`; 1 when torch.distributed is unavailable or not initialized."""
    return dist.get_world_size(group) if _initialized() else 1


class GatherHandle:
    """What `all_gather_concat(..., async_op=True)` returns while the data is in flight.

    `wait()` returns the gathered tensor (the same tensor on every later call). What holds
    when it returns depends on where the result lives:
    - on the CPU: every byte has arrived; `wait()` blocked the host until then;
    - on a GPU: on NCCL, `wait()` does not block the host. It makes the current CUDA stream wait
      for the transfer and queues on that stream any copy into the result (with gloo, the bytes
      arrive on the CPU and their copy to the GPU is queued on it too). So work queued later on
      the current stream sees the complete result, and so does reading it on the host
      (`.item()`, `.tolist()`, `.cpu()`), which waits for that stream. On another stream, make
      it wait first: `stream.wait_stream(torch.cuda.current_stream())`.

    `is_completed()` never blocks. True means the collectives have finished (on NCCL, on the
    GPU), so `wait()` will not wait for the network; it does not cover the copy into the
    result, which on a GPU may still be running, and a payload that came with the header is
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

    Every rank gets the same new tensor, with the sum of all ranks' dim-0 sizes as its dim 0,
    on the input's device. Dim-0 sizes may differ (0 included); the other sizes and the dtype
    must match on every rank. A 0-d tensor counts as shape (1,). The input is never modified.

    Collectives: a header all-gather, which also carries the data when every rank has at most
    8 KiB (less past 8 ranks; then that is all). Else the data, straight into the result: one
    all-gather, except on gloo, where uneven sizes, and any sizes on up to 4 ranks, move as one
    broadcast per rank that has data.

    With `async_op=True` it returns a `GatherHandle` once the data is in flight; its `wait()`
    returns the result, so you can overlap compute with the transfer. Leave the input
    unchanged until then.

    Gradients: when `tensor` requires grad (and grad mode is on), the result is differentiable,
    also through `wait()`. Its backward gives each rank's `tensor` the sum over ranks of the
    gradient of that rank's rows, by one all-reduce of the result's whole gradient. Every rank
    must then run the backward through the same graph, or the others wait in that all-reduce.
    Under DDP, which averages gradients over ranks, a loss computed on every rank from the
    result thus gives the gradient of the mean over ranks of that loss. Inputs that do not
    require grad take the same path as before and return a result without grad.

    Raises on every rank: TypeError on a rank that passed a non-tensor (ValueError naming that
    rank on the others), ValueError when dtypes or sizes after dim 0 differ between ranks, or
    when the input requires grad on some ranks only.
    """
    name = "all_gather_concat"
    device = _setup(name, group, tensor)
    if isinstance(tensor, torch.Tensor) and tensor.dim() == 0 and tensor.layout == torch.strided:
        tensor = tensor.reshape(1)
    payload, error = _local_payload(name, tensor, device)
    grad = _wants_grad(tensor)
    rows, inline = _exchange_headers(name, tensor, error, group, device, extra=grad, payload=payload)
    shapes = _shapes(rows)
    if len({(row[_DTYPE], *shape[1:]) for row, shape in zip(rows, shapes)}) > 1:
        raise ValueError(
            f"{name}: every rank needs the same dtype and sizes after dim 0; got {_describe(rows)}"
        )
    _check_grad_agrees(name, rows)
    row_shape = shapes[0][1:]
    counts = [shape[0] for shape in shapes]
    row_bytes = math.prod(row_shape) * tensor.element_size()

    def then(packed):
        out = packed.view(tensor.dtype).view(sum(counts), *row_shape).to(tensor.device)
        return _with_grad(tensor, out, counts, group, device) if grad else out

    handle = _gather_bytes(payload, [n * row_bytes for n in counts], group, inline, then=then)
    return handle if async_op else handle.wait()


def all_gather_tensors(tensor, group=None):
    """Gather every rank's `tensor`, each keeping its own shape.

    Every rank gets the same list of `world_size` tensors in rank order, on the input's device;
    any size, and the number of dims, may differ between ranks, but the dtype must match.
    The tensors are views into one buffer holding all ranks' data.

    Collectives: a header all-gather, then the data as in `all_gather_concat`.

    Gradients: as in `all_gather_concat`: when `tensor` requires grad, the tensors are
    differentiable, and the backward (one all-reduce, on every rank) gives each rank's `tensor`
    the sum over ranks of the gradient of that rank's tensor in the list.

    Raises on every rank: TypeError on a rank that passed a non-tensor (ValueError naming that
    rank on the others), ValueError when the dtypes differ, or when the input requires grad on
    some ranks only.
    """
    name = "all_gather_tensors"
    device = _setup(name, group, tensor)
    payload, error = _local_payload(name, tensor, device)
    grad = _wants_grad(tensor)
    rows, inline = _exchange_headers(name, tensor, error, group, device, extra=grad, payload=payload)
    if len({row[_DTYPE] for row in rows}) > 1:
        raise ValueError(f"{name}: every rank needs the same dtype; got {_describe(rows)}")
    _check_grad_agrees(name, rows)
    shapes = _shapes(rows)
    if grad:  # one flat tensor of every rank's elements, so that the backward runs once
        numels = [math.prod(shape) for shape in shapes]
        packed = _gather_bytes(payload, [n * tensor.element_size() for n in numels], group, inline).wait()
        flat = _with_grad(tensor.reshape(-1), packed.view(tensor.dtype).to(tensor.device), numels, group, device)
        return [chunk.view(shape) for chunk, shape in zip(flat.split(numels), shapes)]
    sizes = [math.prod(shape) * tensor.element_size() for shape in shapes]
    chunks = _gather_bytes(payload, sizes, group, inline).wait().to(tensor.device).split(sizes)
    return [chunk.view(tensor.dtype).view(shape) for chunk, shape in zip(chunks, shapes)]


def all_gather_object(obj, group=None):
    """Gather any picklable object from every rank.

    Every rank gets the same list of `world_size` objects in rank order. Tensors inside the
    objects arrive on the CPU, so nothing lands on another rank's GPU; a `torch.nn.Parameter`
    stays one, with its `requires_grad`, wherever it was.

    Collectives: a header all-gather, then the data as in `all_gather_concat`, on the CPU
    whenever possible, so that it needs no `torch.cuda.set_device`: on a group with a CPU
    backend (gloo), that one; on an NCCL-only group of every rank, a gloo group over the same
    ranks that the first call creates (with torch's default gloo timeout) and later calls
    reuse. On an NCCL-only group of fewer ranks the bytes go through its GPU, so set the device
    first: creating a group for some ranks only would make later `new_group` calls hang.

    Raises on every rank: TypeError on a rank whose object cannot be pickled (ValueError naming
    that rank on the others).
    """
    name = "all_gather_object"
    via, device = _object_route(group, _setup(name, group))
    payload, error = None, None
    try:
        payload = _pickle_to_cpu(obj).to(device)
    except Exception as exc:  # pickling raises many types: PicklingError, TypeError, AttributeError
        error = TypeError(f"{name}: could not pickle {type(obj).__name__}: {exc}")
    rows, inline = _exchange_headers(name, payload, error, via, device, payload=payload)
    sizes = [shape[0] for shape in _shapes(rows)]
    chunks = _gather_bytes(payload, sizes, via, inline).wait().cpu().split(sizes)
    return [pickle.loads(chunk.numpy().tobytes()) for chunk in chunks]


def all_reduce_mean(value, group=None):
    """The mean over ranks of a tensor, or of each entry of a dict.

    - A tensor: every rank gets a new tensor of the same shape on the same device. Floating and
      complex inputs keep their dtype (floats under 32 bits are summed in float32, complex32 in
      complex64); integer and bool inputs give float64.
    - A dict of str -> real number or one-element tensor (any shape, e.g. 0-d or (1,)): every
      rank gets a dict of Python floats with the same keys, summed in float64 so counts and sums
      stay exact. Key order may differ by rank.

    Collectives: 1 when the values, in the dtype they are summed in, fit in the header (8 KiB
    per rank, less past 8 ranks): every rank then sums the gathered values itself, in rank
    order; else 2, the header all-gather and an all-reduce (plus `all_gather_object`'s, only to
    report key sets that differ).

    Raises on every rank: ValueError when shapes or dtypes (tensor), key sets (dict), or the kind
    of input differ between ranks; TypeError on a rank that passed anything else (ValueError
    naming that rank on the others).
    """
    name = "all_reduce_mean"
    device = _setup(name, group, value)
    if isinstance(value, dict):
        keys, total, error = _dict_values(name, value, device)
        spec, kind = total, _keys_hash(keys)  # a non-negative kind marks a dict and its keys
    else:
        keys, (total, error) = None, _accumulator(name, value, device)
        spec, kind = value, -1
    payload = _as_bytes(total, device) if error is None else None
    rows, inline = _exchange_headers(name, spec, error, group, device, extra=kind, payload=payload)
    if len({row[_EXTRA] < 0 for row in rows}) > 1:
        kinds = "; ".join(
            f"rank {r}: {'a tensor' if row[_EXTRA] < 0 else 'a dict'}" for r, row in enumerate(rows)
        )
        raise ValueError(f"{name}: every rank needs the same kind of input; got {kinds}")
    if keys is not None and len({(row[_EXTRA], _shape(row)) for row in rows}) > 1:
        every_keys = all_gather_object(keys, group)
        listing = "; ".join(f"rank {r}: {k}" for r, k in enumerate(every_keys))
        raise ValueError(f"{name}: every rank needs the same keys; got {listing}")
    if keys is None and len({(row[_DTYPE], *_shape(row)) for row in rows}) > 1:
        raise ValueError(f"{name}: every rank needs the same shape and dtype; got {_describe(rows)}")
    if _initialized() and payload.numel() <= inline.shape[1]:
        total = inline[:, : payload.numel()].contiguous().view(total.dtype).sum(0).view(total.shape)
    elif _initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    total /= get_world_size(group)
    if keys is None:
        out_dtype = value.dtype if value.is_floating_point() or value.is_complex() else torch.float64
        return total.to(device=value.device, dtype=out_dtype)
    means = dict(zip(keys, total.tolist()))
    return {k: means[k] for k in value}


def gather_for_metrics(results, indices, num_samples, group=None):
    """Put the per-sample results of a sharded evaluation back into dataset order.

    `results` holds one row per sample this rank evaluated (dim 0), `indices` the dataset index
    of each row, e.g. `torch.tensor(list(iter(sampler)))` for a `DistributedSampler`, and
    `num_samples` the dataset's length. Every rank gets the same new tensor of shape
    `(num_samples, *results.shape[1:])`, on the input's device, whose row i is the result for
    sample i: each sample counted exactly once, whether or not the sampler shuffled, and the
    duplicates a `DistributedSampler` pads with dropped (of a sample's rows, the one from the
    lowest rank, first on that rank, is kept). Works when `num_samples` < world size.

    Collectives: a header all-gather, then results and indices together as in `all_gather_concat`.

    Raises on every rank: ValueError when dtypes, sizes after dim 0 or `num_samples` differ
    between ranks, when an index is outside `range(num_samples)`, or when a sample is held by no
    rank; TypeError or ValueError on a rank whose arguments are wrong: not tensors, or not one
    index per row (ValueError naming that rank on the others).
    """
    name = "gather_for_metrics"
    device = _setup(name, group, results)
    payload, error = _metrics_payload(name, results, indices, num_samples, device)
    rows, inline = _exchange_headers(name, results, error, group, device, extra=num_samples, payload=payload)
    shapes = _shapes(rows)
    if len({(row[_DTYPE], row[_EXTRA], *shape[1:]) for row, shape in zip(rows, shapes)}) > 1:
        numbers = ", ".join(str(row[_EXTRA]) for row in rows)
        raise ValueError(
            f"{name}: every rank needs the same dtype, sizes after dim 0 and num_samples; got "
            f"{_describe(rows)}; num_samples {numbers}"
        )
    row_shape = shapes[0][1:]
    counts = [shape[0] for shape in shapes]
    row_bytes = math.prod(row_shape) * results.element_size()
    sizes = [n * (row_bytes + 8) for n in counts]
    chunks = _gather_bytes(payload, sizes, group, inline).wait().split(sizes)
    # cat() copies into fresh memory, aligned for the int64 view.
    all_indices = torch.cat([chunk[n * row_bytes :] for chunk, n in zip(chunks, counts)]).view(torch.int64)
    all_rows = torch.cat([chunk[: n * row_bytes] for chunk, n in zip(chunks, counts)]).view(
        sum(counts), row_bytes
    )
    outside = ((all_indices < 0) | (all_indices >= num_samples)).nonzero().flatten()
    if outside.numel():
        position = outside[0].item()
        rank = bisect.bisect_right(list(itertools.accumulate(counts)), position)
        raise ValueError(
            f"{name}: rank {rank} holds index {all_indices[position].item()}, "
            f"outside range(num_samples={num_samples})"
        )
    # For each sample, the first row that holds it: a gather, so duplicates cannot mix bytes.
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


# ---------------------------------------------------------------------------------------------
# Internals: the header exchange, the byte transfer, and small helpers.


def _setup(name, group, tensor=None):
    """Check membership, then return the device this rank's collectives on `group` use.

    That is the CPU whenever the group has a CPU backend, whatever the input, so that every
    rank picks the same; on an NCCL-only group, the tensor's GPU if it is on one, else the GPU
    the group is bound to, else the current GPU.
    """
    if not _initialized():
        return torch.device("cpu")
    if group is not None and dist.get_rank(group) < 0:  # every rank is in the default group
        raise ValueError(f"{name}: this rank is not a member of the given group")
    if "cpu" in _device_backends(group):
        return torch.device("cpu")
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        return tensor.device
    bound = getattr(group or dist.group.WORLD, "bound_device_id", None)
    return bound or torch.device("cuda", torch.cuda.current_device())


def _local_payload(name, tensor, device):
    """(this rank's tensor as flat bytes on `device`, None), or (None, the error it deserves).

    Every failure is caught here, before the header exchange, so that it reaches the other
    ranks as an error flag instead of leaving them waiting in the data collective.
    """
    error = _input_error(name, tensor, "a torch.Tensor")
    if error is not None:
        return None, error
    try:
        return _as_bytes(tensor, device), None
    except RuntimeError as exc:  # e.g. a meta tensor, or no memory left on the device
        return None, ValueError(f"{name}: could not read this rank's tensor: {exc}")


def _input_error(name, tensor, expected):
    """The error for an input the header cannot describe, or None: checked on this rank alone."""
    if not isinstance(tensor, torch.Tensor):
        return TypeError(f"{name}: expected {expected}, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        return TypeError(f"{name}: expected a dense tensor, got layout {tensor.layout}")
    if tensor.dim() > _MAX_NDIM:
        return ValueError(f"{name}: at most {_MAX_NDIM} dims are supported, got {tensor.dim()}")
    return None


def _as_bytes(tensor, device):
    """The tensor's data as a flat uint8 tensor on `device`, without copying when it can."""
    dense = tensor.detach() if tensor.requires_grad else tensor
    if dense.is_conj() or dense.is_neg():  # lazy conj/neg views have no plain bytes
        dense = dense.resolve_conj().resolve_neg()
    if dense.device != device:
        dense = dense.to(device)
    return dense.contiguous().view(-1).view(torch.uint8)


def _header_room(world):
    """Bytes of data each rank's header row carries: the same on every rank of a group."""
    # A multiple of 16 keeps every row, and the int64 header at its start, aligned.
    return min(_HEADER_ROOM_BYTES, _HEADER_MAX_ROOM_TOTAL // world) // 16 * 16


def _exchange_headers(name, spec, error, group, device, extra=0, payload=None):
    """All-gather one header row per rank, made from `spec`'s dtype and shape (one collective).

    `payload` (flat uint8 on `device`) rides along when it fits in the header's room.
    Returns (rows as lists, inline): inline[r] holds rank r's payload if it fitted (None
    without a process group). Raises on every rank, before any data moves, if any rank's
    input was bad (`error` on this rank).
    """
    header = [1] + [0] * (_HEADER_LEN - 1)
    if error is None:
        header = [0, _DTYPES.index(spec.dtype), spec.dim(), extra, *spec.shape]
        header += [0] * (_HEADER_LEN - len(header))
    rows, inline = [header], None
    if _initialized():
        world = dist.get_world_size(group)
        room = _header_room(world)
        # A tiny call's tensor operations cost about as much as its collective (bench_gather.py
        # --only tiny), hence few: the header's bytes straight from the ints, one cat for the row.
        head = torch.frombuffer(array.array("q", header), dtype=torch.uint8).to(device)
        data = payload if payload is not None and payload.numel() <= room else head[:0]
        padding = torch.zeros(room - data.numel(), dtype=torch.uint8, device=device)
        local = torch.cat([head, data, padding])
        gathered = torch.empty(world * local.numel(), dtype=torch.uint8, device=device)
        _all_gather_equal(gathered, local, group).wait()
        gathered = gathered.view(world, local.numel())
        rows = gathered.narrow(1, 0, _HEADER_BYTES).view(torch.int64).tolist()
        inline = gathered.narrow(1, _HEADER_BYTES, room)
    if error is not None:
        raise error
    bad = [rank for rank, row in enumerate(rows) if row[_ERROR]]
    if bad:
        raise ValueError(
            f"{name}: rank {', '.join(map(str, bad))} passed invalid input (its own error says why); "
            "no data was exchanged"
        )
    return rows, inline


def _shape(row):
    return tuple(row[_SHAPE : _SHAPE + row[_NDIM]])


def _shapes(rows):
    return [_shape(row) for row in rows]


def _describe(rows):
    return "; ".join(
        f"rank {r}: {str(_DTYPES[row[_DTYPE]]).replace('torch.', '')}{list(_shape(row))}"
        for r, row in enumerate(rows)
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


def _gather_bytes(local, sizes, group, inline, then=lambda packed: packed):
    """Start gathering every rank's flat uint8 data, `sizes[r]` bytes from rank r.

    `inline` is what `_exchange_headers` returned with `local` as its payload. Returns a
    GatherHandle whose `wait()` gives `then(packed)`, where `packed` holds all ranks' bytes
    concatenated in rank order.
    """
    if inline is None:  # no process group
        return GatherHandle([], lambda: then(local.clone()))
    largest = max(sizes)
    if largest <= inline.shape[1]:  # every rank's data came with the header
        if largest == min(sizes):  # one copy, not one slice per rank
            packed = inline.narrow(1, 0, largest).reshape(-1)
        else:
            packed = torch.cat([inline[r, :n] for r, n in enumerate(sizes)])
        return GatherHandle([], lambda: then(packed))
    out = torch.empty(sum(sizes), dtype=torch.uint8, device=local.device)
    backend = _device_backends(group).get(local.device.type)
    few_gloo_ranks = backend == "gloo" and len(sizes) <= _GLOO_BROADCAST_MAX_WORLD
    if largest == min(sizes) and not few_gloo_ranks:
        works = [_all_gather_equal(out, local, group)]
    elif backend in _UNEVEN_BACKENDS:
        works = [dist.all_gather(list(out.split(sizes)), local, group=group, async_op=True)]
    else:
        # gloo (see _GLOO_BROADCAST_MAX_WORLD): one broadcast per rank, all in flight at once. For
        # uneven sizes that moves each rank's bytes once, where padding to one all-gather would
        # move world x the largest.
        parts = out.split(sizes)
        parts[dist.get_rank(group)].copy_(local)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        works = [
            dist.broadcast(part, src=ranks[r], group=group, async_op=True)
            for r, part in enumerate(parts)
            if part.numel()
        ]
    return GatherHandle(works, lambda: then(out))


def _wants_grad(tensor):
    """Whether the gather must be differentiable: the header carries it, so every rank agrees."""
    return int(isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled())


def _check_grad_agrees(name, rows):
    if len({row[_EXTRA] for row in rows}) > 1:
        ranks = "; ".join(f"rank {r}: {'yes' if row[_EXTRA] else 'no'}" for r, row in enumerate(rows))
        raise ValueError(
            f"{name}: the input must require grad on every rank or on none, as the backward is a "
            f"collective; requires grad: {ranks}"
        )


def _with_grad(tensor, gathered, counts, group, device):
    """`gathered` (every rank's rows of `tensor`, `counts[r]` from rank r), differentiable."""
    start = sum(counts[: get_rank(group)])
    return _GatherBackward.apply(tensor, gathered, group, device, start)


class _GatherBackward(torch.autograd.Function):
    """The gather's adjoint: each rank's rows get the sum over ranks of their gradient.

    One all-reduce of the whole gradient, then this rank's rows: unlike a reduce-scatter, it
    takes any row counts, on gloo too.
    """

    @staticmethod
    def forward(ctx, tensor, gathered, group, device, start):
        ctx.group, ctx.device, ctx.rows = group, device, slice(start, start + len(tensor))
        # detach(): the same memory, but not a view of an input, which autograd would forbid
        # to modify in place.
        return gathered.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        total = grad.to(device=ctx.device, memory_format=torch.contiguous_format, copy=True)
        if _initialized():
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total[ctx.rows].to(grad.device), None, None, None, None


class _CpuPickler(pickle.Pickler):
    """Pickles every tensor as a CPU tensor, so no rank unpickles onto another rank's GPU."""

    def reducer_override(self, obj):
        # A Parameter pickles as its `.data`, a plain tensor that then comes here: moving that
        # one keeps a GPU Parameter a Parameter, as a CPU one stays (`.cpu()` would drop it).
        if isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter) and obj.device.type != "cpu":
            return obj.cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _pickle_to_cpu(obj):
    buffer = io.BytesIO()
    _CpuPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def _device_backends(group):
    """{device type: backend name} of `group`, e.g. {"cpu": "gloo", "cuda": "nccl"}.

    From the backend config, not `get_backend`, which says "undefined" for a group made by
    `init_process_group()` without a backend (on torch 2.14: gloo on a machine without GPUs,
    NCCL alone on one with them).
    """
    config = str(dist.get_backend_config(group)) if hasattr(dist, "get_backend_config") else ""
    backends = _parse_backend_config(config)
    if backends is not None:
        return backends
    backend = dist.get_backend(group)  # older torch, or a config without device names
    return {"cuda": backend} if backend == "nccl" else {"cpu": backend, "cuda": backend}


@functools.lru_cache(maxsize=64)
def _parse_backend_config(config):
    """{device type: backend} from e.g. "cpu:gloo,cuda:nccl"; None without device names.
    Cached: every call of every function reads it, and parsing cost more than the lookup."""
    pairs = [pair.partition(":") for pair in config.split(",")]
    if all(separator for _, separator, _ in pairs):
        return {device: backend for device, _, backend in pairs}
    return None


def _object_route(group, device):
    """(group, device) that all_gather_object's bytes move on, from `_setup`'s device for `group`:
    the CPU whenever it can."""
    if device.type == "cpu":  # no process group, or one with a CPU backend
        return group, device
    group = group or dist.group.WORLD
    if dist.get_process_group_ranks(group) == list(range(dist.get_world_size())):
        # Every rank is in this call, in the same order as in a new group, so creating one
        # here stays collective and keeps the results in the group's rank order.
        return _cached_gloo_group(group), torch.device("cpu")
    # An NCCL-only subgroup. A gloo group over its ranks alone would advance torch's group
    # counter on them alone, and a later new_group on all ranks would then hang.
    return group, device


@functools.lru_cache(maxsize=None)
def _cached_gloo_group(group):
    # Keyed on the group object itself, so a re-initialized process group gets a new one.
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo")


def _accumulator(name, value, device):
    """(a float copy of `value` on `device` to sum into, None), or (None, the error it deserves)."""
    error = _input_error(name, value, "a torch.Tensor or a dict")
    if error is not None:
        return None, error
    # Floats under 32 bits, and complex32, are summed at 32-bit precision (the CPU cannot sum complex32).
    if value.is_floating_point():
        dtype = torch.float32 if value.element_size() < 4 else value.dtype
    elif value.is_complex():
        dtype = torch.complex64 if value.element_size() < 8 else value.dtype
    else:
        dtype = torch.float64
    try:
        # Contiguous, so that every rank's all-reduce pairs elements by index, whatever the input's strides.
        dense = value.detach().resolve_conj().resolve_neg()
        return dense.to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True), None
    except RuntimeError as exc:
        return None, ValueError(f"{name}: could not read this rank's tensor: {exc}")


def _dict_values(name, value, device):
    """(sorted keys, their values as float64 on `device`, None), or ([], None, the error)."""
    try:
        if not all(isinstance(k, str) for k in value):
            raise TypeError("keys must be str")
        keys = sorted(value)
        numbers = torch.tensor([_number(k, value[k]) for k in keys], dtype=torch.float64, device=device)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        return [], None, TypeError(
            f"{name}: expected a dict of str -> real number or one-element tensor ({exc})"
        )
    return keys, numbers, None


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


def _metrics_payload(name, results, indices, num_samples, device):
    """(results then int64 indices as flat bytes on `device`, None), or (None, the error)."""
    if isinstance(results, torch.Tensor) and results.dim() == 0:
        return None, TypeError(f"{name}: results must have one row per sample, got a 0-d tensor")
    payload, error = _local_payload(name, results, device)
    if error is not None:
        return None, error
    try:
        indices = torch.as_tensor(indices)
    except (TypeError, ValueError, RuntimeError):
        return None, TypeError(f"{name}: indices must be a 1-D integer tensor, got {type(indices).__name__}")
    error = _input_error(name, indices, "1-D integer indices")
    if error is not None:
        return None, error
    if (
        indices.dim() != 1
        or indices.is_floating_point()
        or indices.is_complex()
        or indices.dtype == torch.bool
    ):
        return None, TypeError(
            f"{name}: indices must be a 1-D integer tensor, got {indices.dtype}{list(indices.shape)}"
        )
    if len(indices) != len(results):
        return None, ValueError(
            f"{name}: {len(indices)} indices for {len(results)} result rows; expected one index per row"
        )
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or not 0 <= num_samples < 2**63:
        return None, TypeError(f"{name}: num_samples must be a non-negative int, got {num_samples!r}")
    try:
        return torch.cat([payload, _as_bytes(indices.to(torch.int64), device)]), None
    except RuntimeError as exc:  # e.g. indices on the meta device
        return None, ValueError(f"{name}: could not read this rank's indices: {exc}")
