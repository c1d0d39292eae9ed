"""All-gather helpers for torch.distributed: sizes may differ between ranks, bad input never hangs.

Copy this file alone into your project: it imports only torch and the standard library.

Every public function
- works unchanged when torch.distributed is not initialized, as a world of one;
- works on gloo (CPU or CUDA tensors) and on NCCL (CUDA tensors), and with a subgroup;
- starts with one all-gather of a small fixed-size header per rank (error flag, dtype, shape).
  That header is also the size exchange. If any rank's input is bad, or the ranks disagree,
  every rank raises before any data moves, so the collectives stay aligned and the same
  group keeps working afterwards.

Tensors move as raw bytes, so every dtype works (bool, complex, 8/16-bit floats, ...).
"""

import functools
import io
import math
import pickle
import zlib

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
# Header layout, one int64 row per rank: [error flag, dtype code, ndim, extra, *shape, 0-padding].
_HEADER_LEN = 16
_MAX_NDIM = _HEADER_LEN - 4
# Backends whose list-form all_gather accepts different sizes per rank (gloo raises).
_UNEVEN_BACKENDS = ("nccl",)
# On gloo, uneven payloads of at least this many bytes in all move as one broadcast per rank
# rather than one padded all-gather (measured by bench_gather.py).
_BROADCAST_MIN_BYTES = 1 << 20


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

    `wait()` blocks until the transfer is done and returns the gathered tensor (the same
    tensor on every later call). `is_completed()` asks without blocking.
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

    Collectives: a header all-gather, then the data: one all-gather when sizes are equal
    (straight into the result) or on NCCL; on gloo, uneven sizes under 1 MiB in all pad once
    into one all-gather, and larger ones move as one broadcast per rank (no padding).

    With `async_op=True` it returns a `GatherHandle` once the data all-gather is in flight;
    its `wait()` returns the result, so you can overlap compute with the transfer. Leave the
    input unchanged until then.

    Raises on every rank: TypeError on a rank that passed a non-tensor (ValueError naming that
    rank on the others), ValueError when dtypes or sizes after dim 0 differ between ranks.
    """
    name = "all_gather_concat"
    device = _comm_device(group)
    flat = tensor.detach().reshape(1) if _is_tensor(tensor) and tensor.dim() == 0 else tensor
    rows = _exchange_headers(name, flat, group, device)
    dtypes, shapes = _dtypes(rows), _shapes(rows)
    if len(set(dtypes)) > 1 or len({s[1:] for s in shapes}) > 1:
        raise ValueError(
            f"{name}: every rank needs the same dtype and the same sizes after dim 0; got " + _describe(rows)
        )
    row_shape = shapes[0][1:]
    row_bytes = math.prod(row_shape) * flat.element_size()
    counts = [s[0] for s in shapes]
    handle = _gather_bytes(
        _as_bytes(flat, device),
        [n * row_bytes for n in counts],
        group,
        then=lambda packed: packed.view(flat.dtype).view(sum(counts), *row_shape).to(tensor.device),
    )
    return handle if async_op else handle.wait()


def all_gather_tensors(tensor, group=None):
    """Gather every rank's `tensor`, each keeping its own shape.

    Every rank gets the same list of `world_size` tensors in rank order, on the input's device;
    any size, and the number of dims, may differ between ranks, but the dtype must match.
    The tensors are views into one buffer holding all ranks' data.

    Collectives: a header all-gather, then the data as in `all_gather_concat`.

    Raises on every rank: TypeError on a rank that passed a non-tensor (ValueError naming that
    rank on the others), ValueError when the dtypes differ.
    """
    name = "all_gather_tensors"
    device = _comm_device(group)
    rows = _exchange_headers(name, tensor, group, device)
    if len(set(_dtypes(rows))) > 1:
        raise ValueError(f"{name}: every rank needs the same dtype; got " + _describe(rows))
    shapes = _shapes(rows)
    sizes = [math.prod(s) * tensor.element_size() for s in shapes]
    chunks = _gather_bytes(_as_bytes(tensor, device), sizes, group).wait().split(sizes)
    return [c.view(tensor.dtype).view(s).to(tensor.device) for c, s in zip(chunks, shapes)]


def all_gather_object(obj, group=None):
    """Gather any picklable object from every rank.

    Every rank gets the same list of `world_size` objects in rank order. Tensors inside the
    objects arrive on the CPU, so nothing lands on another rank's GPU.

    Collectives: a header all-gather, then the data as in `all_gather_concat`, always over gloo
    on the CPU, so it never needs `torch.cuda.set_device`. On a group whose backend has no gloo
    part (plain NCCL), the first call creates a gloo group over the same ranks and reuses it.

    Raises on every rank: TypeError on a rank whose object cannot be pickled (ValueError naming
    that rank on the others).
    """
    name = "all_gather_object"
    payload, error = None, None
    try:
        payload = _pickle_to_cpu(obj)
    except Exception as exc:  # pickling raises many types: PicklingError, TypeError, AttributeError
        error = TypeError(f"{name}: could not pickle {type(obj).__name__}: {exc}")
    cpu_group = _gloo_group(group)
    cpu = torch.device("cpu")
    rows = _exchange_headers(name, payload, cpu_group, cpu, error=error)
    sizes = [s[0] for s in _shapes(rows)]
    chunks = _gather_bytes(payload, sizes, cpu_group).wait().split(sizes)
    return [pickle.loads(c.numpy().tobytes()) for c in chunks]


def all_reduce_mean(value, group=None):
    """The mean over ranks of a tensor, or of each entry of a dict.

    - A tensor: every rank gets a new tensor of the same shape on the same device. Floating and
      complex inputs keep their dtype (16-bit floats are summed in float32); integer and bool
      inputs give float64. Collectives: 2, a header all-gather and the all-reduce.
    - A dict of str -> number or 0-d tensor: every rank gets a dict of Python floats with the
      same keys, summed in float64 so counts and sums stay exact. Collectives: 2.

    Raises on every rank: ValueError when shapes or dtypes (tensor), or key sets (dict), differ
    between ranks; TypeError on a rank that passed anything else (ValueError naming that rank on
    the others).
    """
    name = "all_reduce_mean"
    device = _comm_device(group)
    world = get_world_size(group)
    if isinstance(value, dict):
        keys, values, error = _dict_values(name, value, device)  # keys sorted: order may differ by rank
        rows = _exchange_headers(name, values, group, device, error=error, extra=_keys_hash(keys))
        if len({(row[3], row[4]) for row in rows}) > 1:
            all_keys = all_gather_object(keys, group)  # only on this error path, on every rank
            raise ValueError(
                f"{name}: every rank needs the same keys; got "
                + "; ".join(f"rank {r}: {sorted(k)}" for r, k in enumerate(all_keys))
            )
        if values.numel():
            _all_reduce_sum(values, group)
        means = dict(zip(keys, values.tolist()))
        return {k: means[k] / world for k in value}

    rows = _exchange_headers(name, value, group, device)
    if len({(row[1], *_shape(row)) for row in rows}) > 1:
        raise ValueError(f"{name}: every rank needs the same shape and dtype; got " + _describe(rows))
    if value.is_floating_point() or value.is_complex():
        out_dtype = value.dtype
        acc_dtype = torch.float32 if value.element_size() < 4 and value.is_floating_point() else value.dtype
    else:
        out_dtype = acc_dtype = torch.float64
    total = value.detach().to(device=device, dtype=acc_dtype, copy=True)
    _all_reduce_sum(total, group)
    return total.div_(world).to(device=value.device, dtype=out_dtype)


def gather_for_metrics(results, indices, num_samples, group=None):
    """Put the per-sample results of a sharded evaluation back into dataset order.

    `results` holds one row per sample this rank evaluated (dim 0), `indices` the dataset index
    of each row, e.g. `torch.tensor(list(iter(sampler)))` for a `DistributedSampler`, and
    `num_samples` the dataset's length. Every rank gets the same new tensor of shape
    `(num_samples, *results.shape[1:])`, on the input's device, whose row i is the result for
    sample i: each sample counted exactly once, whether or not the sampler shuffled, and the
    duplicates a `DistributedSampler` pads with dropped (when a sample appears more than once,
    one of its rows is kept). Works when `num_samples` is smaller than the world size.

    Collectives: a header all-gather, then results and indices together as in `all_gather_concat`.

    Raises on every rank: ValueError when dtypes, sizes after dim 0 or `num_samples` differ
    between ranks, when an index is outside `range(num_samples)`, or when a sample is held by no
    rank; TypeError or ValueError on a rank whose arguments are wrong: not tensors, or not one
    index per row (ValueError naming that rank on the others).
    """
    name = "gather_for_metrics"
    device = _comm_device(group)
    error = _check_metrics_args(name, results, indices, num_samples)
    rows = _exchange_headers(
        name, results, group, device, error=error, extra=num_samples if error is None else 0
    )
    dtypes, shapes = _dtypes(rows), _shapes(rows)
    if len(set(dtypes)) > 1 or len({(s[1:], row[3]) for s, row in zip(shapes, rows)}) > 1:
        raise ValueError(
            f"{name}: every rank needs the same dtype, sizes after dim 0 and num_samples; got "
            + _describe(rows)
            + " with num_samples "
            + ", ".join(str(row[3]) for row in rows)
        )
    row_bytes = math.prod(shapes[0][1:]) * results.element_size()
    index_bytes = _as_bytes(torch.as_tensor(indices).to(torch.int64), device)
    payload = torch.cat([_as_bytes(results, device), index_bytes])
    counts = [s[0] for s in shapes]
    sizes = [n * (row_bytes + 8) for n in counts]
    packed = _gather_bytes(payload, sizes, group).wait()

    out = torch.empty(num_samples, row_bytes, dtype=torch.uint8, device=device)
    seen = torch.zeros(num_samples, dtype=torch.bool, device=device)
    for rank, chunk in enumerate(packed.split(sizes)):
        n = counts[rank]
        # clone() realigns the index bytes: they may start at an offset that int64 cannot view.
        rank_indices = chunk[n * row_bytes :].clone().view(torch.int64)
        bad = rank_indices[(rank_indices < 0) | (rank_indices >= num_samples)]
        if bad.numel():
            raise ValueError(
                f"{name}: rank {rank} holds index {bad[0].item()}, outside range(num_samples={num_samples})"
            )
        out[rank_indices] = chunk[: n * row_bytes].view(n, row_bytes)
        seen[rank_indices] = True
    missing = (~seen).nonzero().flatten()
    if missing.numel():
        raise ValueError(
            f"{name}: {missing.numel()} of {num_samples} samples are held by no rank, "
            f"e.g. indices {missing[:8].tolist()}"
        )
    return out.view(results.dtype).view(num_samples, *shapes[0][1:]).to(results.device)


# ---------------------------------------------------------------------------------------------
# Internals: the header exchange, the byte transfer, and small helpers.


def _is_tensor(x):
    return isinstance(x, torch.Tensor)


def _comm_device(group):
    """Where this group's collectives run: the current GPU for NCCL, the CPU otherwise."""
    if _initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_tensor(name, tensor, device):
    """The exception this rank's argument deserves, or None."""
    if not _is_tensor(tensor):
        return TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if device.type == "cuda" and tensor.device != device:
        return ValueError(
            f"{name}: the tensor is on {tensor.device} but this rank's NCCL device is {device}; "
            "call torch.cuda.set_device(local_rank) before init_process_group and keep tensors there"
        )
    if tensor.dim() > _MAX_NDIM:
        return ValueError(f"{name}: at most {_MAX_NDIM} dims are supported, got {tensor.dim()}")
    return None


