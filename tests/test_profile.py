"""Tests for train_ddp.py --profile: a real 2-rank gloo run traces its steps, and its trace files,
read back, show DDP at work: gradient all-reduces running on gloo's threads while the backward
still computes on the main thread, and none launched by an accumulating micro-batch's backward.

What torch's profiler writes (a Chrome trace, "traceEvents"), as this file reads it:
- the main thread: "ProfilerStep#N" (a traced step, counted from 0),
  "DistributedDataParallel.forward" (a micro-batch's forward), the backward's ops
  ("autograd::engine::evaluate_function: ConvolutionBackward0" and the like), and
  "c10d::allreduce_", which hands a collective to gloo: nested in a backward op when DDP's reducer
  launches a gradient bucket;
- gloo's threads (pt_gloo_runloop): "gloo:all_reduce" and "gloo:broadcast", each collective's run.
"""
import json
from pathlib import Path

import pytest

import train_ddp
from conftest import RUN_TIMEOUT, TINY, ok, run, torchrun

pytestmark = pytest.mark.timeout(300)  # a backstop: the run below has its own RUN_TIMEOUT

BACKWARD_OP = "autograd::engine::evaluate_function: "
# 2 ranks x 6 steps of 2 micro-batches of 8: the default schedule traces steps 4 to 6.
ACCUMULATING = [*TINY, "--train-samples", "192", "--val-samples", "16", "--epochs", "1",
                "--accum-steps", "2"]


def complete_events(path):
    """A trace's complete events as (name, thread, start, end) in µs, by start, and its main
    thread: the steps'."""
    events = [(e["name"], e["tid"], e["ts"], e["ts"] + e["dur"])
              for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    main = {tid for name, tid, *_ in events if name.startswith("ProfilerStep#")}
    assert len(main) == 1, main
    return sorted(events, key=lambda e: e[2]), main.pop()


def micro_batch_backwards(events, main):
    """Per traced step, per micro-batch: the backward ops on the main thread from the end of its
    forward to the start of the next (or the step's end)."""
    on_main = [e for e in events if e[1] == main]
    steps = []
    for _, _, step_start, step_end in (e for e in on_main if e[0].startswith("ProfilerStep#")):
        in_step = [e for e in on_main if step_start <= e[2] < step_end]
        forwards = [e for e in in_step if e[0] == "DistributedDataParallel.forward"]
        ends = [forward[2] for forward in forwards[1:]] + [step_end]
        steps.append([[e for e in in_step if e[0].startswith(BACKWARD_OP) and start < e[2] < end]
                      for start, end in zip([forward[3] for forward in forwards], ends)])
    return steps


def launched_in(backward, events, main):
    """The all-reduces handed to gloo from inside these backward ops: DDP's gradient buckets."""
    return [e for e in events if e[0] == "c10d::allreduce_" and e[1] == main
            and any(op[2] <= e[2] and e[3] <= op[3] for op in backward)]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A 2-rank run with --accum-steps 2 and --profile: its stdout, its trace directory, and each
    rank's trace files."""
    out = tmp_path_factory.mktemp("profile")
    directory = out / "traces"
    result = ok(run(torchrun(2, *ACCUMULATING, "--checkpoint-dir", out, "--profile", directory),
                    timeout=RUN_TIMEOUT))
    traces = {rank: sorted(directory.glob(f"rank{rank}.*.pt.trace.json")) for rank in range(2)}
    return result.stdout, directory, traces


def test_profile_writes_one_trace_per_rank_and_training_goes_on(traced):
    stdout, directory, traces = traced
    assert [len(paths) for paths in traces.values()] == [1, 1], sorted(directory.glob("*"))
    assert f"--profile: each rank traces steps 4-6 of epoch 1 into {directory}/rank<N>.*" in stdout
    assert "epoch 1/1 step 6/6" in stdout and "epoch 1/1 train_loss" in stdout, stdout
    for rank, (path,) in traces.items():
        trace = json.loads(path.read_text())
        world = trace["distributedInfo"]
        assert (world["rank"], world["world_size"]) == (rank, 2), world
        steps = [e["name"] for e in trace["traceEvents"] if e["name"].startswith("ProfilerStep#")]
        assert steps == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"], steps


@pytest.mark.quick
def test_profile_shows_a_gradient_all_reduce_overlapping_the_backward(traced):
    # A gradient all-reduce: one that starts on a gloo thread once the step's last backward began
    # (the stop agreement's starts before the forward, a log line's after the optimizer step).
    # Overlapping: backward ops start on the main thread while it runs, computing earlier layers.
    # Without the overlap every bucket would wait for the backward's end: even the last bucket,
    # launched from inside the last backward op, sees no backward op start after it.
    for rank, (path,) in traced[2].items():
        events, main = complete_events(path)
        all_reduces = [e for e in events if e[0] == "gloo:all_reduce" and e[1] != main]
        overlapping = [(start, end) for micro_batches in micro_batch_backwards(events, main)
                       for backward in micro_batches[-1:] for _, _, start, end in all_reduces
                       if start >= backward[0][2] and any(start < op[2] < end for op in backward)]
        assert overlapping, f"rank {rank}: no gradient all-reduce ran while the backward computed"


def test_profile_shows_no_all_reduce_in_an_accumulating_micro_batchs_backward(traced):
    # --accum-steps 2: the first micro-batch's backward runs under DDP's no_sync and launches no
    # bucket; the second launches them, which also shows that the micro-batches are told apart.
    for rank, (path,) in traced[2].items():
        events, main = complete_events(path)
        for step, (first, second) in enumerate(micro_batch_backwards(events, main)):
            assert first and second, f"rank {rank} step {step}: a micro-batch without backward ops"
            assert launched_in(first, events, main) == [], f"rank {rank} step {step}"
            assert launched_in(second, events, main), f"rank {rank} step {step}: no bucket launched"


def test_profile_rejects_a_file_as_its_directory(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as ended:
        train_ddp.parse_args(["--arch", "resnet18", "--profile", str(tmp_path / "a_file")])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1, err
    assert f"--profile: cannot write under {tmp_path}/a_file; expected a writable directory" in err
