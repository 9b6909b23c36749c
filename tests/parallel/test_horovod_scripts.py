"""Horovod scripts, as written and with one line changed to horovod_powersgd's (issue 12).

The promise: in a Horovod training script, change `hvd.DistributedOptimizer(` to
`horovod_powersgd.DistributedOptimizer(` and nothing else. The scripts in horovod_style/ are
written like Horovod's own examples/pytorch and run standalone under horovodrun or mpirun. Here
every rank runs each script's `main(argv)` in this process twice: once as written, and once
with exactly that call replaced, so that PowerSGD gets Horovod's arguments only (compression,
op, gradient_predivide_factor, backward_passes_per_step) and its own defaults for the rest.
"""

import ast
import inspect
import linecache
import math
import os
import shutil
import sys
import tempfile
import traceback
import types
import warnings
from pathlib import Path

import horovod.torch as hvd
import pytest
import torch

SCRIPTS_DIR = Path(__file__).parent / "horovod_style"
PLAIN_CALL = "hvd.DistributedOptimizer("
SWAPPED_CALL = '__import__("horovod_powersgd").DistributedOptimizer('
VARIANTS = ["horovod", "powersgd"]
# How much higher than plain Horovod's the PowerSGD run's final loss may be. These are short
# runs at rank 2 from PowerSGD's first step; not learning at all (ln 10 = 2.3 on ten classes,
# or NaN) is far outside it. Measured over seeds 42-46 (issue 22; each script's --seed, 2
# workers, a 2-core AMD EPYC): PowerSGD / plain was 1.04-1.05 for the synthetic benchmark
# (sd 0.005), 1.01-1.03 for MNIST (sd 0.011; accuracy at most 0.01 below plain's, the test
# allows 0.1) and 1.10-1.17 for the AMP script (sd 0.022), so 1.5 is over 15 sd away from
# any of them: a processor that rounds differently moves a run by about one seed's worth.
# Every run's final loss was at most 0.94x its first (the synthetic benchmark; 0.47x or
# less for the others).
LOSS_FACTOR = 1.5
RESUME_WARNING = "took the PowerSGD state of rank 0"


def script_source(name, variant):
    source = (SCRIPTS_DIR / f"{name}.py").read_text()
    assert source.count(PLAIN_CALL) == 1, f"{name}: expected exactly one {PLAIN_CALL}...) call"
    if variant == "powersgd":
        source = source.replace(PLAIN_CALL, SWAPPED_CALL)
    return source


def load(name, variant):
    """The script as a fresh module, as if just started (its __main__ block does not run)."""
    path = str(SCRIPTS_DIR / f"{name}.py")
    source = script_source(name, variant)
    filename = path
    if variant != "horovod":
        # Its own file name, cached so that tracebacks show the swapped source.
        filename = f"{path} [{variant}]"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(f"horovod_style_{name}_{variant}")
    module.__file__ = path
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


_capture_manager = None


@pytest.fixture(autouse=True)
def _capture_manager_of_this_run(pytestconfig):
    global _capture_manager
    _capture_manager = pytestconfig.pluginmanager.getplugin("capturemanager")


def call_main(name, variant, argv):
    """main(argv) of a freshly loaded variant; its warnings go to result["warnings"]."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="horovod")
        try:
            result = load(name, variant).main(argv)
        except BaseException:
            # A rank that fails alone leaves the others waiting in a collective until the
            # timeout ends the run, before pytest reports this failure: print it now.
            with _capture_manager.global_and_fixture_disabled():
                print(f"rank {hvd.rank()}: {name} [{variant}] {argv} failed:", file=sys.stderr)
                traceback.print_exc()
            raise
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return result


_results = {}


def run(name, variant, *argv):
    """main(argv) of the script's variant; each distinct run once per session."""
    key = (name, variant, argv)
    if key not in _results:
        _results[key] = call_main(name, variant, list(argv))
    return _results[key]


_gathers = 0


def gather(values, what):
    """values (a list of floats, or a tensor) from every rank, one row per rank."""
    global _gathers
    _gathers += 1
    row = torch.as_tensor(values, dtype=torch.float64).reshape(1, -1)
    return hvd.allgather(row, name=f"scripts.{what}.{_gathers}")


def differing_ranks(values, what):
    """The ranks whose values differ from rank 0's; a collective, so call it on every rank
    before any assertion that might fail on one rank only (or the others would wait for it)."""
    gathered = gather(values, what)
    return [r for r in range(1, hvd.size()) if not torch.equal(gathered[r], gathered[0])]


