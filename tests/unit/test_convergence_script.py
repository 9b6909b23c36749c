"""scripts/convergence*.py: what the campaign runs, how it resumes, and what the report claims."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "convergence"))
import convergence
import convergence_report
import convergence_tables
from convergence_runs import Config, machine


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_plan_covers_every_target_and_runs_seed_42_of_everything_first():
    plan = convergence.run_plan(convergence.parse_args([]))
    names = [name for name, *_ in plan]
    assert len(names) == len(set(names)), "two runs would share one JSON file"
    runs = {(c.example, c.rank, c.rounds, c.start_iter, seed) for _, c, seed, _ in plan}
    for seed in (42, 43, 44):
        for rank, rounds in ((0, 2), (2, 2), (2, 1), (1, 2), (4, 2)):
            assert ("fashion_mnist", rank, rounds, 0, seed) in runs
        for start_iter in (100, 469):
            assert ("fashion_mnist", 2, 2, start_iter, seed) in runs
    for seed in (42, 43):
        for rank, rounds in ((0, 2), (4, 2), (4, 1)):
            assert ("lstm_language_model", rank, rounds, 0, seed) in runs
        # The transformer: plain vs two ranks, rounds=2, PowerSGD from the end of the LR warm-up.
        assert ("transformer_lm", 0, 2, 0, seed) in runs
        for rank in (4, 16):
            assert ("transformer_lm", rank, 2, 200, seed) in runs
    transformer = [(c.rank, seed) for _, c, seed, _ in plan if c.example == "transformer_lm"]
    assert transformer == [(0, 42), (4, 42), (16, 42), (0, 43), (4, 43), (16, 43)]
    fashion = [seed for _, c, seed, _ in plan if c.example == "fashion_mnist"]
    first_other = fashion.index(43)
    assert set(fashion[:first_other]) == {42} and 42 not in fashion[first_other:]
    assert plan[0][1].rank == 0, "the baseline runs first"


def test_plan_passes_every_setting_to_the_example():
    args = convergence.parse_args(
        ["--parts", "fashion,lstm,transformer", "--extra", "--max-steps 3"]
    )
    examples = set()
    for name, config, seed, argv in convergence.run_plan(args):
        assert int(flag(argv, "--seed")) == seed
        assert int(flag(argv, "--powersgd-rank")) == config.rank
        assert int(flag(argv, "--rounds")) == config.rounds
        assert int(flag(argv, "--start-iter")) == config.start_iter
        assert argv[-2:] == ["--max-steps", "3"]
        examples.add(config.example)
        if config.example in ("lstm_language_model", "transformer_lm"):
            assert flag(argv, "--train-subset") == "0", "the whole corpus"
            assert flag(argv, "--eval-subset") == "0"
            # One checkpoint per run, outside the tracked results.
            assert flag(argv, "--checkpoint") == f"runs/convergence/{name}.ckpt"
        if config.example == "lstm_language_model":
            assert flag(argv, "--epochs") == "20"
            assert flag(argv, "--lr-drop-after") == "14", "the same LR schedule in every run"
        elif config.example == "transformer_lm":
            assert flag(argv, "--epochs") == "8"
            # The same cosine in every run, also when a run is extended later.
            assert flag(argv, "--decay-epochs") == "8"
            assert "--lr-drop-after" not in argv
            if config.rank:
                assert flag(argv, "--start-iter") == flag(argv, "--warmup-steps") == "200"
        else:
            assert flag(argv, "--epochs") == "10"
            assert "--lr-drop-after" not in argv
    assert examples == set(convergence.EXAMPLES)


def test_transformer_warm_up_is_the_examples_lr_warm_up():
    """start_iter = the LR warm-up (README), and the runs use the example's own default."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import transformer_lm

    defaults = transformer_lm.build_parser().parse_args([])
    assert defaults.warmup_steps == convergence.TRANSFORMER_WARMUP
    assert defaults.start_iter is None, "--start-iter follows --warmup-steps unless given"


def test_unknown_part_is_refused():
    with pytest.raises(SystemExit, match="unknown --parts"):
        convergence.run_plan(convergence.parse_args(["--parts", "fashion,cifar"]))