def _exchange_headers(name, tensor, group, device, error=None, extra=0):
    """All-gather one header row per rank (one collective) and return the rows as lists.

    Raises on every rank, before any data moves, if any rank's input was bad.
    """
    if _initialized() and dist.get_rank(group) < 0:
        raise ValueError(f"{name}: this rank is not a member of the given group")
    error = error or _check_tensor(name, tensor, device)
    header = [1] + [0] * (_HEADER_LEN - 1)
    if error is None:
        shape = list(tensor.shape)
        header = [0, _DTYPES.index(tensor.dtype), len(shape), extra, *shape]
        header += [0] * (_HEADER_LEN - len(header))
    world = get_world_size(group)
    if world == 1:
        rows = [header]
    else:
        local = torch.tensor(header, dtype=torch.int64, device=device)
        gathered = torch.empty(world * _HEADER_LEN, dtype=torch.int64, device=device)
        _all_gather_equal(gathered, local, group).wait()
        rows = gathered.view(world, _HEADER_LEN).tolist()
    if error is not None:
        raise error
    bad = [rank for rank, row in enumerate(rows) if row[0]]
    if bad:
        raise ValueError(
            f"{name}: rank {', '.join(map(str, bad))} passed invalid input (its own error says why); "
            "no data was exchanged"
        )
    return rows