def parameters_differ(result, what):
    """differing_ranks of the model's parameters, bitwise, plus "non-finite" if they are."""
    flat = torch.cat([p.detach().reshape(-1) for p in result["model"].parameters()])
    return differing_ranks(flat, what) + ([] if torch.isfinite(flat).all() else ["non-finite"])


def assert_compressed(result):
    stats = result["optimizer"].compression_stats()
    assert stats["steps"] > 0 and stats["ratio"] > 1, stats
    return stats


def assert_no_warnings(result, allowed=None):
    unexpected = [w for w in result["warnings"] if allowed is None or allowed not in w]
    assert not unexpected, unexpected


def assert_learns(result, loss_key, plain=None):
    first, final = result["first_loss"], result[loss_key]
    assert math.isfinite(first) and math.isfinite(final), (first, final)
    assert final < first, f"{loss_key} {final:.4f} is not below the first loss {first:.4f}"
    if plain is not None:
        assert final <= LOSS_FACTOR * plain[loss_key], (
            f"PowerSGD {loss_key} {final:.4f} vs plain Horovod {plain[loss_key]:.4f}"
        )


# --- the swap itself --------------------------------------------------------------------------
SCRIPT_NAMES = sorted(p.stem for p in SCRIPTS_DIR.glob("pytorch_*.py"))


def test_there_are_four_scripts():
    assert SCRIPT_NAMES == [
        "pytorch_amp_clipping",
        "pytorch_imagenet",
        "pytorch_mnist",
        "pytorch_synthetic_benchmark",
    ]


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_the_variant_differs_in_one_line_and_passes_horovods_arguments_only(name):
    plain = script_source(name, "horovod").splitlines()
    swapped = script_source(name, "powersgd").splitlines()
    assert "def main(argv=None):" in plain and 'if __name__ == "__main__":' in plain
    assert len(plain) == len(swapped)
    changed = [(a, b) for a, b in zip(plain, swapped) if a != b]
    assert len(changed) == 1, changed
    assert SWAPPED_CALL in changed[0][1]
    # The call's arguments are Horovod 0.28.1's, nothing PowerSGD-specific.
    horovod_arguments = set(inspect.signature(hvd.DistributedOptimizer).parameters)
    (call,) = [
        node
        for node in ast.walk(ast.parse("\n".join(plain)))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "hvd.DistributedOptimizer"
    ]
    keywords = {k.arg for k in call.keywords}
    assert keywords <= horovod_arguments, keywords - horovod_arguments
    assert len(call.args) + len(keywords) <= len(horovod_arguments)