def fake_record(config, seed, accuracies, ratio):
    epochs = [
        {
            "epoch": i + 1,
            "test_accuracy": a,
            "train_loss": 0.5,
            "train_time_s": 40.0,
            "bytes_sent": int(3.2e9 / ratio),
            "ratio": ratio,
        }
        for i, a in enumerate(accuracies)
    ]
    return {
        "example": config.example,
        "args": {"seed": seed},
        "epochs": epochs,
        "final": {
            "test_accuracy": accuracies[-1],
            "ratio": ratio,
            "bytes_sent": sum(e["bytes_sent"] for e in epochs),
        },
        "config": {"key": config.key, "label": config.label, **config.__dict__},
        "launch": {"command": f"run {config.key} {seed}"},
    }


def write_runs(folder, records):
    """Writes the records as a campaign would; returns them as the report loads them."""
    os.makedirs(folder, exist_ok=True)
    for r in records:
        name = f"{r['config']['key']}-s{r['args']['seed']}.json"
        with open(os.path.join(folder, name), "w") as f:
            json.dump(r, f)
    return convergence_report.load_runs(str(folder))


def test_targets_compare_seed_means_and_name_misses(tmp_path):
    plain = Config("fashion_mnist", 0)
    r2 = Config("fashion_mnist", 2)
    r2_one = Config("fashion_mnist", 2, rounds=1)
    runs = [fake_record(plain, s, [0.90, a], 1.0) for s, a in ((42, 0.920), (43, 0.918))]
    # Mean 0.9175 vs 0.919: 0.15 pp behind -> met at 104x.
    runs += [fake_record(r2, s, [0.89, a], 104.5) for s, a in ((42, 0.916), (43, 0.919))]
    # One seed diverged: a miss, whatever the other seed did.
    runs += [fake_record(r2_one, 42, [0.88, 0.921], 203.0)]
    runs += [fake_record(r2_one, 43, [0.88, float("nan")], 203.0)]
    groups = write_runs(tmp_path / "convergence", runs)
    lines = convergence_report._targets(groups)
    assert len(lines) == 2, lines
    assert "rank 2, rounds=2: **met**" in lines[0] and "-0.15 pp" in lines[0]
    assert "rank 2, rounds=1: **missed**" in lines[1] and "diverged" in lines[1]

    convergence_report.write_report(groups, str(tmp_path))
    report = (tmp_path / "convergence.md").read_text()
    assert "91.75 ± 0.21 (91.60-91.90) | -0.15 pp" in report
    # Last 3 epochs (here both): rank 2 89, 91.6, 89, 91.9; plain 90, 92, 90, 91.8.
    assert "| 90.38 | -0.58 pp |" in report
    assert "diverged (NaN) in 43" in report
    assert (tmp_path / "convergence_fashion_mnist.png").stat().st_size > 10_000
    # The warm-up table reads epoch 2 from the same runs.
    assert "| rank 2, rounds=2 | 91.75 % | 104.5x |" in report


def test_comparisons_pair_seeds_with_plain(tmp_path):
    plain = Config("fashion_mnist", 0)
    r2 = Config("fashion_mnist", 2)
    warm = Config("fashion_mnist", 2, start_iter=100)
    runs = [fake_record(plain, s, [0.9, a], 1.0) for s, a in ((42, 0.92), (43, 0.90))]
    runs += [fake_record(r2, s, [0.9, a], 104.5) for s, a in ((42, 0.918), (43, 0.899))]
    runs += [fake_record(warm, 42, [0.9, 0.917], 8.7)]  # seed 42 only
    groups = write_runs(tmp_path / "convergence", runs)
    # Against plain seed 42 alone (92.0), not the mean of 42 and 43 (91.0).
    assert "| rank 2, rounds=2, start_iter 100 | 42 | 2 | 91.70 ± — (91.70-91.70) | -0.30 pp" in (
        "\n".join(convergence_tables.summary_table("fashion_mnist", groups))
    )
    warmup = "\n".join(convergence_tables.warmup_table(groups))
    assert "Seeds 42 (those every row has)" in warmup
    assert "| rank 2, rounds=2 | 91.80 % |" in warmup, "seed 43 left out of this row"


