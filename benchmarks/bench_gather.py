"""Benchmark gather_utils against the floor, torch's all_gather_object and the seed article's helper.

    torchrun --nproc_per_node 4 benchmarks/bench_gather.py [--mib 4] [--repeats 60] [--only tiny]

Every method runs in the same process group, interleaved round by round, so machine noise hits
them alike. Each round's time is the slowest rank's; the table shows medians over rounds, and
each method's ratio to the floor:

    floor = one all_gather_single of equal chunks moving the same total bytes, scaled for uneven
            sizes by the most bytes any rank must receive (total - own) over what each rank
            receives when sizes are equal: no rank can finish before it has what it lacks.
            A reference, not a bound: on gloo, one broadcast per rank can beat it.
    floor, new output = the same into a newly allocated buffer each call, as any gather that
            returns a new tensor must: on the CPU that allocation is part of the cost.

Then three tables behind gather_utils' choices: the seed article's speed tips, what an
all-gather costs by size (how much data rides in the header), and one all-gather against one
broadcast per rank on gloo, for equal and for skewed sizes. `--only PAYLOAD` measures that row
of the first table alone, e.g. many rounds of the tiny calls.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: train_ddp.py, gather_utils.py

import gather_utils as gu

ROW = 256  # float32 values per row: 1 KiB
WARMUP_ROUNDS = 3


def seed_all_gather_concat(data):
    """The seed article's helper, as published (fixed only so that it runs): sizes, then padded data."""
    world_size = dist.get_world_size()
    local_size = torch.tensor(data.shape[0], device=data.device)
    sizes = [torch.zeros_like(local_size) for _ in range(world_size)]
    dist.all_gather(sizes, local_size)
    sizes = [int(s.item()) for s in sizes]
    max_size = max(sizes)
    padded = torch.zeros(max_size, *data.shape[1:], dtype=data.dtype, device=data.device)
    padded[: data.shape[0]] = data
    gathered = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:s] for g, s in zip(gathered, sizes)], dim=0)


def torch_all_gather_object(data):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, data)
    return torch.cat(out)


def fresh_all_gather(data, sizes):
    """Equal sizes in one gloo all-gather, into a new buffer, as a gather returning a new tensor must."""
    out = torch.empty(sum(sizes), dtype=torch.uint8)
    dist.all_gather_single(out, data)
    return out


def padded_gather(data, sizes):
    """Uneven sizes in one gloo all-gather: pad to the largest, gather, trim."""
    world, rank, largest = len(sizes), dist.get_rank(), max(sizes)
    padded = torch.empty(world * largest, dtype=torch.uint8)
    padded[rank * largest : rank * largest + sizes[rank]] = data
    dist.all_gather_single(padded, padded[rank * largest : (rank + 1) * largest])
    return torch.cat([padded[r * largest : r * largest + n] for r, n in enumerate(sizes)])


def broadcast_gather(data, sizes):
    """Any sizes as one broadcast per rank, all in flight at once."""
    out = torch.empty(sum(sizes), dtype=torch.uint8)
    parts = out.split(sizes)
    parts[dist.get_rank()].copy_(data)
    for work in [dist.broadcast(p, src=r, async_op=True) for r, p in enumerate(parts)]:
        work.wait()
    return out


def payloads(world, mib):
    """Rows per rank for each payload shape; `mib` MiB per rank on average."""
    rows = mib * 1024
    skew = [16] + [1] * (world - 1)
    return {
        "equal": [rows] * world,
        "uneven": [round(2 * rows * (r + 1) / (world + 1)) for r in range(world)],
        "skewed": [round(world * rows * w / sum(skew)) for w in skew],
        "tiny": [8] * world,
    }


