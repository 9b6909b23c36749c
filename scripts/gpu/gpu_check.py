"""The GPU check: one command that uses one device lease, and its CPU rehearsal.

    bash scripts/gpu/gpu_check.sh              # on the device machine: full sizes, builds Horovod
    bash scripts/gpu/gpu_check.sh --size tiny  # here on the CPU: tiny models, installed Horovod

docs/gpu.md has the device call (what to carry, the time limit). Phases, each in
subprocesses with a time limit of its own, so that one that fails or runs out of
time is reported as such and the others still report:

  probe     what the machine has: GPU, driver, torch, CUDA, NCCL, nvcc, cmake, MPI, cores
  build     (CUDA only) Horovod from the carried bundle through scripts/bootstrap.sh, twice at
            once: with NCCL (+ Gloo) for 1 rank, and without GPU operations (Gloo, and MPI
            where the machine has it) for 2 ranks sharing the one GPU, whose CUDA tensors
            then travel through host memory: NCCL refuses two ranks on one GPU
  timing    gpu_timing.py local: forward+backward against PowerSGD's local work and
            torch's powerSGD_hook (needs no Horovod)
  contract  the user contract of tests/parallel (CONTRACT) under horovodrun, with
            `--device cuda` where there is a GPU: 1 rank (NCCL), 2 ranks (Gloo; MPI)
  syncs     gpu_syncs.py under horovodrun (1 rank), and on CUDA
            tests/parallel/test_host_syncs.py on CUDA tensors
  e2e       gpu_timing.py e2e under horovodrun: whole steps, 1 rank; then auto's profile

Everything lands in --out (the device's $OUT): report.json, report.md and one log
per phase, eight files at most (what the device sends back). The report is
rewritten after every phase, so a run stopped from outside keeps what was done.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = os.path.join(ROOT, "scripts", "gpu")
PHASES = ("probe", "build", "timing", "contract", "syncs", "e2e")
# Seconds per phase (full: the device, within its 8 minutes; tiny: this CPU). The build
# and the timing run side by side; contract and syncs too.
BUDGETS = {
    "full": {"total": 470, "probe": 45, "build": 270, "timing": 270, "contract": 90,
             "syncs": 90, "e2e": 70, "profile": 90},
    "tiny": {"total": 480, "probe": 60, "build": 900, "timing": 180, "contract": 240,
             "syncs": 240, "e2e": 90, "profile": 90},
}  # fmt: skip
RESERVE_S = 8  # kept back at the end for the report
LOG_LIMIT = 4 * 2**20  # the end of each log that goes back (the device takes 16 MB a file)
TARGET_SHARE = 0.05  # local work under 5 % of the step at rank 4, and <= the hook's
# What users rely on, from tests/parallel: full rank equals Horovod's average, bitwise
# identical parameters, exact resume, non-finite gradients leave the state finite, fp16 on
# the wire keeps the scale, the AMP GradScaler pattern (both schedules where they have two).
CONTRACT = ["tests/parallel/test_rounds.py", "tests/parallel/test_user_patterns.py",
            "tests/parallel/test_optimizer.py", "-k",
            "full_rank_equals_plain_horovod_average_on_every_step or bitwise or resumes_exactly"
            " or non_finite or fp16_on_the_wire or grad_scaler"]  # fmt: skip
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf"]


# --- jobs -----------------------------------------------------------------------------------
class Job:
    """One subprocess with a log file, a time limit and a status."""

    def __init__(self, name, cmd, log, env=None, cwd=ROOT):
        self.name, self.cmd, self.log = name, cmd, log
        self.started = time.monotonic()
        self.result = None
        with open(log, "w") as f:
            f.write(f"$ {' '.join(cmd)}\n")
        self._file = open(log, "a")  # noqa: SIM115 - open for the job's whole life
        self.ended = None  # when it ended, seen by a thread: jobs are waited for in turn
        try:
            self.proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env=env,
                stdout=self._file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: a timeout kills the children too
            )
        except OSError as exc:  # e.g. no horovodrun where a build is missing: a failure
            self._file.write(f"could not start: {exc}\n")
            self.proc = None
            self._finish("failed")
            return
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        self.proc.wait()
        self.ended = time.monotonic()

    def poll(self) -> bool:
        """Whether it has ended (and then its result is set)."""
        if self.result is None and self.proc is not None and self.proc.poll() is not None:
            self._finish("ok" if self.proc.returncode == 0 else "failed")
        return self.result is not None

    def wait(self, deadline: float) -> dict:
        """Wait until `deadline` (time.monotonic()); then kill it. Returns its result."""
        while not self.poll():
            if time.monotonic() >= deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                self._finish("timeout")
                break
            time.sleep(0.2)
        return self.result

    def _finish(self, status: str) -> None:
        self._file.close()
        self.result = {
            "status": status,
            "rc": None if self.proc is None else self.proc.returncode,
            "seconds": round((self.ended or time.monotonic()) - self.started, 1),
            "log_tail": _tail(self.log, 1500) if status != "ok" else "",
        }


def wait_all(jobs, deadline: float) -> None:
    """Wait for all `jobs` at once, killing each at `deadline` or its own `limit`, if sooner."""

    def end(job):
        return min(deadline, getattr(job, "limit", deadline))

    while not all(job.poll() or time.monotonic() >= end(job) for job in jobs):
        time.sleep(0.2)
    for job in jobs:
        job.wait(end(job))


def _tail(path, chars):
    try:
        with open(path, errors="replace") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read()
    except OSError:
        return ""


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --- probe ----------------------------------------------------------------------------------
def _run(cmd, timeout=20):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (out.stdout + out.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({exc.__class__.__name__})"


def _find_cuda():
    """(nvcc, CUDA home): the toolkit whose nvcc is on PATH, else /usr/local/cuda*.

    The nvcc on PATH may be a wrapper script elsewhere (seen here: /usr/local/bin/nvcc
    running /usr/local/cuda-13.0/bin/nvcc), so the home is the first candidate holding
    both bin/nvcc and include/cuda_runtime.h.
    """
    found = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(found)))] if found else []
    candidates += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for home in candidates:
        nvcc = os.path.join(home, "bin", "nvcc")
        if os.path.exists(nvcc) and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return nvcc, home
    return found, None


def _find_nccl():
    """(include dir, library file) of NCCL: torch's wheel nvidia-nccl-*, else the system's."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ImportError:  # no "nvidia" packages at all
        spec = None
    roots = list(spec.submodule_search_locations) if spec else []
    roots += ["/usr", "/usr/local", "/usr/local/cuda"]
    for root in roots:
        headers = glob.glob(os.path.join(root, "include", "nccl.h"))
        libraries = sorted(
            glob.glob(os.path.join(root, "lib", "libnccl.so*"))
            + glob.glob(os.path.join(root, "lib", "x86_64-linux-gnu", "libnccl.so*"))
            + glob.glob(os.path.join(root, "lib64", "libnccl.so*"))
        )
        if headers and libraries:
            return os.path.dirname(headers[0]), libraries[0]
    return None, None