def test_a_seed_plain_lacks_is_left_out_of_the_gap_and_named(tmp_path):
    plain = Config("lstm_language_model", 0)
    r4 = Config("lstm_language_model", 4)
    runs = [lstm_record(plain, 43, [200, 100], [20, 20])]  # plain seed 42 not run yet
    runs += [lstm_record(r4, 42, [200, 90], [20, 20]), lstm_record(r4, 43, [200, 101], [20, 20])]
    groups = write_runs(tmp_path / "convergence", runs)
    # Seed 43 alone: 101 vs 100, +1 %. Both seeds against plain 43 would read -4.5 %.
    (target,) = convergence_report._targets(groups)
    assert "**met**" in target and "+1.00 % vs plain" in target, target
    assert "seeds 43 vs plain 43 (seed 42: no plain run to compare with yet)" in target, target
    summary = "\n".join(convergence_tables.summary_table("lstm_language_model", groups))
    assert "| 42,43 | 2 | 97.41 ± 7.93 (91.80-103.02) | +1.0 % |" in summary, summary
    gap = convergence_tables.gap_by_epoch_table(groups)
    assert gap[-1] == "| 2 | 102.00 | 97.41 | +1.0 % |", gap


def test_a_finished_run_is_not_run_again(tmp_path, monkeypatch):
    config = Config("fashion_mnist", 2)
    args = convergence.parse_args(["--out", str(tmp_path)])
    write_runs(tmp_path / "convergence", [fake_record(config, 42, [0.9], 104.5)])

    def no_launch(*a, **k):
        raise AssertionError("a finished run was launched again")

    monkeypatch.setattr(convergence.subprocess, "run", no_launch)
    convergence.run_one(
        f"{config.key}-s42",
        config,
        ["--seed", "42", "--epochs", "1"],
        args,
        str(tmp_path / "convergence"),
    )


def lstm_record(config, seed, valid, lrs):
    record = fake_record(config, seed, [v * 1.02 for v in valid], 37.9)
    for e, v, lr in zip(record["epochs"], valid, lrs, strict=True):
        e["test_perplexity"] = e.pop("test_accuracy")
        e.update(valid_perplexity=v, lr=lr)
    record["final"]["test_perplexity"] = record["final"].pop("test_accuracy")
    record.update(args={"seed": seed, "lr": 10.0}, world_size=2)  # base LR 20
    return record


def test_lstm_report_says_where_validation_flattened(tmp_path):
    plain = Config("lstm_language_model", 0)
    r4 = Config("lstm_language_model", 4)
    # Plain stalls in epoch 5 (LR 20 -> 5), improves 1.4 %, then loses 0.3 %; over the last
    # three epochs -0.1 % an epoch: flat. Its best epoch is 6, not the last (test = 1.02 x valid).
    valid = [200, 160, 150, 145, 146, 144, 144.5]
    runs = [lstm_record(plain, 42, valid, [20, 20, 20, 20, 5, 5, 5])]
    # Rank 4's last epoch moves only 0.7 %, but the three before it 3.9 % an epoch: not flat.
    runs += [lstm_record(r4, 42, [210, 170, 160, 152, 151], [20] * 5)]
    groups = write_runs(tmp_path / "convergence", runs)
    table = "\n".join(convergence_tables.flattening_table(groups))
    row = "| plain Horovod | 42 | 7 | 144.0 (6) | 146.88 | +0.3 % | -0.1 % | 5 | yes |"
    assert row in table, table
    assert "| 42 | 5 | 151.0 (5) | 154.02 | -0.7 % | -3.9 % | — | no |" in table, table
    (target,) = convergence_report._targets(groups)
    # Compared at epoch 5, the last both have: +3.4 %, not rank 4's epoch 5 vs plain's 7.
    assert (
        "after 5/7 epochs, compared at epoch 5, which all runs have (validation perplexity still"
        " falling" in target
    ), target
    assert "+3.42 % vs plain" in target, target
    convergence_report.write_report(groups, str(tmp_path))
    assert "### Did validation perplexity flatten?" in (tmp_path / "convergence.md").read_text()