def floor_fns(counts):
    """The floor: an equal-size all_gather_single of the same total into a buffer allocated once,
    the same into a new buffer each call (as any gather that returns a new tensor must), and
    the factor that scales both to uneven sizes."""
    world, total = len(counts), sum(counts)
    chunk = torch.empty(-(-total // world) * ROW)
    out = torch.empty(world * chunk.numel())
    scale = max(total - n for n in counts) / ((world - 1) * total / world) if world > 1 else 1.0

    def reused(_):
        dist.all_gather_single(out, chunk)

    def fresh(_):
        dist.all_gather_single(torch.empty_like(out), chunk)

    return reused, fresh, scale


def time_round(fn, data):
    dist.barrier()
    start = time.perf_counter()
    fn(data)
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # after the clock stops: the slowest rank
    return elapsed.item()


def median_ms(methods, data, repeats):
    """Each method's median ms over `repeats` rounds, after WARMUP_ROUNDS; methods take turns
    within each round, so that drift in the machine's speed hits them alike, and each round
    starts one method later, so that none always runs after the same other (the allocator and
    caches carry state from one call to the next)."""
    times = {name: [] for name in methods}
    names = list(methods)
    for round_ in range(WARMUP_ROUNDS + repeats):
        start = round_ % len(names)
        for name in names[start:] + names[:start]:
            t = time_round(methods[name], data)
            if round_ >= WARMUP_ROUNDS:
                times[name].append(t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def bench(counts, repeats):
    rank = dist.get_rank()
    data = torch.randn(counts[rank], ROW)
    floor, floor_fresh, scale = floor_fns(counts)
    methods = {
        "floor": floor,
        "floor, new output": floor_fresh,
        "all_gather_concat": gu.all_gather_concat,
        "all_gather_tensors": gu.all_gather_tensors,
        "torch all_gather_object": torch_all_gather_object,
        "seed all_gather_concat": seed_all_gather_concat,
    }
    expected = gu.all_gather_concat(data)
    for name in ("all_gather_tensors", "torch all_gather_object", "seed all_gather_concat"):
        got = methods[name](data)
        got = torch.cat(got) if isinstance(got, list) else got
        assert torch.equal(got, expected), name
    medians = median_ms(methods, data, repeats)
    medians["floor"] *= scale
    medians["floor, new output"] *= scale
    return medians


def bench_gloo_strategies(repeats):
    """One broadcast per rank against one all-gather (equal sizes) and against padding to one
    all-gather (sizes skewed 16:1), on gloo: the measurement behind gather_utils broadcasting there."""
    world, rank = dist.get_world_size(), dist.get_rank()
    skew = [16] + [1] * (world - 1)
    results = []
    for total_kib in (1, 4, 16, 64, 256, 1024, 4096, 16384):
        row = {}
        for kind, weights, one_collective in (
            ("equal", [1] * world, fresh_all_gather),
            ("skewed", skew, padded_gather),
        ):
            sizes = [total_kib * 1024 * w // sum(weights) for w in weights]
            data = torch.randint(0, 255, (sizes[rank],), dtype=torch.uint8)
            assert torch.equal(one_collective(data, sizes), broadcast_gather(data, sizes))
            methods = {
                "all-gather": lambda d: one_collective(d, sizes),
                "broadcast per rank": lambda d: broadcast_gather(d, sizes),
            }
            row[kind] = median_ms(methods, data, repeats)
        results.append((total_kib, row))
    return results


def bench_header_room(repeats):
    """What an all-gather costs by bytes per rank: how much data can ride in gather_utils' header."""
    world = dist.get_world_size()
    results = []
    for size in (128, 1 << 10, 4 << 10, 8 << 10, 16 << 10, 64 << 10):
        data, out = torch.zeros(size, dtype=torch.uint8), torch.empty(world * size, dtype=torch.uint8)
        medians = median_ms({"all-gather": lambda d: dist.all_gather_single(out, d)}, data, repeats)
        results.append((size, medians["all-gather"]))
    return results


def bench_seed_tips(counts, repeats):
    """Two of the seed article's speed tips, on equal payloads: batched collective, async overlap."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.randn(counts[rank], ROW)
    weight = torch.randn(512, 512)
    compute_input = torch.randn(2048, 512)

    def list_all_gather(d):
        parts = [torch.empty_like(d) for _ in range(world)]
        dist.all_gather(parts, d)
        return torch.cat(parts)

    def single_all_gather(d):
        out = torch.empty(world * d.shape[0], *d.shape[1:])
        dist.all_gather_single(out, d)
        return out

    def compute():
        return compute_input @ weight

    def gather_then_compute(d):
        return gu.all_gather_concat(d), compute()

    def gather_overlapping_compute(d):
        handle = gu.all_gather_concat(d, async_op=True)
        return compute(), handle.wait()

    methods = {
        "list all_gather + cat": list_all_gather,
        "all_gather_single": single_all_gather,
        "compute alone": lambda d: compute(),
        "gather, then compute": gather_then_compute,
        "async gather overlapping compute": gather_overlapping_compute,
    }
    return median_ms(methods, data, repeats)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=4, help="MiB per rank on average")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument(
        "--only", choices=["equal", "uneven", "skewed", "tiny"], help="this row of the first table, no other table"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rows = []
    for kind, counts in payloads(world, args.mib).items():
        if args.only in (None, kind):
            rows.append((kind, counts, bench(counts, args.repeats)))
    if dist.get_rank() == 0:
        names = list(rows[0][2])
        print(f"gloo, {world} ranks, torch {torch.__version__}, median ms of {args.repeats} rounds (x floor)")
        print("| payload | rows per rank | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for kind, counts, medians in rows:
            cells = [f"{medians[n]:.2f} ({medians[n] / medians['floor']:.2f}x)" for n in names]
            print(f"| {kind} | {counts} | " + " | ".join(cells) + " |")
    if args.only:
        dist.destroy_process_group()
        return
    tips = bench_seed_tips(payloads(world, args.mib)["equal"], args.repeats)
    if dist.get_rank() == 0:
        print(f"\ngloo, {world} ranks, equal payloads: the seed's speed tips, median ms")
        print("| method | ms |")
        print("|---|---|")
        for name, ms in tips.items():
            print(f"| {name} | {ms:.2f} |")
    room = bench_header_room(args.repeats)
    if dist.get_rank() == 0:
        print(f"\ngloo, {world} ranks, all_gather_single by bytes per rank: median ms, x the 128-byte time")
        print("| bytes per rank | " + " | ".join(str(size) for size, _ in room) + " |")
        print("|---|" + "---|" * len(room))
        print("| ms | " + " | ".join(f"{ms:.2f} ({ms / room[0][1]:.2f}x)" for _, ms in room) + " |")
    strategies = bench_gloo_strategies(args.repeats)
    if dist.get_rank() == 0:
        print(f"\ngloo, {world} ranks: one all-gather against one broadcast per rank, median ms")
        print("(equal sizes into a new buffer; skewed 16:1, padded), ratio = all-gather / broadcasts")
        print("| total KiB | equal: all-gather | broadcasts | ratio | skewed: padded | broadcasts | ratio |")
        print("|---|---|---|---|---|---|---|")
        for total_kib, row in strategies:
            cells = []
            for m in (row["equal"], row["skewed"]):
                one, bcast = m["all-gather"], m["broadcast per rank"]
                cells += [f"{one:.2f}", f"{bcast:.2f}", f"{one / bcast:.2f}"]
            print(f"| {total_kib} | " + " | ".join(cells) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
