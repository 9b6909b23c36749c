"""Each example trains a few tiny steps end to end on every rank, so they cannot rot:
at PowerSGD ranks 1, 2 and 4, both schedules, float32 and float16 on the wire, and
on the device a GPU machine would give it.

The examples' ``main(argv)`` runs in this process (hvd.init() already happened in
conftest); no launcher is started from inside the test.
"""

import json
import math
import os
import pathlib
import struct
import sys

import horovod.torch as hvd
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import fashion_mnist
import lstm_language_model
import transformer_lm

TINY = ["--epochs", "1", "--max-steps", "2", "--no-progress", "--seed", "3"]


def assert_same_parameters_on_every_rank(model):
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.isfinite(flat).all()
    reference = hvd.broadcast(flat, root_rank=0, name="examples.params")
    assert torch.equal(flat, reference), "ranks ended with different parameters"


def assert_resumed_like_straight(resumed, straight):
    """A run resumed after epoch 1 ended with the weights and records of one never stopped."""
    assert resumed["resumed_after_epoch"] == [1]
    for a, b in zip(straight["model"].parameters(), resumed["model"].parameters(), strict=True):
        assert torch.equal(a, b), "resumed weights differ from an uninterrupted run's"
    keys = ("epoch", "steps", "train_loss", "valid_perplexity", "lr", "bytes_sent", "ratio")
    assert [{k: e[k] for k in keys} for e in resumed["epochs"]] == [
        {k: e[k] for k in keys} for e in straight["epochs"]
    ]


def check_communication(final, powersgd_rank):
    assert final["bytes_sent"] > 0
    if powersgd_rank:
        assert final["ratio"] > 1
    else:
        assert final["ratio"] == 1


@pytest.mark.parametrize("powersgd_rank", [0, 2])
def test_fashion_mnist_trains_two_steps(tmp_path, rank, size, powersgd_rank):
    if not os.path.isdir(fashion_mnist.DEFAULT_DATA_DIR):
        pytest.fail("Debian's dataset-fashion-mnist is missing: run scripts/bootstrap.sh")
    json_path = tmp_path / "metrics.json"
    record = fashion_mnist.main(
        [*TINY, "--powersgd-rank", str(powersgd_rank), "--train-subset", "256",
         "--eval-subset", "100", "--batch-size", "16", "--json", str(json_path)]
    )  # fmt: skip
    (epoch,) = record["epochs"]
    assert epoch["steps"] == 2
    assert math.isfinite(epoch["train_loss"]) and math.isfinite(epoch["test_loss"])
    assert 0 <= epoch["test_accuracy"] <= 1
    check_communication(record["final"], powersgd_rank)
    assert_same_parameters_on_every_rank(record["model"])
    if rank == 0:
        written = json.loads(json_path.read_text())
        assert written["world_size"] == size
        assert written["final"]["test_accuracy"] == record["final"]["test_accuracy"]
    else:
        assert not json_path.exists()  # only rank 0 writes


def test_lstm_language_model_trains_two_steps(tmp_path):
    if not os.path.isdir(lstm_language_model.DEFAULT_DOCS_DIR):
        pytest.fail("Debian's python3.11-doc is missing: run scripts/bootstrap.sh")
    record = lstm_language_model.main(
        [*TINY, "--powersgd-rank", "4", "--train-subset", "20000", "--eval-subset", "2000",
         "--batch-size", "4", "--bptt", "10", "--size", "32", "--vocab-size", "2000"]
    )  # fmt: skip
    (epoch,) = record["epochs"]
    assert epoch["steps"] == 2
    for key in ("train_perplexity", "valid_perplexity", "test_perplexity"):
        # Finite, and no worse than guessing among 2000 words plus a margin.
        assert 1 < epoch[key] < 4000, key
    check_communication(record["final"], 4)
    assert_same_parameters_on_every_rank(record["model"])