def probe() -> dict:
    """What this machine has (run in a subprocess of the kit's python)."""
    import sysconfig

    info = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "in_venv": sys.prefix != sys.base_prefix,
        "purelib": sysconfig.get_paths()["purelib"],
        "include": sysconfig.get_paths()["include"],
        "machine": platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }
    info["system_site_packages"] = True
    if info["in_venv"]:
        cfg = os.path.join(sys.prefix, "pyvenv.cfg")
        try:
            with open(cfg) as f:
                text = f.read().lower()
            info["system_site_packages"] = "include-system-site-packages = true" in text
        except OSError:
            pass
    import torch

    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda"] = torch.cuda.is_available()
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpus"] = torch.cuda.device_count()
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["capability"] = f"{props.major}{props.minor}"
        info["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["nvidia_smi"] = _run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        )
    nvcc, info["cuda_home"] = _find_cuda()
    info["nvcc"] = nvcc
    if nvcc:
        info["nvcc_version"] = _run([nvcc, "--version"]).splitlines()[-1]
    info["nccl_include"], info["nccl_library"] = _find_nccl()
    for tool in ("cmake", "make", "ninja", "g++", "mpirun", "mpicc"):
        info[tool] = shutil.which(tool)
    if info["cmake"]:
        info["cmake_version"] = _run(["cmake", "--version"]).splitlines()[0]
    if info["g++"]:
        info["gxx_version"] = _run(["g++", "--version"]).splitlines()[0]
    info["pip"] = _run([sys.executable, "-m", "pip", "--version"]).split(" from ")[0]
    try:
        import horovod

        info["horovod"] = horovod.__version__
    except ImportError:
        info["horovod"] = None
    return info


# --- the kit --------------------------------------------------------------------------------
class Kit:
    """The phases of one run, their jobs and budgets, and the report they rewrite."""

    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        self.work = os.path.abspath(args.work)
        os.makedirs(self.out, exist_ok=True)
        os.makedirs(self.work, exist_ok=True)
        self.started = time.monotonic()
        self.size = args.size
        self.set_size(args.size if args.size != "auto" else "tiny")  # until the probe says
        self.phases = args.phases.split(",")
        self.report = {
            "kit": "scripts/gpu/gpu_check.py",
            "command": " ".join(sys.argv),
            "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "size": self.size,
            "phases": {},
            "probe": {},
        }
        self.logs: dict[str, list[str]] = {}  # phase -> job logs, gathered into one file
        self.venvs: dict[str, str] = {}  # Horovod build -> its virtual environment

    # --- plumbing -------------------------------------------------------------------------
    def set_size(self, size: str) -> None:
        self.budgets = dict(BUDGETS[size])
        if self.args.budget:
            self.budgets["total"] = self.args.budget
        if self.args.build_seconds:
            self.budgets["build"] = self.args.build_seconds
        self.deadline = self.started + self.budgets["total"] - RESERVE_S

    def budget(self, phase: str) -> float:
        """The deadline for a phase: its own budget, cut to what the whole run has left."""
        return min(time.monotonic() + self.budgets[phase], self.deadline)

    def env(self, **extra) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        nccl = self.report["probe"].get("nccl_library")
        if nccl:  # Horovod's library links libnccl.so.2 of torch's wheel
            env["LD_LIBRARY_PATH"] = f"{os.path.dirname(nccl)}:{env.get('LD_LIBRARY_PATH', '')}"
        env.update(extra)
        return env

    def job(self, phase, name, cmd, env=None, **attributes) -> Job:
        if phase in self.args.fail.split(","):
            cmd = [sys.executable, "-c", f"raise SystemExit('{phase}: failure injected by --fail')"]
        elif phase in self.args.stall.split(","):
            cmd = [sys.executable, "-c", "import time; time.sleep(3600)"]
        log = os.path.join(self.work, f"{phase}-{name}.log")
        self.logs.setdefault(phase, []).append(log)
        job = Job(f"{phase}/{name}", cmd, log, env=env or self.env())
        job.__dict__.update(attributes)
        return job

    def set_phase(self, phase, status, seconds=None, note="", **extra):
        entry = {"status": status, "note": note, **extra}
        if seconds is not None:
            entry["seconds"] = round(seconds, 1)
        self.report["phases"][phase] = entry
        self.write()

    def write(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.started, 1)
        for phase, logs in self.logs.items():
            # One file a phase of its jobs' logs, each cut to its end; one a build (the longest).
            parts = {log: f"===== {os.path.basename(log)} =====\n"
                     f"{_tail(log, LOG_LIMIT // len(logs))}\n" for log in logs}  # fmt: skip
            if phase == "build":
                for log, part in parts.items():
                    _atomic_write(os.path.join(self.out, os.path.basename(log)), part)
            else:
                _atomic_write(os.path.join(self.out, f"{phase}.log"), "".join(parts.values()))
        _atomic_write(os.path.join(self.out, "report.json"), json.dumps(self.report, indent=1))
        _atomic_write(os.path.join(self.out, "report.md"), render_markdown(self.report))

    def wanted(self, phase) -> bool:
        if phase in self.phases:
            return True
        self.set_phase(phase, "skipped", note="not in --phases")
        return False

    def horovodrun(self, build, np, *cmd, mpi=False) -> list[str]:
        """horovodrun of `cmd` under a Horovod build's python, or this environment's."""
        venv = self.venvs.get(build)
        bin_dir = os.path.join(venv, "bin") if venv else os.path.dirname(sys.executable)
        python = os.path.join(bin_dir, "python") if venv else sys.executable
        return [os.path.join(bin_dir, "horovodrun"), "-np", str(np), "-H", f"localhost:{np}",
                "--mpi" if mpi else "--gloo", python, *cmd]  # fmt: skip

    # --- phases ---------------------------------------------------------------------------
    def guarded(self, phases, step, *args, default=None):
        """`step(*args)`; should the kit itself fail there, its phases say so and the run
        goes on (one phase must not cost the others' report)."""
        try:
            return step(*args)
        except Exception:  # the kit's own bug: reported, never the end of the run
            error = traceback.format_exc()[-2000:]
            for phase in phases:
                self.set_phase(phase, "failed", note="the kit failed here: see log", log=error)
            return default

    def run(self) -> int:
        self.write()
        self.guarded(["probe"], self.phase_probe)
        cuda = bool(self.report["probe"].get("cuda"))
        if self.size == "auto":
            self.size = self.report["size"] = "full" if cuda else "tiny"
            self.set_size(self.size)
        builds = self.guarded(["build"], self.start_build, cuda, default=[])
        self.guarded(["build"], self.finish_build, builds)
        # Timed after the builds, alone on the machine (it needs no Horovod).
        timing = self.guarded(["timing"], self.start_timing) if self.wanted("timing") else None
        self.guarded(["timing"], self.finish_timing, timing)
        self.guarded(["contract", "syncs"], self.phase_contract_and_syncs, cuda)
        if self.wanted("e2e"):
            self.guarded(["e2e"], self.phase_e2e, cuda)
        self.write()
        statuses = [e["status"] for e in self.report["phases"].values()]
        return 1 if any(s not in ("ok", "skipped") for s in statuses) else 0

    def phase_probe(self):
        path = os.path.join(self.work, "probe.json")
        job = self.job("probe", "probe", [sys.executable, __file__, "probe", "--json", path])
        result = job.wait(self.budget("probe"))
        self.logs.pop("probe")  # its output is in the report
        self.report["probe"] = _read_json(path) or {}
        self.set_phase("probe", result["status"], result["seconds"], result["log_tail"][-500:])

    def start_build(self, cuda: bool) -> list[Job]:
        if not self.wanted("build"):
            return []
        if self.args.build == "no" or (self.args.build == "auto" and not cuda):
            note = "--build no" if cuda else "no CUDA: the Horovod already installed here is used"
            self.set_phase("build", "skipped", note=note)
            return []
        info, bundle = self.report["probe"], os.path.abspath(self.args.bundle)
        if not glob.glob(os.path.join(bundle, "horovod-*.tar.gz")):
            note = f"no Horovod sdist in {bundle}: run `make gpu-bundle` and carry it (docs/gpu.md)"
            self.set_phase("build", "failed", note=note)
            return []
        self.report["build"] = {"bundle": sorted(os.listdir(bundle)), "variants": {}}
        jobs = []
        variants = self.args.build_variants or ("nccl,gloo" if cuda else "cpu")
        for variant in variants.split(","):  # nccl,gloo without a GPU: a rehearsal
            try:
                venv = make_venv(self.work, variant, info, bundle)
                env = build_env(self, variant, info, bundle, venv)
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                note = f"preparing its environment: {exc}"
                self.report["build"]["variants"][variant] = {"status": "failed", "note": note}
                continue
            cmd = ["nice", "-n", "19", "bash", os.path.join(ROOT, "scripts", "bootstrap.sh")]
            jobs.append(self.job("build", variant, cmd, env, venv=venv, variant=variant))
        self.write()
        return jobs

    def finish_build(self, jobs: list[Job]) -> None:
        if "build" in self.report["phases"] and not jobs:
            return
        variants = self.report["build"]["variants"]
        wait_all(jobs, self.budget("build"))
        for job in jobs:
            entry = {**job.result, "venv": os.path.relpath(job.venv, ROOT)}
            if job.result["status"] == "ok":
                python = os.path.join(job.venv, "bin", "python")
                check = subprocess.run([python, "-c", BUILT], capture_output=True, text=True,
                                       timeout=120, env=self.env())  # fmt: skip
                try:
                    entry["built"] = json.loads(check.stdout.strip().splitlines()[-1])
                    self.venvs[job.variant] = job.venv
                except (ValueError, IndexError):
                    entry["status"] = "failed"
                    entry["log_tail"] = (check.stdout + check.stderr)[-1500:]
            variants[job.variant] = entry
        statuses = [v["status"] for v in variants.values()]
        status = "ok" if statuses and all(s == "ok" for s in statuses) else "failed"
        seconds = max((v.get("seconds", 0) for v in variants.values()), default=0)
        note = ", ".join(f"{k}: {v['status']}" for k, v in variants.items())
        self.set_phase("build", status, seconds, note=note)

    def start_timing(self) -> Job:
        path = os.path.join(self.work, "timing.json")
        venv = self.venvs.get("nccl")
        python = os.path.join(venv, "bin", "python") if venv else sys.executable
        cmd = [python, os.path.join(KIT, "gpu_timing.py"), "local", "--json", path,
               "--size", self.size]  # fmt: skip
        # Not OMP_NUM_THREADS=1 here: this process is alone on its device.
        env = self.env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))
        return self.job("timing", "local", cmd, env, path=path)

    def finish_timing(self, job: Job | None) -> None:
        if job is not None:
            result = job.wait(self.budget("timing"))
            self.report["timing"] = _read_json(job.path)
            self.set_phase("timing", result["status"], result["seconds"], log=result["log_tail"])

    def phase_contract_and_syncs(self, cuda: bool) -> None:
        contract, syncs = self.wanted("contract"), self.wanted("syncs")
        one, two = self.builds_for_runs(cuda)
        if cuda and ("nccl" not in self.venvs or "gloo" not in self.venvs):
            self.report["runs_without"] = [b for b in ("nccl", "gloo") if b not in self.venvs]
        device = "cuda" if cuda else "cpu"
        runs = [("1 rank", one, 1, False), ("2 ranks, Gloo", two, 2, False)] if contract else []
        if contract and self.report["probe"].get("mpirun") and self._built(two, "mpi"):
            runs.append(("2 ranks, MPI", two, 2, True))
        jobs = []
        for label, build, np, mpi in runs:
            if not cuda or build in self.venvs:
                cmd = self.horovodrun(build, np, *PYTEST, *CONTRACT, "--device", device, mpi=mpi)
                jobs.append(self.job("contract", _slug(label), cmd, label=label, ranks=np))
        if contract and cuda and "nccl" in self.venvs:
            # What NCCL says to two ranks on one GPU (expected: it refuses).
            cmd = self.horovodrun("nccl", 2, "-c", NCCL_TWO_RANKS)
            job = self.job("contract", "nccl-2-ranks", cmd, label="2 ranks, NCCL on one GPU")
            job.limit = time.monotonic() + 45  # a refusal may hang: not the phase's time
            jobs.append(job)
        if syncs and cuda and one not in self.venvs:
            self.set_phase("syncs", "failed", note="no Horovod build with NCCL to run on")
        elif syncs:
            path = os.path.join(self.work, "syncs.json")
            cmd = self.horovodrun(one, 1, os.path.join(KIT, "gpu_syncs.py"),
                                  "--json", path, "--size", self.size)  # fmt: skip
            jobs.append(self.job("syncs", "probe", cmd, label="probe", path=path))
            if cuda:  # its CUDA cases (the CPU ones ran where the kit was made)
                test = [*PYTEST, "tests/parallel/test_host_syncs.py", "-k", "cuda or catches"]
                jobs.append(self.job("syncs", "test", self.horovodrun(one, 1, *test), label="test"))
        self.report.setdefault("contract", {})
        self.report.setdefault("syncs", {})
        wait_all(jobs, min(self.budget("contract"), self.budget("syncs")))
        for job in jobs:
            entry, log = dict(job.result), _tail(job.log, 20000)
            if job.name == "contract/nccl-2-ranks":
                entry["outcome"] = _nccl_outcome(log)
            elif job.name.startswith("contract/"):
                entry.update(_pytest_outcome(log), ranks=job.ranks, device=device)
            elif job.label == "probe":
                entry["result"] = _read_json(job.path)
            else:
                entry.update(_pytest_outcome(log))
            self.report[job.name.split("/")[0]][job.label] = entry
            self.write()
        if contract:
            self.set_phase("contract", *_contract_status(self.report["contract"], runs))
        if syncs and "syncs" not in self.report["phases"]:
            entries = self.report["syncs"].values()
            status = "ok" if entries and all(e["status"] == "ok" for e in entries) else "failed"
            self.set_phase("syncs", status, max((e["seconds"] for e in entries), default=0))

    def builds_for_runs(self, cuda: bool) -> tuple:
        """(build for 1 rank, build for 2 ranks): with CUDA the NCCL and the Gloo build;
        without, whatever was built here (a rehearsal), else None: this environment's."""
        if cuda:
            return "nccl", "gloo"
        one = next((b for b in ("nccl", "cpu") if b in self.venvs), None)
        two = next((b for b in ("gloo", "cpu") if b in self.venvs), None)
        return one, two

    def _built(self, build, feature) -> bool:
        if build in self.venvs:
            return bool(self.report["build"]["variants"][build].get("built", {}).get(feature))
        code = f"import horovod.torch as hvd, sys; sys.exit(not hvd.{feature}_built())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True,
                              timeout=60).returncode == 0  # fmt: skip

    def phase_e2e(self, cuda: bool) -> None:
        build = self.builds_for_runs(cuda)[0]
        if cuda and build not in self.venvs:
            self.set_phase("e2e", "failed", note="no Horovod build with NCCL to run on")
            return
        # Whole steps, then rank="auto"'s profile of each model (docs/scale.md): in the e2e
        # phase's report and log, its status only a note (the phase's verdict is the steps').
        results = {}
        for name, job_name in (("e2e", "steps"), ("profile", "profile")):
            path = os.path.join(self.work, f"{name}.json")
            cmd = self.horovodrun(build, 1, os.path.join(KIT, "gpu_timing.py"), name,
                                  "--json", path, "--size", self.size)  # fmt: skip
            results[name] = self.job("e2e", job_name, cmd).wait(self.budget(name))
            self.report[name] = _read_json(path)
            steps, profile = results["e2e"], results.get("profile")
            note = f"profile: {profile['status']} in {profile['seconds']:.1f} s" if profile else ""
            self.set_phase("e2e", steps["status"], steps["seconds"], note, log=steps["log_tail"])