def test_a_run_asked_for_more_epochs_goes_on_and_keeps_its_first_command(tmp_path, monkeypatch):
    config = Config("lstm_language_model", 4)
    args = convergence.parse_args(["--out", str(tmp_path)])
    runs_dir = tmp_path / "convergence"
    (done,) = write_runs(runs_dir, [lstm_record(config, 42, [150.0, 120.0], [20, 20])])[config.key]
    launched = []

    def example(command, **kwargs):
        launched.append(command)
        # What the example writes when it resumes from its checkpoint after epoch 2.
        json_path = os.path.join(kwargs["cwd"], command[command.index("--json") + 1])
        record = dict(done, epochs=done["epochs"] + done["epochs"][-1:], resumed_after_epoch=[2])
        record = {k: v for k, v in record.items() if k not in ("launch", "config")}
        with open(json_path, "w") as f:
            json.dump(record, f)
        kwargs["stdout"].write("epoch 3: the new launch\n")
        return convergence.subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(convergence.subprocess, "run", example)
    name = f"{config.key}-s42"
    (runs_dir / f"{name}.log").write_text("epoch 1\nepoch 2\n")
    for epochs in ("2", "3"):  # 2 are there: skipped; 3: launched once
        convergence.run_one(name, config, ["--epochs", epochs], args, str(runs_dir))
    assert len(launched) == 1
    with open(runs_dir / f"{name}.json") as f:
        record = json.load(f)
    assert len(record["epochs"]) == 3
    assert record["earlier_launches"] == [done["launch"]]
    log = (runs_dir / f"{name}.log").read_text()  # the earlier epochs' output stays
    assert log.startswith("epoch 1\nepoch 2\n[convergence] launched ")
    assert "--epochs 3" in log and log.endswith("epoch 3: the new launch\n")
    convergence_report.write_report(convergence_report.load_runs(str(runs_dir)), str(tmp_path))
    report = (tmp_path / "convergence.md").read_text()
    assert done["launch"]["command"] in report and "--epochs 3" in report


def test_lstm_report_shows_the_gap_to_plain_epoch_by_epoch(tmp_path):
    plain = Config("lstm_language_model", 0)
    r4 = Config("lstm_language_model", 4)
    r4_one = Config("lstm_language_model", 4, rounds=1)
    # lstm_record's test perplexity is 1.02 x validation.
    runs = [lstm_record(plain, 42, [200, 100, 50], [20] * 3)]
    runs += [lstm_record(plain, 43, [200, 110, 60], [20] * 3)]
    runs += [lstm_record(r4, 42, [220, 105, 51], [20] * 3)]
    runs += [lstm_record(r4, 43, [220, 115.5, 61], [20] * 3)]
    runs += [lstm_record(r4_one, 42, [240, 110], [20] * 2)]  # seed 42 only, 2 epochs so far
    groups = write_runs(tmp_path / "convergence", runs)
    table = convergence_tables.gap_by_epoch_table(groups)
    head = "| epoch | plain Horovod | rank 4, rounds=1 | vs plain | rank 4, rounds=2 | vs plain |"
    assert table[0] == head, "configurations in the summary table's order"
    # Only the epochs every run has; rounds=1 against plain seed 42 alone (102.0 at epoch 2,
    # where the mean of both plain seeds is 107.1).
    assert table[2:] == [
        "| 1 | 204.00 | 244.80 | +20.0 % | 224.40 | +10.0 % |",
        "| 2 | 107.10 | 112.20 | +10.0 % | 112.46 | +5.0 % |",
    ]
    convergence_report.write_report(groups, str(tmp_path))
    assert "### Test perplexity epoch by epoch" in (tmp_path / "convergence.md").read_text()


def test_a_run_trained_on_another_lr_schedule_is_not_extended(tmp_path, monkeypatch, capsys):
    config = Config("lstm_language_model", 4)
    args = convergence.parse_args(["--out", str(tmp_path)])
    runs_dir = tmp_path / "convergence"
    # Seed 42 cut its LR after epoch 2 (a stall); seed 43 ran 3 epochs at the base LR.
    write_runs(runs_dir, [lstm_record(config, 42, [150, 151, 140], [20, 5, 5])])
    write_runs(runs_dir, [lstm_record(config, 43, [150, 140, 130], [20, 20, 20])])
    launched = []

    def example(command, **kwargs):
        launched.append(command)
        return convergence.subprocess.CompletedProcess(command, 1)  # a failed run: nothing read

    monkeypatch.setattr(convergence.subprocess, "run", example)
    for seed in (42, 43):
        argv = ["--epochs", "5", "--lr-drop-after", "3"]
        convergence.run_one(f"{config.key}-s{seed}", config, argv, args, str(runs_dir))
    out = capsys.readouterr().out
    assert "s42: its LR was cut after epochs [2], this plan cuts after none; not run" in out
    # Seed 43 followed the plan so far (its first cut comes after epoch 3): it goes on.
    assert "s43: its LR" not in out
    ((command),) = launched
    assert command[command.index("--json") + 1].endswith("-s43.json")