def _shape(row):
    return tuple(row[4 : 4 + row[2]])


def _shapes(rows):
    return [_shape(row) for row in rows]


def _dtypes(rows):
    return [_DTYPES[row[1]] for row in rows]


def _describe(rows):
    return "; ".join(
        f"rank {r}: {str(_DTYPES[row[1]]).replace('torch.', '')}{list(_shape(row))}"
        for r, row in enumerate(rows)
    )


def _as_bytes(tensor, device):
    """The tensor's data as a flat uint8 tensor on `device`, without copying when it can."""
    return tensor.detach().to(device).contiguous().view(-1).view(torch.uint8)


def _all_gather_equal(out, inp, group):
    """Start an all-gather of equal-size `inp` from every rank into `out` with the best collective."""
    if hasattr(dist, "all_gather_single"):  # torch >= 2.13
        return dist.all_gather_single(out, inp, group=group, async_op=True)
    if hasattr(dist, "all_gather_into_tensor"):  # torch 1.13 to 2.12
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
    return dist.all_gather(list(out.split(inp.numel())), inp, group=group, async_op=True)


def _gather_bytes(local, sizes, group, then=lambda packed: packed):
    """Start gathering every rank's flat uint8 data, `sizes[r]` bytes from rank r.

    Returns a GatherHandle whose `wait()` gives `then(packed)`, where `packed` holds all ranks'
    bytes concatenated in rank order.
    """
    world, largest = len(sizes), max(sizes)
    if world == 1:
        return GatherHandle([], lambda: then(local.clone()))
    out = torch.empty(sum(sizes), dtype=torch.uint8, device=local.device)
    if largest == min(sizes):
        works = [_all_gather_equal(out, local, group)]
    elif dist.get_backend(group) in _UNEVEN_BACKENDS:
        works = [dist.all_gather(list(out.split(sizes)), local, group=group, async_op=True)]
    elif sum(sizes) >= _BROADCAST_MIN_BYTES:
        # gloo: padding would move world * largest bytes; one broadcast per rank moves each
        # rank's bytes once, and pays for it in per-collective latency (see bench_gather.py).
        parts = out.split(sizes)
        parts[dist.get_rank(group)].copy_(local)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        works = [
            dist.broadcast(part, src=ranks[r], group=group, async_op=True)
            for r, part in enumerate(parts)
            if part.numel()
        ]
    else:
        # gloo, small: pad once, in place in this rank's slot of the gather buffer.
        rank = dist.get_rank(group)
        padded = torch.empty(world * largest, dtype=torch.uint8, device=local.device)
        mine = padded[rank * largest : (rank + 1) * largest]
        mine[: sizes[rank]] = local
        works = [_all_gather_equal(padded, mine, group)]
        trimmed = [padded[r * largest : r * largest + n] for r, n in enumerate(sizes)]
        return GatherHandle(works, lambda: then(torch.cat(trimmed, out=out)))
    return GatherHandle(works, lambda: then(out))