def test_lstm_language_model_reads_a_text_file(tmp_path):
    text = "\n\n".join(f"the quick fox number {i} jumps over the lazy dog ." for i in range(3000))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    record = lstm_language_model.main(
        [*TINY, "--powersgd-rank", "0", "--text-file", str(path), "--batch-size", "4",
         "--bptt", "8", "--size", "16", "--vocab-size", "50"]
    )  # fmt: skip
    assert math.isfinite(record["final"]["test_perplexity"])
    check_communication(record["final"], 0)
    assert_same_parameters_on_every_rank(record["model"])


def tiny_lm_argv(corpus, powersgd_rank, *more):
    return [
        "--max-steps", "3", "--no-progress", "--seed", "3", "--powersgd-rank", str(powersgd_rank),
        "--text-file", str(corpus), "--batch-size", "4", "--bptt", "8", "--size", "16",
        "--vocab-size", "50", *more,
    ]  # fmt: skip


@pytest.fixture
def corpus(shared_dir):
    path = os.path.join(shared_dir, "corpus.txt")
    if hvd.rank() == 0:
        with open(path, "w") as f:
            f.write("\n\n".join(f"a {i % 7} fox jumps over the {i % 5} dog ." for i in range(2000)))
    hvd.barrier()
    return path


@pytest.mark.parametrize("powersgd_rank", [0, 4])
def test_lstm_checkpoint_goes_on_as_if_never_stopped(shared_dir, corpus, powersgd_rank):
    """A 3-epoch run equals a 1-epoch run with --checkpoint continued to 3 epochs."""
    straight = lstm_language_model.main(tiny_lm_argv(corpus, powersgd_rank, "--epochs", "3"))
    ckpt = os.path.join(shared_dir, "runs", "lm.ckpt")  # the folder does not exist yet
    first = tiny_lm_argv(corpus, powersgd_rank, "--checkpoint", ckpt, "--epochs", "1")
    lstm_language_model.main(first)
    json_path = os.path.join(shared_dir, "lm.json")
    argv = tiny_lm_argv(corpus, powersgd_rank, "--checkpoint", ckpt, "--epochs", "3")
    # --no-cuda may change on resume: a run saved on GPUs goes on on CPUs.
    resumed = lstm_language_model.main([*argv, "--json", json_path, "--no-cuda"])

    assert_resumed_like_straight(resumed, straight)
    for key in ("test_perplexity", "bytes_sent", "ratio"):
        assert resumed["final"][key] == straight["final"][key], key
    assert_same_parameters_on_every_rank(resumed["model"])
    if hvd.rank() == 0:
        with open(json_path) as f:
            assert len(json.load(f)["epochs"]) == 3

    # Asking for no more epochs than saved trains nothing and reports the saved run.
    again = lstm_language_model.main(argv)
    assert again["final"]["test_perplexity"] == straight["final"]["test_perplexity"]


def checkpoint_files(folder):
    """{name: bytes} of the checkpoint's files (rank 0's and every rank's)."""
    names = [n for n in sorted(os.listdir(folder)) if n.startswith("lm.ckpt")]
    return {n: pathlib.Path(folder, n).read_bytes() for n in names}


def test_lstm_checkpoint_of_other_settings_is_refused_on_every_rank(shared_dir, corpus):
    ckpt = os.path.join(shared_dir, "lm.ckpt")
    lstm_language_model.main(tiny_lm_argv(corpus, 4, "--checkpoint", ckpt, "--epochs", "1"))
    saved = checkpoint_files(shared_dir)
    for other in (["--powersgd-rank", "2"], ["--powersgd-rank", "0"], ["--lr", "1"]):
        with pytest.raises(ValueError, match="saved by a run with other settings"):
            lstm_language_model.main(
                [*tiny_lm_argv(corpus, 4, "--checkpoint", ckpt, "--epochs", "2"), *other]
            )
    assert checkpoint_files(shared_dir) == saved, "a refused resume changed the checkpoint"