def test_transformer_report_reads_the_cosine_runs(tmp_path):
    plain = Config("transformer_lm", 0)
    r4 = Config("transformer_lm", 4, start_iter=200)
    r16 = Config("transformer_lm", 16, start_iter=200)
    runs = []
    for config, valid, ratio in ((plain, [300, 200, 150, 149], 1.0),
                                 (r4, [320, 210, 160, 156], 16.4),
                                 (r16, [310, 202, 152, 150.5], 8.7)):  # fmt: skip
        record = lstm_record(config, 42, valid, [1e-3, 8e-4, 3e-4, 1e-4])
        record["example"] = "transformer_lm"
        record["args"]["decay_epochs"] = 4
        for e in record["epochs"]:
            e["ratio"] = ratio
        record["final"]["ratio"] = ratio
        runs.append(record)
    groups = write_runs(tmp_path / "convergence", runs)
    targets = convergence_report._targets(groups)
    # Rank 4: 156 vs 149 x 1.02 is +4.7 %: missed; rank 16: +1.0 % at 8.7x: met.
    assert len(targets) == 2, targets
    assert targets[0].startswith("- transformer_lm, rank 4, rounds=2, start_iter 200: **missed**")
    assert "+4.70 % vs plain" in targets[0]
    assert (
        "rank 16, rounds=2, start_iter 200: **met** (within 2.0 %, >= 8x fewer bytes)" in targets[1]
    )
    table = "\n".join(convergence_tables.flattening_table(groups, "transformer_lm"))
    assert "| plain Horovod | 42 | 4 | 149.0 (4) |" in table, table
    # Still falling 21 % an epoch over the last three: not flat, and the verdict says so.
    assert "| -0.7 % | -20.8 % | cosine over 4 epochs | no |" in table, table
    assert "(validation perplexity still falling" in targets[1]
    gap = convergence_tables.gap_by_epoch_table(groups, "transformer_lm")
    assert gap[0].startswith("| epoch | plain Horovod | rank 4, rounds=2, start_iter 200 |")
    convergence_report.write_report(groups, str(tmp_path))
    report = (tmp_path / "convergence.md").read_text()
    assert "## transformer_lm" in report and "same warm-up and cosine" in report
    assert (tmp_path / "convergence_transformer_lm.png").stat().st_size > 10_000


def test_a_transformer_campaign_cut_before_its_schedule_ends_says_partial(tmp_path):
    # Runs of 2 epochs whose cosine spans 8: the verdict must not read as the final one.
    runs = []
    plain = Config("transformer_lm", 0)
    r16 = Config("transformer_lm", 16, start_iter=200)
    for config, ratio in ((plain, 1.0), (r16, 6.4)):
        record = lstm_record(config, 42, [300, 200], [1e-3, 9e-4])
        record["example"] = "transformer_lm"
        record["args"]["decay_epochs"] = 8
        record["final"]["ratio"] = ratio
        runs.append(record)
    (target,) = convergence_report._targets(write_runs(tmp_path / "convergence", runs))
    assert (
        "**not decided yet** (within 2.0 %, >= 8x fewer bytes) after 2 epochs"
        " (the LR schedule spans 8: partial)" in target
    ), target


def test_only_runs_the_named_configurations_and_refuses_unknown_keys():
    args = convergence.parse_args(["--parts", "transformer", "--only", "transformer_lm-plain"])
    plan = convergence.run_plan(args)
    assert [name for name, *_ in plan] == ["transformer_lm-plain-s42", "transformer_lm-plain-s43"]
    args = convergence.parse_args(["--parts", "transformer", "--only", "transformer_lm-r8"])
    with pytest.raises(SystemExit, match=r"--only \['transformer_lm-r8'\]: not in this plan"):
        convergence.run_plan(args)