def _all_reduce_sum(tensor, group):
    if get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


class _CpuPickler(pickle.Pickler):
    """Pickles every tensor as a CPU tensor, so no rank unpickles onto another rank's GPU."""

    def reducer_override(self, obj):
        if _is_tensor(obj) and obj.device.type != "cpu":
            return obj.cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _pickle_to_cpu(obj):
    buffer = io.BytesIO()
    _CpuPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def _gloo_group(group):
    """A group over the same ranks that can move CPU tensors: `group` itself unless it is NCCL-only."""
    if not _initialized() or "gloo" in str(dist.get_backend(group)):
        return group
    return _cached_gloo_group(group or dist.group.WORLD)


@functools.lru_cache(maxsize=None)
def _cached_gloo_group(group):
    # Keyed on the group object itself, so a re-initialized process group gets a new one.
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


def _dict_values(name, value, device):
    """(sorted keys, float64 values in key order, error) for a dict of str -> number or 0-d tensor."""
    try:
        if not all(isinstance(k, str) for k in value):
            raise TypeError("keys must be str")
        keys = sorted(value)
        numbers = [_number(value[k]) for k in keys]
    except (TypeError, ValueError) as exc:
        return [], None, TypeError(f"{name}: expected a dict of str -> number or 0-d tensor ({exc})")
    return keys, torch.tensor(numbers, dtype=torch.float64, device=device), None


def _number(v):
    if _is_tensor(v) and v.dim() == 0:
        return v.item()
    if isinstance(v, (bool, int, float)):
        return v
    raise TypeError(f"got a {type(v).__name__} value")


def _keys_hash(keys):
    # Fits an int64: crc32 is 32 bits.
    return zlib.crc32("\0".join(keys).encode())


def _check_metrics_args(name, results, indices, num_samples):
    if not _is_tensor(results) or results.dim() == 0:
        return TypeError(
            f"{name}: results must be a tensor with one row per sample, got {type(results).__name__}"
        )
    try:
        indices = torch.as_tensor(indices)
    except (TypeError, ValueError, RuntimeError):
        return TypeError(f"{name}: indices must be a 1-D integer tensor, got {type(indices).__name__}")
    if (
        indices.dim() != 1
        or indices.is_floating_point()
        or indices.is_complex()
        or indices.dtype == torch.bool
    ):
        return TypeError(
            f"{name}: indices must be a 1-D integer tensor, got {indices.dtype}{list(indices.shape)}"
        )
    if len(indices) != len(results):
        return ValueError(
            f"{name}: {len(indices)} indices for {len(results)} result rows; expected one index per row"
        )
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 0:
        return TypeError(f"{name}: num_samples must be a non-negative int, got {num_samples!r}")
    return None