def test_lstm_fixed_lr_drops_can_join_a_run_that_followed_them(shared_dir, corpus):
    """--lr-drop-after gives every run the same LR each epoch, also when added on resume."""
    base = 10.0 * hvd.size()  # --lr is per worker
    drops = ["--lr-drop-after", "1,2"]
    straight = lstm_language_model.main(tiny_lm_argv(corpus, 4, "--epochs", "3", *drops))
    # Each epoch's record holds the LR of the epoch after it.
    assert [e["lr"] for e in straight["epochs"]] == [base / 4, base / 16, base / 16]

    # Epoch 1 trained at the base LR either way, so the drops may start on resume.
    ckpt = os.path.join(shared_dir, "lm.ckpt")
    lstm_language_model.main(tiny_lm_argv(corpus, 4, "--checkpoint", ckpt, "--epochs", "1"))
    resumed = lstm_language_model.main(
        tiny_lm_argv(corpus, 4, "--checkpoint", ckpt, "--epochs", "3", *drops)
    )
    assert [e["lr"] for e in resumed["epochs"]] == [e["lr"] for e in straight["epochs"]]
    for a, b in zip(straight["model"].parameters(), resumed["model"].parameters(), strict=True):
        assert torch.equal(a, b), "resumed weights differ from an uninterrupted run's"

    # Refused, nothing lost: going on without the flag (the LR would then be cut at
    # validation stalls), or with a schedule that says epoch 2 trained at the base LR.
    saved = checkpoint_files(shared_dir)
    with pytest.raises(ValueError, match="saved by a run with --lr-drop-after 1,2; pass it"):
        lstm_language_model.main(tiny_lm_argv(corpus, 4, "--checkpoint", ckpt, "--epochs", "4"))
    refusal = f"epoch 2 trained at LR {base / 4:g}, this schedule gives {base:g}"
    with pytest.raises(ValueError, match=refusal):
        lstm_language_model.main(
            tiny_lm_argv(corpus, 4, "--checkpoint", ckpt, "--epochs", "4", "--lr-drop-after", "2")
        )
    assert checkpoint_files(shared_dir) == saved, "a refused resume changed the checkpoint"


def tiny_transformer_argv(corpus, powersgd_rank, *more):
    return [
        "--max-steps", "3", "--no-progress", "--seed", "3", "--powersgd-rank", str(powersgd_rank),
        "--text-file", str(corpus), "--batch-size", "4", "--block", "8", "--size", "16",
        "--layers", "1", "--heads", "2", "--vocab-size", "50", "--warmup-steps", "2", *more,
    ]  # fmt: skip


@pytest.mark.parametrize("powersgd_rank", [0, 4])
def test_transformer_checkpoint_goes_on_as_if_never_stopped(shared_dir, corpus, powersgd_rank):
    """AdamW + warm-up + cosine: 3 epochs straight equal 1 epoch, then resumed to 3."""
    cosine = ["--decay-epochs", "3"]  # the schedule's length, the same for both runs
    straight = transformer_lm.main(
        tiny_transformer_argv(corpus, powersgd_rank, "--epochs", "3", *cosine)
    )
    ckpt = os.path.join(shared_dir, "runs", "tf.ckpt")
    first = tiny_transformer_argv(corpus, powersgd_rank, "--checkpoint", ckpt, "--epochs", "1")
    transformer_lm.main([*first, *cosine])
    argv = tiny_transformer_argv(corpus, powersgd_rank, "--checkpoint", ckpt, "--epochs", "3")
    resumed = transformer_lm.main([*argv, *cosine, "--no-cuda"])  # other hardware, as above

    assert_resumed_like_straight(resumed, straight)
    # --start-iter defaults to the warm-up: 2 plain steps, then compressed.
    assert straight["args"]["start_iter"] == 2
    ratios = [e["ratio"] for e in straight["epochs"]]
    assert ratios[0] < ratios[1] == ratios[2] if powersgd_rank else ratios == [1.0] * 3
    assert resumed["final"]["test_perplexity"] == straight["final"]["test_perplexity"]
    assert_same_parameters_on_every_rank(resumed["model"])

    # Another cosine (--decay-epochs defaults to --epochs) would change the LR of the
    # epochs already trained: refused.
    with pytest.raises(ValueError, match="decay_epochs: 3 there, 4 now"):
        transformer_lm.main(
            tiny_transformer_argv(corpus, powersgd_rank, "--checkpoint", ckpt, "--epochs", "4")
        )