def test_a_run_whose_checkpoint_is_gone_trains_again_and_keeps_the_earlier_record(
    tmp_path, monkeypatch, capsys
):
    # Checkpoints are not in git: on a fresh machine a 2-epoch run asked for 3 cannot go on.
    config = Config("transformer_lm", 0)
    args = convergence.parse_args(["--out", str(tmp_path)])
    runs_dir = tmp_path / "convergence"
    earlier = lstm_record(config, 42, [150.0, 120.0], [1e-3, 5e-4])
    earlier["example"] = "transformer_lm"
    earlier["launch"]["started_utc"] = "2026-11-30 10:00:00"
    write_runs(runs_dir, [earlier])
    (runs_dir / "transformer_lm-plain-s42.log").write_text("the earlier run's output\n")
    launched = []

    def example(command, **kwargs):
        launched.append(command)
        # A run from epoch 1: no resumed_after_epoch; epoch 2 comes out 1 % higher.
        record = {k: v for k, v in earlier.items() if k not in ("launch", "config")}
        record["epochs"] = [dict(e) for e in earlier["epochs"]] + [dict(earlier["epochs"][-1])]
        record["epochs"][1]["test_perplexity"] *= 1.01
        json_path = os.path.join(kwargs["cwd"], command[command.index("--json") + 1])
        with open(json_path, "w") as f:
            json.dump(record, f)
        kwargs["stdout"].write("epoch 1 again\n")
        return convergence.subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(convergence.subprocess, "run", example)
    missing = str(tmp_path / "no-such.ckpt")
    argv = ["--epochs", "3", "--checkpoint", missing]
    convergence.run_one("transformer_lm-plain-s42", config, argv, args, str(runs_dir))
    assert len(launched) == 1
    assert "2 epochs recorded, but its checkpoint" in capsys.readouterr().out
    with open(runs_dir / "transformer_lm-plain-s42.json") as f:
        record = json.load(f)
    assert "earlier_launches" not in record, "the earlier launch trained other weights"
    (replaced,) = record["replaced_runs"]
    assert replaced["epochs"] == earlier["epochs"] and replaced["launch"] == earlier["launch"]
    log = (runs_dir / "transformer_lm-plain-s42.log").read_text()
    assert "the earlier run" not in log and log.endswith("epoch 1 again\n")
    groups = convergence_report.load_runs(str(runs_dir))
    (line,) = convergence_tables.retrained_lines(groups, "transformer_lm")
    assert "first launched 2026-11-30 10:00:00 UTC, had 2 epochs" in line, line
    assert "differs by at most 1.00 % (epoch 2: 122.40 then, 123.62 now)" in line, line
    # With the checkpoint there, the same call goes on from it instead.
    open(missing, "w").close()
    convergence.run_one(
        "transformer_lm-plain-s42",
        config,
        ["--epochs", "4", "--checkpoint", missing],
        args,
        str(runs_dir),
    )
    with open(runs_dir / "transformer_lm-plain-s42.json") as f:
        assert "replaced_runs" not in json.load(f)


def test_runs_of_different_lengths_compare_at_the_epoch_all_have(tmp_path):
    # Plain trained again to 4 epochs; rank 4 still has the 2 of an earlier session.
    plain = Config("transformer_lm", 0)
    r4 = Config("transformer_lm", 4, start_iter=200)
    runs = []
    for config, valid in ((plain, [300, 200, 100, 90]), (r4, [306, 204])):
        record = lstm_record(config, 42, valid, [1e-3] * len(valid))
        record["example"] = "transformer_lm"
        record["args"]["decay_epochs"] = 4
        runs.append(record)
    groups = write_runs(tmp_path / "convergence", runs)
    (target,) = convergence_report._targets(groups)
    # +2.0 % at epoch 2, not +127 % against plain's epoch 4.
    assert (
        "after 2/4 epochs (the LR schedule spans 4: partial), compared at epoch 2,"
        " which all runs have" in target
    ), target
    assert "+2.00 % vs plain" in target and "**not decided yet**" in target, target
    summary = "\n".join(convergence_tables.summary_table("transformer_lm", groups))
    assert "| +2.0 % (epoch 2) |" in summary and "| +2.0 % (epochs 1-2) |" in summary, summary


