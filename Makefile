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
# test (per-test limit in pyproject.toml), this cap ends the whole launcher.
RUN_CAP ?= timeout --signal=KILL 1200

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
	$(RUN_CAP) $(PY) -m pytest tests/launch -p no:cacheprovider

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
# imports one way, and one step's path through the package at most 300 lines.
lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint Dockerfile docker/Dockerfile.gpu
	$(PY) scripts/check_structure.py
	$(PY) scripts/step_path.py --rounds 2 --max-lines 300 | tail -1
	$(PY) scripts/step_path.py --rounds 1 --max-lines 300 | tail -1

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
	$(PY) scripts/convergence.py $(CONVERGENCE_ARGS)

# Speed and bytes, 2 workers, every configuration side by side at unlimited,
# 200 Mbit/s and 50 Mbit/s (tc-capped network namespaces): ResNet-18 at rank 2
# and the LSTM at rank 4, both schedules (rounds=2 `powersgd`, rounds=1
# `powersgd-1round`) against local training, plain Horovod and torch's
# powerSGD_hook, and a model of 300 layers of distinct shapes (unlimited only)
# -> docs/benchmarks.md + .png. `powersgd-nostats` (layer_stats=False) beside
# `powersgd` gives the cost of the per-layer statistics. Plain Horovod's LSTM at 50 Mbit/s
# is left out (over 30 s a step). About an hour on 2 cores with BENCH_REPEAT=2,
# so not part of `make test`; nothing else may run meanwhile.
BENCH_REPEAT ?= 2
BENCH_COMMON = -np 2 --warmup-steps 3 --steps 10 --repeat $(BENCH_REPEAT)
BENCH_RESNET = $(BENCH_COMMON) --models resnet18 --bandwidth unlimited,200mbit,50mbit \
	--configs local,horovod,powersgd:2,powersgd-1round:2,ddp-powersgd:2,powersgd-nostats:2
BENCH_LSTM = $(BENCH_COMMON) --models lstm --compare-rank 4 --bandwidth unlimited,200mbit \
	--configs local,horovod,powersgd:4,powersgd-1round:4,ddp-powersgd:4,powersgd-nostats:4
BENCH_LSTM_50 = $(BENCH_COMMON) --models lstm --compare-rank 4 --bandwidth 50mbit \
	--configs local,powersgd:4,powersgd-1round:4,ddp-powersgd:4
# Many distinct layer shapes (issue 23): the local math's per-shape overhead, unlimited.
BENCH_MANY = $(BENCH_COMMON) --models manyshapes --bandwidth unlimited \
	--configs local,horovod,powersgd:2,powersgd-1round:2
# Bytes are the same at any speed: the float16 variants run once, unlimited.
BENCH_FP16 = -np 2 --warmup-steps 3 --steps 2 --models resnet18 \
	--configs powersgd-fp16:2,powersgd-1round-fp16:2
bench: setup
	mkdir -p build
	$(PY) -m horovod_powersgd.bench $(BENCH_RESNET) --json build/bench-resnet18.json
	$(PY) -m horovod_powersgd.bench $(BENCH_LSTM) --json build/bench-lstm.json
	$(PY) -m horovod_powersgd.bench $(BENCH_LSTM_50) --json build/bench-lstm-50.json
	$(PY) -m horovod_powersgd.bench $(BENCH_FP16) --json build/bench-fp16.json
	$(PY) -m horovod_powersgd.bench $(BENCH_MANY) --json build/bench-many.json
	$(PY) -m horovod_powersgd.bench $(BENCH_COMMON) --from-json build/bench-resnet18.json build/bench-lstm.json \
		build/bench-lstm-50.json build/bench-fp16.json build/bench-many.json --command-line "make bench" \
		--plot docs/benchmarks.png --markdown docs/benchmarks.md

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

# rank="auto" beside every fixed configuration (plain, fp16, PowerSGD at ranks 1-16 in both
# schedules) at four links, on ResNet-18, the LSTM and the small GPT: one report per model,
# docs/benchmarks-auto-MODEL.md with auto's targets, its records kept in docs/results/bench-auto/
# (a report can be rendered again from them; docs/benchmarks-auto.md sums the three up).
# Plain Horovod's LSTM at 50 Mbit/s, fp32 and fp16, is left out (over 30 s a step).
# 15 untimed steps for every configuration: the GPT's step time settles only after about 10
# (auto takes its own 40 to measure, try and settle; docs/benchmarks-auto.md).
# Hours on 2 cores; nothing else may run meanwhile. BENCH_AUTO_MODELS picks models.
BENCH_AUTO_CONFIGS := local,horovod,horovod-fp16,powersgd,powersgd-1round:1,powersgd-1round:2
BENCH_AUTO_CONFIGS := $(BENCH_AUTO_CONFIGS),powersgd-1round:4,powersgd-1round:8,powersgd-1round:16
BENCH_AUTO_CONFIGS := $(BENCH_AUTO_CONFIGS),powersgd-auto,powersgd-1round-auto
BENCH_AUTO_COMMON = -np 2 --warmup-steps 15 --steps 10 --repeat $(BENCH_REPEAT) --ranks 1,2,4,8,16
BENCH_AUTO_MODELS ?= resnet18 lstm gpt
BENCH_AUTO_RECORDS := docs/results/bench-auto
bench-auto: setup
	mkdir -p $(BENCH_AUTO_RECORDS)
	for model in $(BENCH_AUTO_MODELS); do \
		$(PY) -m horovod_powersgd.bench $(BENCH_AUTO_COMMON) --models $$model \
			--bandwidth unlimited,1gbit,200mbit --configs $(BENCH_AUTO_CONFIGS) \
			--json $(BENCH_AUTO_RECORDS)/$$model.json; \
		configs=$(BENCH_AUTO_CONFIGS); \
		if [ $$model = lstm ]; then configs=$${configs/horovod,horovod-fp16,/}; fi; \
		$(PY) -m horovod_powersgd.bench $(BENCH_AUTO_COMMON) --models $$model \
			--bandwidth 50mbit --configs $$configs --json $(BENCH_AUTO_RECORDS)/$$model-50.json; \
		$(PY) -m horovod_powersgd.bench $(BENCH_AUTO_COMMON) --from-json \
			$(BENCH_AUTO_RECORDS)/$$model.json $(BENCH_AUTO_RECORDS)/$$model-50.json \
			--command-line "make bench-auto BENCH_AUTO_MODELS=$$model" \
			--markdown docs/benchmarks-auto-$$model.md; \
	done

# The GPU check (docs/gpu.md). gpu-bundle fetches what the device machine lacks
# (Horovod's sdist, the wheels Horovod needs for Python 3.12 there) into build/gpu-bundle,
# which the device run carries; gpu-check runs scripts/gpu_check.sh here: tiny models on the
# CPU, report in build/gpu-check (a few minutes on 2 cores; tests/launch runs it too).
gpu-bundle:
	bash scripts/gpu_bundle.sh

gpu-check: setup
	$(RUN_CAP) bash scripts/gpu_check.sh

# 2000 steps under mpirun: RSS over time and NaN/Inf checks -> docs/long_run.md
# (a few minutes on 2 cores; not part of `make test`).
long-run: setup
	$(RUN_CAP) $(MPIRUN) $(PY) scripts/long_run.py --steps 2000

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
