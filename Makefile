# The README's commands. Each target runs the idempotent set-up first
# (scripts/bootstrap.sh: OpenMPI, .venv, torch, Horovod built and cached).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c

VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
# OpenMPI refuses to run as root without these; harmless otherwise.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PYTHONUNBUFFERED := 1
# Oversubscribing 2 cores with 2 ranks x N threads makes everything crawl.
export OMP_NUM_THREADS ?= 1
# Waiting ranks yield the core instead of busy-polling it (2 cores, 2+ ranks).
MPIRUN = mpirun --allow-run-as-root --oversubscribe -np $(NP) --bind-to none --map-by slot \
	--mca btl self,tcp,vader --mca mpi_yield_when_idle 1 \
	-x OMP_NUM_THREADS -x PYTHONUNBUFFERED -x PATH
# A hung collective must fail the run, never hang CI: pytest-timeout fails a
# test (per-test limit in pyproject.toml), this cap ends the whole launcher. The
# launch tests (whole jobs, two-node grounds) ran 16.7 min on 2026-12-05, past 20 in
# a clean-clone CI run on 2026-12-06 and 17.5 alone after it, on the same 2 cores:
# their cap is 35 min.
RUN_CAP ?= timeout --signal=KILL 1200
LAUNCH_CAP ?= timeout --signal=KILL 2100

.PHONY: setup test test-unit test-parallel test-mpi test-gloo test-mpi4py test-launch demo bench bench-overheads bench-auto lint convergence docker-check long-run clean slurm-check gpu-bundle gpu-check

setup:
	bash scripts/bootstrap.sh

test: setup
	$(MAKE) --no-print-directory lint test-unit test-mpi test-mpi4py test-gloo test-launch

test-unit:
	$(PY) -m pytest tests/unit

test-parallel: test-mpi test-gloo

# Tests that start whole jobs themselves: killed workers, elastic, restarts.
test-launch:
	$(LAUNCH_CAP) $(PY) -m pytest tests/launch -p no:cacheprovider --durations=15

# The process-set tests once more with 3 ranks: a set without global rank 0 of 2 ranks.
test-mpi:
	$(RUN_CAP) $(MPIRUN) $(PY) -m pytest tests/parallel -p no:cacheprovider
	$(RUN_CAP) $(subst -np $(NP) ,-np 3 ,$(MPIRUN)) $(PY) -m pytest tests/parallel/test_process_sets.py \
		-p no:cacheprovider

# Horovod inside an MPI program: 4 ranks split by mpi4py into two groups of two, one
# without world rank 0 (tests/mpi4py/conftest.py; any even MPI4PY_NP >= 4 works). MPI
# only: Gloo has no communicators (docs/mpi4py.md).
MPI4PY_NP ?= 4
test-mpi4py: override NP = $(MPI4PY_NP)
test-mpi4py:
	$(RUN_CAP) $(MPIRUN) $(PY) -m pytest tests/mpi4py -p no:cacheprovider