BUILT = ("import json, horovod, horovod.torch as hvd; print(json.dumps({'horovod': "
         "horovod.__version__, 'nccl': bool(hvd.nccl_built()), 'gloo': bool(hvd.gloo_built()), "
         "'mpi': bool(hvd.mpi_built()), 'cuda': bool(hvd.cuda_built())}))")  # fmt: skip
NCCL_TWO_RANKS = (
    "import torch, horovod.torch as hvd; hvd.init(); torch.cuda.set_device(0); "
    "print('sum', hvd.allreduce(torch.ones(1, device='cuda'), op=hvd.Sum).item())"
)


# --- building Horovod -----------------------------------------------------------------------
def make_venv(work, variant, info, bundle) -> str:
    """A virtual environment that sees the machine's torch, for one Horovod build.

    bootstrap.sh installs Horovod into $VENV; the device's torch lives in the image's
    own environment, which stays untouched: a .pth file adds its site-packages (and
    runs its .pth files) behind this environment's own.
    """
    venv = os.path.join(work, f"venv-{variant}")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        flags = ["--system-site-packages"] if info.get("system_site_packages") else []
        made = subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", *flags, venv],
            capture_output=True,
            timeout=60,
        )
        if made.returncode != 0:  # a venv module cut down (Debian's without python3-venv)
            _make_bare_venv(venv, info.get("system_site_packages"))
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    if info.get("in_venv"):
        with open(os.path.join(site, "_gpu_check_base.pth"), "w") as f:
            f.write(f"import site; site.addsitedir({info['purelib']!r})\n")
    # bootstrap.sh installs the project itself unless this stamp is newer than
    # setup.py: here the project comes from PYTHONPATH, and nothing can be fetched.
    with open(os.path.join(venv, ".project-installed"), "w"):
        pass
    # Horovod's setup.py asks for cffi at build time; the image lacks it.
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--find-links", bundle,
         "--disable-pip-version-check", "cffi", "pycparser"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if installed.returncode != 0:
        raise RuntimeError("pip install cffi from the bundle: " + installed.stderr[-800:])
    return venv


