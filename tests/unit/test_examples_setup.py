"""What the examples set up from their flags (examples/common.py), in one process.

The device, without a GPU (torch's CUDA queries faked): one process per GPU, as
Horovod's examples run, the GPU of the process's local rank where each process
sees the node's GPUs (horovodrun, mpirun), the one GPU a process sees where the
launcher binds one per task (srun --gpus-per-task=1), and the CPU with --no-cuda
or without CUDA. The wire: --fp16-allreduce, and the bytes counted for it. And
the LM checkpoints saved before these flags existed.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import common
import fashion_mnist
import lstm_language_model
import transformer_lm

PARSERS = [example.build_parser for example in (fashion_mnist, lstm_language_model, transformer_lm)]


@pytest.fixture
def node(monkeypatch):
    """node(gpus, local_rank): torch sees `gpus` GPUs, Horovod says `local_rank`.

    Returns the list that torch.cuda.set_device's calls go to.
    """
    pinned = []

    def make(gpus, local_rank):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "set_device", pinned.append)
        monkeypatch.setattr(common.hvd, "local_rank", lambda: local_rank)
        return pinned

    return make


def args(*argv):
    return fashion_mnist.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_each_process_takes_the_gpu_of_its_local_rank(node, local_rank):
    pinned = node(gpus=4, local_rank=local_rank)
    assert common.training_device(args()) == torch.device("cuda", local_rank)
    # Pinned as well, so that what CUDA allocates without a device lands there too.
    assert pinned == [local_rank]


def test_a_process_bound_to_one_gpu_takes_that_one(node):
    # srun --gpus-per-task=1: local rank 1 sees one GPU, its own, as GPU 0.
    pinned = node(gpus=1, local_rank=1)
    assert common.training_device(args()) == torch.device("cuda", 0)
    assert pinned == [0]


def test_more_processes_than_gpus_on_a_node_is_refused(node):
    pinned = node(gpus=2, local_rank=2)
    with pytest.raises(RuntimeError, match=r"local rank 2 has no GPU of its own: .* sees 2 GPUs"):
        common.training_device(args())
    assert pinned == []


@pytest.mark.parametrize("build_parser", PARSERS)
def test_no_cuda_keeps_the_cpu_in_every_example(node, build_parser):
    pinned = node(gpus=4, local_rank=1)
    parsed = build_parser().parse_args(["--no-cuda"])
    assert common.training_device(parsed) == torch.device("cpu")
    assert pinned == []
    # The default is the GPU; the flag is Horovod's examples' name for the CPU.
    assert build_parser().parse_args([]).no_cuda is False


def test_without_cuda_the_cpu(node):
    pinned = node(gpus=0, local_rank=0)
    assert common.training_device(args()) == torch.device("cpu")
    assert pinned == []


@pytest.mark.parametrize("build_parser", PARSERS)
def test_fp16_allreduce_picks_horovods_fp16_compressor(build_parser):
    assert common.wire_compression(build_parser().parse_args([])) is common.hvd.Compression.none
    on = build_parser().parse_args(["--fp16-allreduce"])
    assert common.wire_compression(on) is common.hvd.Compression.fp16


def test_plain_horovods_bytes_are_counted_at_the_wire_dtype():
    # Horovod's fp16 compressor halves float32 gradients and leaves other dtypes alone.
    model = torch.nn.Linear(3, 4)  # 16 float32 parameters
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(2, dtype=torch.float64)))
    for compression, per_step in ((common.hvd.Compression.none, 16 * 4 + 2 * 8),
                                  (common.hvd.Compression.fp16, 16 * 2 + 2 * 2)):  # fmt: skip
        meter = common.CommunicationMeter(object(), model, compression)
        meter.step()
        meter.step()
        assert meter.totals()["bytes_sent"] == 2 * per_step
        assert meter.totals()["elements_sent"] == 2 * 18


@pytest.mark.parametrize("example", [lstm_language_model, transformer_lm])
def test_lm_checkpoints_from_before_fp16_allreduce_resume_at_its_default(example):
    settings = {
        k: v for k, v in vars(example.build_parser().parse_args([])).items()
        if k not in example.RESUMABLE
    }  # fmt: skip
    # --no-cuda may change on resume (other hardware); --fp16-allreduce may not.
    assert "no_cuda" not in settings and "fp16_allreduce" in settings
    saved_before = {k: v for k, v in settings.items() if k != "fp16_allreduce"}
    lstm_language_model._same_settings(saved_before, settings)  # both LMs resume through it
    with pytest.raises(ValueError, match="fp16_allreduce: False there, True now"):
        lstm_language_model._same_settings(saved_before, dict(settings, fp16_allreduce=True))


class CountingStream:
    """A stream that keeps every write apart, as a launcher reading a pipe may see them."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        pass


def test_progress_and_log_lines_leave_whole_in_one_write(monkeypatch):
    # horovodrun tags each piece it reads; a newline written apart from its line
    # ended `make demo`'s lines in a stray "[1,0]<stderr>:" tag.
    out, err = CountingStream(), CountingStream()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(common.hvd, "rank", lambda: 0)
    common.log("epoch 1: done\nFinal: done")
    assert out.writes == ["epoch 1: done\n", "Final: done\n"]
    assert list(common._progress_lines(range(20), 20, "epoch 1")) == list(range(20))
    assert len(err.writes) == 9
    assert all(w.startswith("epoch 1: ") and w.count("\n") == 1 for w in err.writes)
    assert all(w.endswith("\n") for w in err.writes)