# --- every example at PowerSGD ranks 1, 2 and 4, both schedules, float32 and float16 -----------
# Rank 1 crashed the first step of every example (issue 36) while nothing here ran it.
# Tiny inputs: 3 steps of each run take well under a second.
def write_idx(path, tensor):
    """A uint8 tensor as an (uncompressed) IDX file, as the data set ships them."""
    header = bytes([0, 0, 0x08, tensor.dim()]) + struct.pack(f">{tensor.dim()}I", *tensor.shape)
    path.write_bytes(header + tensor.contiguous().numpy().tobytes())


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    """Each rank's own copy: the data set's first 96 + 32 images, and a small text."""
    if not os.path.isdir(fashion_mnist.DEFAULT_DATA_DIR):
        pytest.fail("Debian's dataset-fashion-mnist is missing: run scripts/bootstrap.sh")
    folder = tmp_path_factory.mktemp("tiny-inputs")
    for split, count in (("train", 96), ("t10k", 32)):
        for kind in ("images-idx3", "labels-idx1"):
            name = f"{split}-{kind}-ubyte"
            data = fashion_mnist.read_idx(fashion_mnist._find(fashion_mnist.DEFAULT_DATA_DIR, name))
            write_idx(folder / name, data[:count])
    text = folder / "corpus.txt"
    text.write_text("\n\n".join(f"a {i % 7} fox jumps over the {i % 5} dog ." for i in range(2000)))
    return folder


STEPS = ["--epochs", "1", "--max-steps", "3", "--no-progress", "--seed", "3"]


def tiny_run(example, inputs, *more):
    """`example`'s record after 3 steps on 2 x 16 images, or 2 x 4 token streams."""
    text = ["--text-file", str(inputs / "corpus.txt"), "--batch-size", "4", "--size", "16",
            "--vocab-size", "50"]  # fmt: skip
    argv = {
        "fashion_mnist": ["--data-dir", str(inputs), "--batch-size", "16"],
        "lstm_language_model": [*text, "--bptt", "8"],
        # Compressed from the first step: --start-iter follows the warm-up otherwise.
        "transformer_lm": [*text, "--block", "8", "--layers", "1", "--heads", "2",
                           "--warmup-steps", "2", "--start-iter", "0"],
    }[example]  # fmt: skip
    main = {"fashion_mnist": fashion_mnist.main, "lstm_language_model": lstm_language_model.main,
            "transformer_lm": transformer_lm.main}[example]  # fmt: skip
    return main([*STEPS, *argv, *more])


def check_trained(record):
    """3 steps, finite metrics, the same parameters everywhere, and the run was on the CPU here."""
    (epoch,) = record["epochs"]
    assert epoch["steps"] == 3
    metrics = ("train_loss", "test_loss") if "test_loss" in epoch else (
        "train_loss", "valid_perplexity", "test_perplexity")  # fmt: skip
    for key in metrics:
        assert math.isfinite(epoch[key]), (key, epoch[key])
    assert record["device"] == "cpu"  # this machine has no GPU
    assert_same_parameters_on_every_rank(record["model"])


def parameters_differ(a, b) -> bool:
    return any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


EXAMPLES = ["fashion_mnist", "lstm_language_model", "transformer_lm"]