def build_env(kit, variant, info, bundle, venv) -> dict:
    """The environment of one Horovod build through bootstrap.sh, offline, from the bundle."""
    cores = str(info.get("cores") or os.cpu_count())
    env = kit.env(
        SKIP_APT="1",
        VENV=os.path.relpath(venv, ROOT),  # bootstrap.sh takes it relative to the root
        TORCH_VERSION=info["torch"].split("+")[0],
        WHEEL_CACHE=os.path.join(kit.work, "wheels"),
        PIP_NO_INDEX="1",  # nothing can be fetched there: the bundle is the index
        PIP_FIND_LINKS=bundle,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        MAKEFLAGS=f"-j{cores}",
        # Gloo's CMakeLists asks for CMake 2.8.12; CMake 4 refuses that without this.
        CMAKE_POLICY_VERSION_MINIMUM="3.5",
        CPATH=info["include"],  # Python.h, should Horovod's CMake miss it
        HOROVOD_WITH_PYTORCH="1",
    )
    env.pop("HOROVOD_GPU_OPERATIONS", None)  # bootstrap.sh sets it where nvcc is
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # cmake, ninja
    if not info.get("mpicc"):
        env["HOROVOD_WITHOUT_MPI"] = "1"  # bootstrap.sh asks for MPI; the machine has none
    if not info.get("make") and info.get("ninja"):
        env["CMAKE_GENERATOR"] = "Ninja"
    if variant == "cpu":
        return env
    nvcc, cuda_home = info["nvcc"], info.get("cuda_home")
    if not cuda_home:
        raise RuntimeError("no CUDA toolkit found (nvcc on PATH, /usr/local/cuda*)")
    env.update(
        HOROVOD_CUDA_HOME=cuda_home,
        CUDA_HOME=cuda_home,
        # Kernels for this GPU only: nvcc 13 knows a dozen architectures, all compiled twice.
        HOROVOD_BUILD_CUDA_CC_LIST=info.get("capability") or kit.args.cuda_arch,
    )
    if variant == "nccl":
        if not info.get("nccl_include"):
            raise RuntimeError("no NCCL headers found (torch's nvidia-nccl wheel, /usr)")
        # Horovod's FindNCCL looks for libnccl.so; the wheel has libnccl.so.2 only.
        shim = os.path.join(kit.work, "nccl-lib")
        os.makedirs(shim, exist_ok=True)
        link = os.path.join(shim, "libnccl.so")
        if not os.path.lexists(link):
            os.symlink(info["nccl_library"], link)
        env.update(
            HOROVOD_NCCL_INCLUDE=info["nccl_include"],
            HOROVOD_NCCL_LIB=shim,
            HOROVOD_NCCL_LINK="SHARED",
            PATH=os.path.dirname(nvcc) + os.pathsep + env["PATH"],
        )
    else:
        # bootstrap.sh builds with NCCL wherever `nvcc` is on PATH: hide it, so this one
        # gets no GPU operations (CMake still finds CUDA through HOROVOD_CUDA_HOME).
        env["PATH"] = _path_without(env["PATH"], "nvcc", os.path.join(kit.work, "path"))
    return env