test-gloo:
	$(RUN_CAP) $(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo \
		$(PY) -m pytest tests/parallel -p no:cacheprovider
	$(RUN_CAP) $(VENV)/bin/horovodrun -np 3 -H localhost:3 --gloo \
		$(PY) -m pytest tests/parallel/test_process_sets.py -p no:cacheprovider

# The structure too (docs/architecture.md): one module imports Horovod, sizes,
# imports one way, and one step's path through the package at most 425 lines (flat),
# 490 once rank="auto" has settled; the hierarchical step's, at most 460, needs nodes of
# several workers: tests/launch/test_hierarchical.py counts it (HIERARCHICAL_STEP_LINES).
STEP_PATH = timeout --signal=KILL 300 $(PY) scripts/step_path.py
lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint Dockerfile docker/Dockerfile.gpu
	$(PY) scripts/check_structure.py
	$(STEP_PATH) --rounds 2 1 --max-lines 425 | grep lines
	$(STEP_PATH) --auto --rounds 2 1 --max-lines 490 | grep lines

# Builds the CPU image with podman (slow: it compiles Horovod), checks that the
# build's self-test ran and smoke-tests the image; not part of `make test`.
docker-check:
	bash docker/check.sh

# A throw-away two-node Slurm on this machine (Debian's slurm-wlm and munge, network
# namespaces as nodes) runs docker/slurm/*.sbatch on 1 and 2 nodes and a job with a killed
# rank, then stops everything it started; a few minutes, as root; not part of `make test`.
slurm-check: setup
	bash docker/slurm/check.sh

# Fashion-MNIST, 2 workers, PowerSGD rank 2, one epoch (minutes on 2 cores);
# the last line gives test accuracy, bytes sent and the compression ratio.
# mpi_yield_when_idle: 2 ranks share 2 cores with Horovod's background threads,
# and OpenMPI's busy polling would take the cores from the training itself.
demo: setup
	$(RUN_CAP) $(VENV)/bin/horovodrun -np 2 -H localhost:2 \
		--mpi-args="--mca mpi_yield_when_idle 1" \
		$(PY) examples/fashion_mnist.py --powersgd-rank 2 --epochs 1

# Issue 14's campaign -> docs/results/convergence.md: Fashion-MNIST 10 epochs x 3 seeds
# (plain; rank 2 in both schedules; ranks 1, 4), the start_iter study, the LSTM on the
# whole corpus (plain vs rank 4, both schedules, 2 seeds), the transformer (below). Many
# hours on 2 cores, so not part of `make test`; rerun to resume, or pass
# CONVERGENCE_ARGS="--parts fashion,warmup".
# LSTM runs: 20 epochs, LR / 4 after epoch 14 in every run, a checkpoint every epoch;
# CONVERGENCE_ARGS="--lm-epochs 24" trains on.
# Issue 26's transformer with AdamW (plain vs ranks 4 and 16, start_iter = the 200-step LR
# warm-up, seeds 42/43, 8 epochs of one cosine; about 11 hours, checkpoint every epoch, rerun
# to resume): CONVERGENCE_ARGS="--parts transformer" runs it alone.
convergence: setup
	$(PY) scripts/convergence/convergence.py $(CONVERGENCE_ARGS)

# Speed and bytes, 2 workers: one paired job per model and link (issue 47), every Horovod
# configuration in it (local, plain, fp16, PowerSGD at BENCH_RANKS in both schedules, rank="auto"
# in both), each with its own model copy, visited in interleaved blocks; every ratio (x local,
# x horovod, the targets) a median of per-round ratios with its 95 % interval. A job stops when
# the intervals its targets need are within +-1 %, or at BENCH_BUDGET_S (15 minutes), and the
# report says which. ResNet-18, the LSTM and the small GPT at four links, the many-shapes model
# unlimited only; any subset: make bench BENCH_MODELS="gpt" BENCH_LINKS="unlimited 50mbit".
# At unlimited also the fp16 variants (bytes) and powersgd-nostats (the statistics' cost);
# torch's powerSGD_hook (ddp-powersgd) cannot share a process with Horovod: a job of its own,
# reported without interval. Plain Horovod and its fp16 are left out where a step takes
# several seconds (ResNet-18 and the LSTM at 50 Mbit/s, the LSTM at 200 Mbit/s): their warm-up
# alone would take the budget. Records: docs/results/bench/MODEL-LINK.json; reports:
# docs/benchmarks-MODEL.md per model and docs/benchmarks.md (all). Up to 15 minutes a job,
# about 2.5 hours for all 13; nothing else may run meanwhile (the pairing cancels load that
# hits every configuration alike, not all of it).
BENCH_MODELS ?= resnet18 lstm gpt manyshapes
BENCH_LINKS ?= unlimited 1gbit 200mbit 50mbit
BENCH_BUDGET_S ?= 900
BENCH_RANKS ?= 1,2,4
BENCH_RECORDS := docs/results/bench
BENCH_PAIRED = -np 2 --paired --warmup-steps 15 --block-steps 3 --steps 10 \
	--budget-s $(BENCH_BUDGET_S) --ranks $(BENCH_RANKS)
# Per job: the fp16, statistics and DDP-hook rows at rank 2 (the LSTM's 4, as today's targets).
# First, the ops a steady-state step dispatches over Horovod's and the local work's CPU time,
# ResNet-50's shapes at ranks 4 and 32, both schedules (docs/gpu.md, "The CPU proxy").
bench: setup
	mkdir -p $(BENCH_RECORDS)
	$(PY) -m horovod_powersgd.bench.dispatch --json $(BENCH_RECORDS)/dispatch.json
	failed=""; \
	for model in $(BENCH_MODELS); do \
		for link in $(BENCH_LINKS); do \
			if [ $$model = manyshapes ] && [ $$link != unlimited ]; then continue; fi; \
			rank=2; if [ $$model = lstm ]; then rank=4; fi; \
			configs=local; \
			case $$model-$$link in \
				resnet18-50mbit|lstm-50mbit|lstm-200mbit) ;; \
				*) configs=$$configs,horovod,horovod-fp16;; \
			esac; \
			if [ $$link = unlimited ]; then \
				configs=$$configs,powersgd-fp16,powersgd-1round-fp16,powersgd-nostats; fi; \
			oneround=$$(echo $(BENCH_RANKS) | sed 's/\([0-9][0-9]*\)/powersgd-1round:\1/g'); \
			configs=$$configs,powersgd,$$oneround,powersgd-auto,powersgd-1round-auto,ddp-powersgd; \
			$(PY) -m horovod_powersgd.bench $(BENCH_PAIRED) --models $$model --bandwidth $$link \
				--compare-rank $$rank --configs $$configs \
				--json $(BENCH_RECORDS)/$$model-$$link.json || failed="$$failed $$model-$$link"; \
		done; \
		$(PY) -m horovod_powersgd.bench --from-json $(BENCH_RECORDS)/$$model-*.json \
			--command-line "make bench BENCH_MODELS=$$model" --markdown docs/benchmarks-$$model.md; \
	done; \
	$(PY) -m horovod_powersgd.bench --from-json $(BENCH_RECORDS)/*.json --command-line "make bench" \
		--plot docs/benchmarks.png --markdown docs/benchmarks.md; \
	if [ -n "$$failed" ]; then echo "[bench] failed or incomplete:$$failed" >&2; exit 1; fi

# bench-auto is now part of `make bench` (rank="auto" runs in every paired job).
bench-auto: bench

# The old runs, every configuration a job of its own; bench-overheads still uses them.
BENCH_REPEAT ?= 2
BENCH_COMMON = -np 2 --warmup-steps 3 --steps 10 --repeat $(BENCH_REPEAT)

# The overheads alone, unlimited bandwidth (about 10 minutes; nothing else may run):
# per-layer statistics on / off (ResNet-18, LSTM) and the many-shapes model against
# plain Horovod -> docs/benchmarks-overheads.md. Same driver and medians as `make bench`.
BENCH_OVERHEAD_RESNET = $(BENCH_COMMON) --models resnet18,manyshapes --bandwidth unlimited \
	--configs local,horovod,powersgd:2,powersgd-1round:2,powersgd-nostats:2
BENCH_OVERHEAD_LSTM = -np 2 --warmup-steps 3 --steps 6 --repeat $(BENCH_REPEAT) --models lstm \
	--compare-rank 4 --bandwidth unlimited --configs horovod,powersgd:4,powersgd-nostats:4
bench-overheads: setup
	mkdir -p build
	$(PY) -m horovod_powersgd.bench $(BENCH_OVERHEAD_RESNET) --json build/bench-overheads.json
	$(PY) -m horovod_powersgd.bench $(BENCH_OVERHEAD_LSTM) --json build/bench-overheads-lstm.json
	$(PY) -m horovod_powersgd.bench $(BENCH_COMMON) --from-json build/bench-overheads.json \
		build/bench-overheads-lstm.json --command-line "make bench-overheads" \
		--markdown docs/benchmarks-overheads.md

# The GPU check (docs/gpu.md). gpu-bundle fetches what the device machine lacks
# (Horovod's sdist, the wheels Horovod needs for Python 3.12 there) into build/gpu-bundle,
# which the device run carries; gpu-check runs scripts/gpu/gpu_check.py here: tiny models on the
# CPU, report in build/gpu-check (a few minutes on 2 cores; tests/launch runs it too).
gpu-bundle:
	bash scripts/gpu/gpu_bundle.sh

gpu-check: setup
	$(RUN_CAP) $(PY) scripts/gpu/gpu_check.py

# 2000 steps under mpirun: RSS over time and NaN/Inf checks -> docs/long_run.md
# (a few minutes on 2 cores; not part of `make test`).
long-run: setup
	$(RUN_CAP) $(MPIRUN) $(PY) scripts/convergence/long_run.py --steps 2000

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