@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("powersgd_rank", [1, 2, 4])
@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_trains_at_ranks_1_2_4_in_both_schedules_and_fp16(
    tiny_inputs, example, powersgd_rank, rounds
):
    powersgd = ["--powersgd-rank", str(powersgd_rank), "--rounds", str(rounds)]
    fp32 = tiny_run(example, tiny_inputs, *powersgd)
    fp16 = tiny_run(example, tiny_inputs, *powersgd, "--fp16-allreduce")
    for record in (fp32, fp16):
        check_trained(record)
        assert record["final"]["bytes_sent"] > 0 and record["final"]["ratio"] > 1
    # float16 on the wire: the same elements (P, Q and the uncompressed rest) at half the bytes.
    assert fp16["final"]["ratio"] == fp32["final"]["ratio"]
    assert 2 * fp16["final"]["bytes_sent"] == fp32["final"]["bytes_sent"]
    assert parameters_differ(fp16["model"], fp32["model"]), "--fp16-allreduce changed nothing"


@pytest.mark.parametrize("example", EXAMPLES)
def test_plain_horovod_baseline_sends_fp16_with_the_flag(tiny_inputs, example):
    fp32 = tiny_run(example, tiny_inputs, "--powersgd-rank", "0")
    fp16 = tiny_run(example, tiny_inputs, "--powersgd-rank", "0", "--fp16-allreduce")
    for record in (fp32, fp16):
        check_trained(record)
        assert record["final"]["ratio"] == 1
    assert 2 * fp16["final"]["bytes_sent"] == fp32["final"]["bytes_sent"]
    # The averaged gradients were rounded to float16: hvd.DistributedOptimizer got the flag.
    assert parameters_differ(fp16["model"], fp32["model"]), "--fp16-allreduce changed nothing"


def pretend_gpus(monkeypatch, count):
    """torch says `count` GPUs are there; returns the list set_device's calls go to."""
    pinned = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", pinned.append)
    return pinned


@pytest.mark.parametrize("example", EXAMPLES)
def test_examples_train_on_the_gpu_of_their_local_rank_when_there_is_one(
    monkeypatch, tiny_inputs, example
):
    # One GPU per process on this node, as horovodrun and mpirun show them.
    pinned = pretend_gpus(monkeypatch, hvd.local_size())
    # This torch has no CUDA: the first tensor an example puts on the GPU says so,
    # before any collective, so every rank stops here alike.
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        tiny_run(example, tiny_inputs, "--powersgd-rank", "2")
    assert pinned == [hvd.local_rank()]


@pytest.mark.parametrize("example", EXAMPLES)
def test_no_cuda_keeps_the_cpu_where_there_is_a_gpu(monkeypatch, tiny_inputs, example):
    pinned = pretend_gpus(monkeypatch, hvd.local_size())
    check_trained(tiny_run(example, tiny_inputs, "--powersgd-rank", "2", "--no-cuda"))
    assert pinned == []


@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_trains_with_rank_auto_in_both_schedules_and_fp16(
    tiny_inputs, example, rounds
):
    # A pinned slow link: auto measures 8 plain steps, then the model compresses.
    # 4 epochs of 3 steps: the last is compressed. 1 Mbit/s, where compressing the tiny
    # transformer's step is about twice as fast as plain even with an fp16 wire: at
    # 10 Mbit/s its model put the two within 1-4 % of each other, so the machine's speed
    # decided (plain under the 3 % tolerance on some runs, 2026-12-05).
    auto = ["--powersgd-rank", "auto", "--powersgd-link", "1mbit", "--rounds", str(rounds),
            "--epochs", "4"]  # fmt: skip
    for record in (tiny_run(example, tiny_inputs, *auto),
                   tiny_run(example, tiny_inputs, *auto, "--fp16-allreduce")):  # fmt: skip
        assert [e["steps"] for e in record["epochs"]] == [3, 3, 3, 3]
        assert all(math.isfinite(e["train_loss"]) for e in record["epochs"])
        assert record["epochs"][-1]["ratio"] > 1, "auto compressed nothing on a 1 Mbit/s link"
        # Each epoch records the buckets' ranks: plain while measuring, then the plan.
        plans = [e["plan"] for e in record["epochs"]]
        assert not any(plans[0]) and any(plans[-1]), plans
        assert_same_parameters_on_every_rank(record["model"])