def _make_bare_venv(venv: str, system_site_packages: bool) -> None:
    """What `python -m venv --without-pip` makes: a pyvenv.cfg and links to the interpreter."""
    base = getattr(sys, "_base_executable", sys.executable)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    os.makedirs(os.path.join(venv, "bin"), exist_ok=True)
    os.makedirs(os.path.join(venv, "lib", f"python{version}", "site-packages"), exist_ok=True)
    for name in ("python", "python3", f"python{version}"):
        link = os.path.join(venv, "bin", name)
        if not os.path.lexists(link):
            os.symlink(base, link)
    with open(os.path.join(venv, "pyvenv.cfg"), "w") as f:
        f.write(
            f"home = {os.path.dirname(base)}\n"
            f"include-system-site-packages = {str(bool(system_site_packages)).lower()}\n"
            f"version = {platform.python_version()}\n"
        )


def _path_without(path: str, program: str, shadow_root: str) -> str:
    """`path` in which no directory provides `program`: such directories are replaced by
    a shadow directory of links to everything else in them."""
    parts = []
    for i, directory in enumerate(path.split(os.pathsep)):
        if not os.path.exists(os.path.join(directory, program)):
            parts.append(directory)
            continue
        shadow = os.path.join(shadow_root, str(i))
        os.makedirs(shadow, exist_ok=True)
        for name in os.listdir(directory):
            link = os.path.join(shadow, name)
            if name != program and not os.path.lexists(link):
                os.symlink(os.path.join(directory, name), link)
        parts.append(shadow)
    return os.pathsep.join(parts)