# --- each script, as written and swapped ------------------------------------------------------
WIRE_ARGS = {"fp32": (), "fp16": ("--fp16-allreduce",)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_synthetic_benchmark_fp32_and_fp16_allreduce(variant):
    name = "pytorch_synthetic_benchmark"
    results = {wire: run(name, variant, *args) for wire, args in WIRE_ARGS.items()}
    plains = {wire: run(name, "horovod", *args) for wire, args in WIRE_ARGS.items()}
    differ = {wire: parameters_differ(r, f"bench.{wire}") for wire, r in results.items()}
    for wire, result in results.items():
        assert not differ[wire], f"{wire}: parameters differ from rank 0's on {differ[wire]}"
        assert result["img_sec"] > 0
        assert_no_warnings(result)
        assert_learns(result, "final_loss", plains[wire] if variant == "powersgd" else None)
    if variant == "powersgd":
        fp32, fp16 = assert_compressed(results["fp32"]), assert_compressed(results["fp16"])
        assert fp16["bytes_sent"] < fp32["bytes_sent"], (fp16, fp32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_mnist_with_gradient_predivide_factor(variant):
    args = ("--gradient-predivide-factor", "2")
    result = run("pytorch_mnist", variant, *args)
    plain = run("pytorch_mnist", "horovod", *args)
    # The test metrics are averaged with hvd.allreduce: every rank reports the same.
    metrics_differ = differing_ranks([result["test_loss"], result["test_accuracy"]], "mnist")
    params_differ = parameters_differ(result, "mnist")
    assert not params_differ and not metrics_differ, (params_differ, metrics_differ)
    assert_no_warnings(result)
    assert result["test_accuracy"] > 0.4  # ten classes: chance is 0.1
    assert_learns(result, "test_loss")
    if variant == "powersgd":
        assert_learns(result, "test_loss", plain)
        assert result["test_accuracy"] >= plain["test_accuracy"] - 0.1
        assert_compressed(result)


_imagenet = {}


def imagenet_twice(variant):
    """Train 1 epoch with a rank-0 checkpoint, then start again for 2: resumes at epoch 1."""
    if variant not in _imagenet:
        # One folder, made by rank 0, since only rank 0 writes and reads checkpoints.
        made = tempfile.mkdtemp(prefix=f"hps-horovod-style-{variant}-") if hvd.rank() == 0 else None
        # (A name of our own: Horovod's default one depends on the object's type.)
        directory = hvd.broadcast_object(made, root_rank=0, name="horovod_style.checkpoint_dir")
        args = [
            "--checkpoint-format", os.path.join(directory, "checkpoint-{epoch}.pth.tar"),
            "--batches-per-allreduce", "2",
            "--gradient-predivide-factor", "2",
            # Horovod 0.28.1's broadcast_optimizer_state fills an empty optimizer state by a
            # plain step on zero gradients. On resume only the ranks that did not load the
            # checkpoint take it, after broadcast_parameters: with weight decay it moves their
            # weights, and even plain Horovod ends with different parameters on every rank.
            "--wd", "0",
        ]  # fmt: skip
        first = call_main("pytorch_imagenet", variant, [*args, "--epochs", "1"])
        second = call_main("pytorch_imagenet", variant, [*args, "--epochs", "2"])
        hvd.barrier()  # rank 0 wrote its last checkpoint
        written = sorted(os.listdir(directory))
        hvd.barrier()
        if hvd.rank() == 0:
            shutil.rmtree(directory)
        _imagenet[variant] = first, second, written
    return _imagenet[variant]


@pytest.mark.parametrize("variant", VARIANTS)
def test_imagenet_resumes_from_rank0_checkpoint(variant):
    first, second, written = imagenet_twice(variant)
    plain_first, plain_second, _ = imagenet_twice("horovod")
    differ = {
        "first": parameters_differ(first, "imagenet.first"),
        "resumed": parameters_differ(second, "imagenet.resumed"),
    }
    assert not differ["first"] and not differ["resumed"], differ
    if hvd.rank() == 0:
        assert written == ["checkpoint-1.pth.tar", "checkpoint-2.pth.tar"]
    assert (first["resume_from_epoch"], first["epochs_run"]) == (0, [0])
    # Every rank learned the epoch from rank 0 and trained only the epoch left ...
    assert (second["resume_from_epoch"], second["epochs_run"]) == (1, [1])
    # ... starting from the saved weights (rank 0 loaded them, the others got them broadcast).
    assert second["start_checksum"] == first["checksum"]
    assert_learns(first, "train_loss")
    assert_no_warnings(first)
    # horovod_powersgd tells every rank that the ranks which did not load the checkpoint
    # restart their error buffers at zero (on every rank alike, so that `python -W error`
    # raises everywhere instead of leaving rank 0 waiting).
    assert_no_warnings(second, allowed=RESUME_WARNING)
    for result in (first, second):
        assert math.isfinite(result["train_loss"]) and math.isfinite(result["val_loss"])
        assert result["train_loss"] < first["first_loss"]
    if variant == "powersgd":
        assert first["train_loss"] <= LOSS_FACTOR * plain_first["train_loss"]
        assert second["train_loss"] <= LOSS_FACTOR * plain_second["train_loss"]
        assert_compressed(first)
        assert_compressed(second)


@pytest.mark.parametrize("variant", VARIANTS)
def test_amp_grad_scaler_and_clipping(variant):
    result = run("pytorch_amp_clipping", variant)
    plain = run("pytorch_amp_clipping", "horovod")
    params_differ = parameters_differ(result, "amp")
    assert not params_differ, params_differ
    assert_no_warnings(result)
    assert_learns(result, "train_loss")
    if variant == "powersgd":
        assert_learns(result, "train_loss", plain)
        assert_compressed(result)


@pytest.mark.parametrize("variant", VARIANTS)
def test_amp_overflow_is_skipped_on_every_rank_and_training_goes_on(variant):
    # A loss scale so large that the first step overflows: GradScaler must skip it on every
    # rank, halve the scale (the gradients are finite in float32 from then on) and train.
    args = ("--init-scale", "3e38")
    result = run("pytorch_amp_clipping", variant, *args)
    plain = run("pytorch_amp_clipping", "horovod", *args)
    scaler_differs = differing_ranks([result["skipped_steps"], result["final_scale"]], "amp")
    params_differ = parameters_differ(result, "amp.overflow")
    assert not params_differ and not scaler_differs, (params_differ, scaler_differs)
    assert_no_warnings(result)
    assert result["skipped_steps"] >= 1
    assert result["final_scale"] < 3e38
    assert_learns(result, "train_loss")
    if variant == "powersgd":
        assert_learns(result, "train_loss", plain)
        assert_compressed(result)