def test_a_run_records_its_machine_and_the_report_names_machines_where_they_differ(
    tmp_path, monkeypatch, capsys
):
    # Sessions get machines of one kind with different CPUs: a rerun elsewhere is not
    # bitwise alike and its epoch times are not comparable, so the report must say where.
    config = Config("transformer_lm", 16, start_iter=200)
    args = convergence.parse_args(["--out", str(tmp_path)])
    runs_dir = tmp_path / "convergence"
    earlier = lstm_record(config, 42, [150.0, 120.0], [1e-3, 5e-4])
    earlier["example"] = "transformer_lm"
    assert "machine" not in earlier["launch"]  # as the records of before the field
    write_runs(runs_dir, [earlier])
    monkeypatch.setattr(convergence, "machine", lambda: "Other CPU (family 6, model 207), 2 cores")

    def example(command, **kwargs):
        record = {k: v for k, v in earlier.items() if k not in ("launch", "config")}
        record["epochs"] = [dict(e) for e in [*earlier["epochs"], earlier["epochs"][-1]]]
        record["epochs"][0]["test_perplexity"] *= 0.996
        with open(os.path.join(kwargs["cwd"], command[command.index("--json") + 1]), "w") as f:
            json.dump(record, f)
        return convergence.subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(convergence.subprocess, "run", example)
    argv = ["--epochs", "3", "--checkpoint", str(tmp_path / "gone.ckpt")]
    name = "transformer_lm-r16-rounds2-si200-s42"
    convergence.run_one(name, config, argv, args, str(runs_dir))
    with open(runs_dir / f"{name}.json") as f:
        assert json.load(f)["launch"]["machine"] == "Other CPU (family 6, model 207), 2 cores"
    plain = lstm_record(Config("transformer_lm", 0), 42, [149.0, 121.0], [1, 1])
    plain["example"] = "transformer_lm"
    write_runs(runs_dir, [plain])
    groups = convergence_report.load_runs(str(runs_dir))
    (line,) = convergence_tables.retrained_lines(groups, "transformer_lm")
    assert line.endswith(
        "Then on a machine not recorded, now on Other CPU (family 6, model 207), 2 cores."
    ), line
    machines = "\n".join(convergence_tables.machines_lines(groups, "transformer_lm"))
    assert "- plain Horovod, seed 42: not recorded" in machines, machines
    assert "- rank 16, rounds=2, start_iter 200, seed 42: Other CPU (family 6" in machines
    # Runs all on one machine need no such section.
    plain["launch"]["machine"] = "Other CPU (family 6, model 207), 2 cores"
    write_runs(runs_dir, [plain])
    groups = convergence_report.load_runs(str(runs_dir))
    assert convergence_tables.machines_lines(groups, "transformer_lm") == []


def test_epoch_times_are_not_one_median_over_different_machines(tmp_path):
    # Plain seed 42 trained at 649 s an epoch on one CPU, seed 43 at 806 s on another:
    # one median of both (715 s) is neither machine's time.
    config = Config("transformer_lm", 0)
    runs = []
    for seed, seconds, where in ((42, 650.0, None), (43, 800.0, "CPU B"), (44, 820.0, "CPU B")):
        r = lstm_record(config, seed, [150.0, 120.0, 110.0], [1e-3, 5e-4, 1e-4])
        r["example"] = "transformer_lm"
        for e in r["epochs"]:
            e["train_time_s"] = seconds
        if where:
            r["launch"]["machine"] = where
        runs.append(r)
    groups = write_runs(tmp_path / "convergence", runs)
    (row,) = convergence_tables.summary_table("transformer_lm", groups)[2:]
    assert row.endswith("| 650 s / 810 s (2 machines) |"), row
    # All on one machine: the one median, as before.
    groups = write_runs(tmp_path / "one", runs[1:])
    (row,) = convergence_tables.summary_table("transformer_lm", groups)[2:]
    assert row.endswith("| 810 s |"), row


def test_machine_names_this_processor_and_its_cores():
    text = machine()
    assert text.endswith(f", {os.cpu_count()} cores") and len(text) > len(" cores") + 3, text