# --- reading the jobs -----------------------------------------------------------------------
def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-").replace("--", "-")


def _nccl_outcome(log: str) -> str:
    for line in log.splitlines():
        if "Duplicate GPU" in line or "invalid usage" in line.lower():
            return line.strip()[-300:]
    if "sum 2.0" in log:
        return "NCCL accepted two ranks on one GPU (sum 2.0)"
    return "no NCCL message found: " + log.strip().splitlines()[-1][-300:] if log.strip() else ""


def _pytest_summary(log: str) -> str:
    """pytest's last line ("3 passed, 1 failed in 9.1s"), without horovodrun's prefix."""
    for line in reversed(log.splitlines()):
        found = re.search(r"\d+ (passed|failed|error|skipped|deselected).*", line)
        if found:
            return found.group(0).strip("= ")
    return ""


def _pytest_outcome(log: str) -> dict:
    """pytest's summary line, the number passed and the tests that failed (its -rf lines)."""
    summary = _pytest_summary(log)
    passed = re.search(r"(\d+) passed", summary)
    failed = sorted(set(re.findall(r"FAILED (\S+)", log)))
    return {"summary": summary, "passed": int(passed.group(1)) if passed else 0, "failed": failed}


def _contract_status(contract: dict, runs) -> tuple:
    failed, notes = [], []
    for label, entry in contract.items():
        if label.startswith("2 ranks, NCCL"):
            notes.append(f"{label}: {entry.get('outcome')}")
        elif entry["status"] != "ok" or entry["failed"] or not entry["passed"]:
            failed.append(label)
    missing = [label for label, *_ in runs if label not in contract]
    if missing:
        notes.append("not run (no Horovod build): " + ", ".join(missing))
    seconds = max((e.get("seconds", 0) for e in contract.values()), default=0)
    return ("failed" if failed or missing else "ok"), seconds, "; ".join(notes)


def _atomic_write(path, text) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# --- the markdown report ----------------------------------------------------------------------
def _ms(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"


def _pct(part, whole) -> str:
    return "-" if part is None or not whole else f"{100 * part / whole:.1f} %"


def _table(header: str, rows) -> list[str]:
    """A markdown table: `header` "a | b | c", `rows` lists of cells."""
    cells = header.split(" | ")
    lines = ["", f"| {header} |", "| " + " | ".join("---" for _ in cells) + " |"]
    return lines + ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]


def _code(title, text) -> list[str]:
    return ["", title, "", "```", text.strip(), "```"]


def render_markdown(report: dict) -> str:
    probe = report.get("probe") or {}
    cuda = bool(probe.get("cuda"))
    lines = ["# GPU check report", "",
             f"Size `{report.get('size')}` on {probe.get('gpu') or 'the CPU'}, started "
             f"{report.get('started_utc')} UTC, {report.get('seconds', 0):.0f} s; "
             f"`{report.get('command')}`."]  # fmt: skip
    if not cuda:
        lines += ["", "**CPU run, tiny models: these numbers say nothing about a GPU.** They "
                  "show the report's format and that every phase runs."]  # fmt: skip
    phases = [(p, e["status"], e.get("seconds", "-"), (e.get("note") or "").replace("\n", " "))
              for p, e in report["phases"].items()]  # fmt: skip
    lines += ["", "## Phases", *_table("phase | status | seconds | note", phases)]
    machine = ("nvidia_smi", "torch", "torch_cuda", "torch_nccl", "nvcc_version", "cmake_version",
               "gxx_version", "python", "pip", "cores", "mpirun", "horovod")  # fmt: skip
    lines += ["", "## Machine", ""] + [f"- {k}: {probe[k]}" for k in machine if k in probe]
    for section in (_builds, _contract, _timing, _e2e, _syncs):
        lines += section(report, cuda)
    return "\n".join(lines) + "\n"


def _builds(report, cuda):
    build = report.get("build") or {}
    variants = build.get("variants", {})
    rows = [[v, e["status"], e.get("seconds", "-"),
             *(e.get("built", {}).get(k, "-") for k in ("nccl", "gloo", "mpi", "cuda"))]
            for v, e in variants.items()]  # fmt: skip
    header = "build | status | seconds | NCCL | Gloo | MPI | CUDA"
    bundle = ", ".join(build.get("bundle", []))
    lines = ["", "## Horovod builds", "", f"Through scripts/bootstrap.sh, from the bundle: "
             f"{bundle}.", *_table(header, rows)] if build else []  # fmt: skip
    for variant, entry in variants.items():
        if entry["status"] != "ok":
            tail = (entry.get("log_tail") or entry.get("note") or "")[-1200:]
            lines += _code(f"{variant} build, end of its log:", tail)
    return lines


def _contract(report, cuda):
    contract = report.get("contract")
    if not contract:
        return []
    rows = [[label, e.get("device", "-"), e.get("ranks", "-"), e.get("passed", "-"),
             len(e["failed"]) if "failed" in e else e.get("outcome") or e["status"],
             e.get("seconds")] for label, e in contract.items()]  # fmt: skip
    lines = [
        "",
        "## The user contract (tests/parallel, gpu_check.CONTRACT)",
        *_table("run | device | ranks | passed | failed | seconds", rows),
    ]
    for label, entry in contract.items():
        lines += [f"- **{label}**: {name}" for name in entry.get("failed", [])]
        if "failed" in entry and entry["status"] != "ok":
            lines.append(f"- **{label}**: run {entry['status']}: {entry.get('summary')}")
    return lines


def _timing(report, cuda):
    timing = report.get("timing")
    if not timing:
        return []
    lines = ["", "## Local work against forward+backward (1 worker)", "",
             f"{timing.get('device')}, {timing.get('clock')}, median of {timing.get('iterations')} "
             f"after {timing.get('warmup')} warm-up; TF32: matmul {timing.get('matmul_tf32')}, "
             f"cuDNN {timing.get('cudnn_tf32')}. Local work: the compressor as "
             "DistributedOptimizer drives it (gpu_timing.py). Hook: torch's powerSGD_hook on a "
             "1-rank DDP, its cost over DDP's own all-reduce (default / batched)."]  # fmt: skip
    for name, model in (timing.get("models") or {}).items():
        fb, ddp, hooks = (model.get(k) or {} for k in ("forward_backward_ms", "ddp_ms", "hook"))
        rows = []
        for key, work in (model.get("local_work") or {}).items():
            hook = [hooks.get(f"rank {work['rank']}{b}", {}).get("overhead_ms", {})
                    for b in ("", ", batched")]  # fmt: skip
            rows.append([key + ("" if work.get("compressed_tensors") else " (none compressed)"),
                         _ms(work["ms"]), _pct(work["ms"], fb.get("fp32")),
                         _pct(work["ms"], fb.get("bf16")), _ms(work.get("with_statistics_ms")),
                         *(f"{_ms(hook[0].get(p))} / {_ms(hook[1].get(p))}"
                           if work["rounds"] == 2 else "" for p in ("fp32", "bf16"))])  # fmt: skip
        lines += ["", f"### {model.get('description', name)}", "",
                  f"forward+backward: fp32 {_ms(fb.get('fp32'))} ms, bf16 autocast "
                  f"{_ms(fb.get('bf16'))} ms; through DDP: fp32 {_ms(ddp.get('fp32'))} ms, bf16 "
                  f"{_ms(ddp.get('bf16'))} ms",
                  *_table("local work | ms | of fp32 step | of bf16 step | + statistics ms | "
                          "hook fp32 ms | hook bf16 ms", rows)]  # fmt: skip
        first = next(iter((model.get("local_work") or {}).values()), None)
        if first:
            phases = ", ".join(f"{k} {_ms(v)}" for k, v in first["phases_ms"].items())
            lines += ["", f"Rank {first['rank']}, rounds={first['rounds']}, by phase (ms; buckets "
                      f"{first['buckets']}, compressed {first['compressed_tensors']}): "
                      f"{phases}."]  # fmt: skip
        for key, graphed in (model.get("graphed") or {}).items():
            eager, graph = _ms(graphed.get("eager_ms")), _ms(graphed.get("graph_ms"))
            lines += ["", f"The local work at {key} as one CUDA graph (gpu_timing.py `_graphed`): "
                      f"eager {eager} ms, replayed {graph} ms."]  # fmt: skip
        lines += _verdict(model, cuda)
        for key, error in (model.get("errors") or {}).items():
            lines += _code(f"Error in {key}:", error[-800:])
    return lines


def _verdict(model, cuda):
    """The target at rank 4: local work under 5 % of the step, and no more than the hook."""
    work = (model.get("local_work") or {}).get("rank 4, rounds=2")
    hooks = model.get("hook") or {}
    hook = hooks.get("rank 4, batched") or hooks.get("rank 4") or {}
    fb = model.get("forward_backward_ms") or {}
    out = []
    for precision in ("fp32", "bf16") if work else ():
        step = fb.get(precision)
        if not step:
            continue
        hook_ms = hook.get("overhead_ms", {}).get(precision)
        ms = work["with_statistics_ms"]
        meets = ms / step < TARGET_SHARE and (hook_ms is None or ms <= hook_ms)
        word = "meets the target" if meets else "misses the target"
        word = word if cuda else "not judged (CPU)"
        out.append(f"{precision}: rank 4 local work with statistics {_pct(ms, step)} of "
                   f"forward+backward, hook {_ms(hook_ms)} ms: {word}")  # fmt: skip
    target = "Target (under 5 % of the step at rank 4, and no more than the hook): "
    return ["", target + "; ".join(out) + "."] if out else []