def test_a_seed_still_training_is_held_out_of_the_seed_means_until_it_catches_up(tmp_path):
    # The campaign trains one seed at a time: rank 4 seed 43 has 2 of 4 epochs while seed 42
    # and plain's two seeds have all 4. Averaging its epoch 2 with seed 42's epoch 4 read
    # "66.97 ± 29.44" and "+nan %" on the real campaign.
    plain = Config("transformer_lm", 0)
    r4 = Config("transformer_lm", 4, start_iter=200)
    runs = []
    for config, seed, valid in ((plain, 42, [300, 200, 100, 90]),
                                (plain, 43, [302, 198, 101, 91]),
                                (r4, 42, [310, 205, 103, 92]),
                                (r4, 43, [330, 230])):  # fmt: skip
        record = lstm_record(config, seed, valid, [1e-3, 8e-4, 3e-4, 1e-4][: len(valid)])
        record["example"] = "transformer_lm"
        record["args"]["decay_epochs"] = 4
        runs.append(record)
    groups = write_runs(tmp_path / "convergence", runs)
    kept, behind = convergence_report._current(groups)
    assert [(r["config"]["rank"], r["args"]["seed"]) for r in behind] == [(4, 43)]
    assert [r["args"]["seed"] for r in kept[r4.key]] == [42]
    assert [r["args"]["seed"] for r in kept[plain.key]] == [42, 43]

    convergence_report.write_report(groups, str(tmp_path))
    report = (tmp_path / "convergence.md").read_text()
    assert "nan" not in report.lower(), "no NaN text from too few epochs"
    # Rank 4 reads seed 42 alone at its epoch 4 (92 x 1.02), paired with plain seed 42 (90).
    # The summary's row is the first of rank 4's rows (the per-run tables follow it).
    row = next(line for line in report.splitlines() if line.startswith("| rank 4, rounds=2"))
    assert row.startswith("| rank 4, rounds=2, start_iter 200 | 42 | 4 | 93.84 ± — "), row
    assert "| +2.2 % |" in row and "(epoch" not in row, row
    # The verdict is read after the whole schedule, not as a partial one cut at epoch 2.
    (target,) = [line for line in report.splitlines() if line.startswith("- transformer_lm")]
    assert "after 4 epochs" in target and "partial" not in target, target
    assert "+2.22 % vs plain" in target and "seeds 42 vs plain 42" in target, target
    # The gap table still runs over all 4 epochs; seed 43's epochs stay in the per-run tables.
    # Plain: the mean of both seeds (91.80, 92.82); rank 4 against plain seed 42 alone.
    assert "\n| 4 | 92.31 | 93.84 | +2.2 % |" in report, report
    assert "| rank 4, rounds=2, start_iter 200 | 43 | 2 | 230.0 (2) |" in report
    assert "| rank 4, rounds=2, start_iter 200 | 43 | 2 | 234.60 | 230.0 |" in report
    held = "rank 4, rounds=2, start_iter 200 seed 43: 2 of 4 epochs"
    assert report.count(held) == 2, "named by the targets and by the model's section"
    # Once it has all 4 epochs it is back in the means.
    runs[-1] = lstm_record(r4, 43, [330, 230, 104, 93], [1e-3, 8e-4, 3e-4, 1e-4])
    runs[-1]["example"] = "transformer_lm"
    _, behind = convergence_report._current(write_runs(tmp_path / "convergence", runs))
    assert behind == []


def test_auto_runs_are_judged_against_plains_seed_spread_and_show_their_ranks(tmp_path):
    plain = Config("fashion_mnist", 0)
    auto = Config("fashion_mnist", "auto", link="50mbit")
    runs = [fake_record(plain, s, [0.90, a], 1.0) for s, a in ((42, 0.920), (43, 0.914))]
    inside = [fake_record(auto, s, [0.89, a], 150.0) for s, a in ((42, 0.913), (43, 0.917))]
    for r, plans in zip(inside, ([[0, 2], [1, 2]], [[0, 2], [0, 2]])):
        for e, plan in zip(r["epochs"], plans):
            e["plan"] = plan
    groups = write_runs(tmp_path / "convergence", runs + inside)
    lines = convergence_tables.auto_lines(groups, "fashion_mnist")
    # Mean 91.50 against plain's 91.40-92.00: inside the spread.
    assert "**met**" in lines[0] and "91.50" in lines[0] and "91.40-92.00" in lines[0], lines
    assert "| 42 | 1 | p 2 |" in lines and "| 42 | 2 | 1 2 |" in lines, lines
    assert "| 43 | 1-2 | p 2 |" in lines, lines  # one row for a plan that held
    convergence_report.write_report(groups, str(tmp_path))
    assert '### rank="auto"' in (tmp_path / "convergence.md").read_text()

    # Below plain's worst seed: a miss.
    low = [fake_record(auto, s, [0.89, a], 150.0) for s, a in ((42, 0.910), (43, 0.912))]
    groups = write_runs(tmp_path / "again", runs + low)
    lines = convergence_tables.auto_lines(groups, "fashion_mnist")
    assert "**missed**" in lines[0] and "not recorded" in "\n".join(lines), lines