def _e2e(report, cuda):
    lines, e2e, profile = [], report.get("e2e"), report.get("profile")
    if e2e:
        rows = [[name, label, _ms(t.get("fp32")), _ms(t.get("bf16"))]
                for name, m in (e2e.get("models") or {}).items()
                for label, t in (m.get("step_ms") or {}).items()]  # fmt: skip
        rows += [[name, label, "error: " + error.strip().splitlines()[-1][:120], ""]
                 for name, m in (e2e.get("models") or {}).items()
                 for label, error in (m.get("errors") or {}).items()]  # fmt: skip
        lines += ["", f"## Whole steps through Horovod ({e2e.get('ranks')} rank, NCCL built: "
                  f"{e2e.get('nccl_built')})",
                  *_table("model | configuration | fp32 step ms | bf16 step ms", rows)]  # fmt: skip
    if profile:
        rows = []
        for name, model in (profile.get("models") or {}).items():
            got, error = model.get("profile") or {}, (model.get("error") or "").strip().splitlines()
            step, backward = got.get("step_s"), got.get("backward_s")
            rows.append([name, model.get("precision"), len(model.get("steps_ms") or []),
                         _ms(step and step * 1000.0), _ms(backward and backward * 1000.0),
                         len(got.get("buckets") or []),
                         error[-1][:120] if error else ""])  # fmt: skip
        lines += ["", f"## rank=\"auto\"'s profile on this device ({profile.get('ranks')} rank; "
                  "`python -m horovod_powersgd.bench.scale --profile`, docs/scale.md)",
                  *_table("model | precision | steps | step ms | backward ms | buckets | error",
                          rows)]  # fmt: skip
    return lines


def classify(entry: dict, drift_every: int) -> str:
    """Why a host read happens, from the steps where it did (statistics: every 10th step)."""
    later = [s for s in entry["steps"] if s > 1]
    if entry.get("cpu_only"):
        return "CPU fast path (a device test on its line: never on an accelerator)"
    if not later:
        return "first step: the ranks agree on their state (by design, once)"
    if all(s % 10 == 0 for s in later) and any(s % drift_every for s in later):
        return "statistics every 10 steps (by design)"
    if all(s % drift_every == 0 for s in later):
        return f"drift check every {drift_every} steps, and after the first (by design)"
    return "NOT BY DESIGN: in steady-state steps"


def _syncs(report, cuda):
    syncs = report.get("syncs")
    if not syncs:
        return []
    lines = ["", "## Host reads and syncs in training steps (gpu_syncs.py)"]
    probe = (syncs.get("probe") or {}).get("result")
    every = (probe or {}).get("drift_check_every", 20)
    for config in (probe or {}).get("configs", []):
        waits = ", ".join(map(str, sorted(set(config["collective_waits_per_step"].values()))))
        rows = [[source, f"`{e['site']}`", e["method"],
                 ", ".join(map(str, e["steps"][:6])) + (" ..." if len(e["steps"]) > 6 else ""),
                 e["count"], classify(e, every)]
                for source, key in (("counted", "counted"), ("sync debug", "cuda_sync_debug"))
                for e in config.get(key, [])]  # fmt: skip
        lines += ["", f"### {probe['model']} on {probe['device']}, rounds={config['rounds']}, "
                  f"{config['wire']} wire", "",
                  f"drift_check_every={every}, statistics every 10 steps. Sync debug mode "
                  f"\"error\" on step {config['error_mode_step']}: {config['error_mode']}. Host "
                  f"waits for collectives per step: {waits} (by design: Horovod returns a "
                  "collective's result to the host).",
                  *_table("source | site | call | steps | count | why", rows)]  # fmt: skip
    test = syncs.get("test")
    if test:
        lines += ["", f"tests/parallel/test_host_syncs.py on this machine: {test.get('summary')} "
                  f"({test['status']})."]  # fmt: skip
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("probe", help="what this machine has, as JSON").add_argument("--json")
    add = parser.add_argument
    add("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "build", "gpu-check"))
    add(
        "--work",
        default=os.path.join(ROOT, "build", "gpu-work"),
        help="build environments, partial results (not sent back)",
    )
    add(
        "--size",
        default="auto",
        choices=["auto", "full", "tiny"],
        help="full where CUDA is, tiny on the CPU (default auto)",
    )
    add("--bundle", default=os.path.join(ROOT, "build", "gpu-bundle"))
    add(
        "--build",
        default="auto",
        choices=["auto", "yes", "no"],
        help="build Horovod from the bundle (auto: where CUDA is)",
    )
    add(
        "--build-variants",
        default="",
        help="builds to make, of nccl,gloo,cpu (default: nccl,gloo with CUDA, else cpu); "
        "nccl,gloo without a GPU rehearses the device's builds",
    )
    add("--cuda-arch", default="90", help="CUDA architecture without a GPU to ask (90: H100/H200)")
    add(
        "--build-seconds",
        type=float,
        default=0,
        help="the build phase's limit (0: the size's; a rehearsal on 2 cores needs far more)",
    )
    add("--budget", type=float, default=0, help="seconds in all (0: the size's)")
    add("--phases", default=",".join(PHASES), help="the phases to run")
    add("--fail", default="", help="phases made to fail (tests the report)")
    add("--stall", default="", help="phases made to hang (tests the limits)")
    args = parser.parse_args(argv)  # fmt: skip
    if args.command == "probe":
        _atomic_write(args.json, json.dumps(probe(), indent=1))
        return 0
    return Kit(args).run()


if __name__ == "__main__":
    sys.exit(main())
