"""The GPU check: one command that uses one device lease, and its CPU rehearsal.

    python3 scripts/gpu/gpu_check.py                     # the device: full sizes, builds Horovod
    .venv/bin/python scripts/gpu/gpu_check.py --size tiny  # here: tiny models, installed Horovod

docs/gpu.md has the device call and what each phase measures. Each phase runs in
subprocesses with a time limit of its own: one that fails or runs out of time is reported
as such, and the others still report.

  probe     what the machine has: GPU, driver, torch, CUDA, NCCL, nvcc, cmake, MPI, cores
  build     (CUDA only) Horovod from the carried bundle through scripts/bootstrap.sh, twice at
            once: with NCCL for 1 rank, without GPU operations (Gloo; MPI) for 2 ranks
            sharing the GPU, whose tensors then travel through the host (NCCL refuses that)
  timing    gpu_timing.py local (needs no Horovod)
  contract  tests/parallel's user contract (CONTRACT) under horovodrun, `--device cuda` on a GPU
  syncs     gpu_timing.py syncs under horovodrun, and on CUDA tests/parallel/test_host_syncs.py
  e2e       gpu_timing.py e2e under horovodrun, then its profile

Everything lands in --out (the device's $OUT): report.json, report.md and one log per
phase, eight files at most (what the device sends back). The report is rewritten after
every phase, so a run stopped from outside keeps what was done.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = os.path.join(ROOT, "scripts", "gpu")
BUNDLE = os.path.join(ROOT, "build", "gpu-bundle")  # `make gpu-bundle`; the device carries it
PHASES = ("probe", "build", "timing", "contract", "syncs", "e2e")
# Seconds per phase (full: the device, within its 8 minutes; tiny: this CPU, where a
# rehearsal of the builds on 2 cores takes 10 minutes). Contract and syncs run side by side.
BUDGETS = {
    "full": dict(total=470, probe=45, build=270, timing=270, contract=90, syncs=90, e2e=70),
    "tiny": dict(total=480, probe=60, build=900, timing=180, contract=240, syncs=240, e2e=90),
}
PROFILE_S = 90  # auto's profile, after the whole steps (in the e2e phase)
RESERVE_S = 8  # kept back at the end for the report
LOG_LIMIT = 4 * 2**20  # the end of each log that goes back (the device takes 16 MB a file)
CUDA_ARCH = "90"  # kernels for H100/H200 where no GPU can be asked (a rehearsal)
TARGET_SHARE = 0.05  # local work under 5 % of the step at rank 4, and <= the hook's
# What users rely on, from tests/parallel: full rank equals Horovod's average, bitwise
# identical parameters, exact resume, non-finite gradients leave the state finite, fp16 on
# the wire keeps the scale, the AMP GradScaler pattern (both schedules where they have two).
CONTRACT = [
    "tests/parallel/test_rounds.py",
    "tests/parallel/test_user_patterns.py",
    "tests/parallel/test_optimizer.py",
    "tests/parallel/test_graphs.py",  # on CUDA: real CUDA graphs against the eager step
    "-k",
    "full_rank_equals_plain_horovod_average_on_every_step or bitwise or resumes_exactly"
    " or non_finite or fp16_on_the_wire or grad_scaler or graphed",
]
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf"]
BUILT = (
    "import json, horovod, horovod.torch as hvd; print(json.dumps({'horovod': horovod.__version__,"
    " **{k: bool(getattr(hvd, k + '_built')()) for k in ('nccl', 'gloo', 'mpi', 'cuda')}}))"
)
NCCL_TWO_RANKS = (
    "import torch, horovod.torch as hvd; hvd.init(); torch.cuda.set_device(0); "
    "print('sum', hvd.allreduce(torch.ones(1, device='cuda'), op=hvd.Sum).item())"
)


class Job:
    """One subprocess with a log file, a time limit and, once it has ended, a `result`."""

    def __init__(self, name, cmd, log, env, limit=math.inf, **attributes):
        self.name, self.log, self.limit, self.result = name, log, limit, None
        self.__dict__.update(attributes)
        self.started = time.monotonic()
        with open(log, "w") as f:
            f.write(f"$ {' '.join(cmd)}\n")
        try:
            with open(log, "a") as f:
                # Its own process group: a timeout kills its children too.
                self.proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=f, stderr=f, start_new_session=True
                )
        except OSError as exc:  # e.g. no horovodrun where a build is missing: a failure
            with open(log, "a") as f:
                f.write(f"could not start: {exc}\n")
            self._finish("failed", None)

    def poll(self, deadline: float) -> bool:
        """Whether it has ended; killed once past `deadline` or its own limit."""
        if self.result is None and self.proc.poll() is not None:
            self._finish("ok" if self.proc.returncode == 0 else "failed", self.proc.returncode)
        elif self.result is None and time.monotonic() >= min(deadline, self.limit):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self._finish("timeout", self.proc.wait())
        return self.result is not None

    def _finish(self, status: str, rc) -> None:
        seconds = round(time.monotonic() - self.started, 1)
        tail = _tail(self.log, 1500) if status != "ok" else ""
        self.result = {"status": status, "rc": rc, "seconds": seconds, "log_tail": tail}


def wait_all(jobs, deadline: float) -> list[Job]:
    """Wait for `jobs` at once (polling each in every round: their times are their own)."""
    while not all([job.poll(deadline) for job in jobs]):
        time.sleep(0.2)
    return jobs


def _tail(path, chars):
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - chars))
        return f.read()
    return ""


def _read_json(path):
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        return json.load(f)
    return None


def _atomic_write(path, text) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


# --- probe ----------------------------------------------------------------------------------
def _run(cmd) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return (out.stdout + out.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({exc.__class__.__name__})"


def _find_cuda():
    """(nvcc, CUDA home): the toolkit whose nvcc is on PATH, else /usr/local/cuda*; the
    first holding both bin/nvcc and include/cuda_runtime.h, since the nvcc on PATH may be
    a wrapper elsewhere (seen here: /usr/local/bin/nvcc running /usr/local/cuda-13.0's)."""
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
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ImportError:  # no "nvidia" packages at all
        spec = None
    roots = list(spec.submodule_search_locations) if spec else []
    for root in [*roots, "/usr", "/usr/local", "/usr/local/cuda"]:
        headers = glob.glob(os.path.join(root, "include", "nccl.h"))
        dirs = ("lib", "lib/x86_64-linux-gnu", "lib64")
        libraries = sorted(f for d in dirs for f in glob.glob(os.path.join(root, d, "libnccl.so*")))
        if headers and libraries:
            return os.path.dirname(headers[0]), libraries[0]
    return None, None


def probe() -> dict:
    """What this machine has (run in a subprocess of the kit's python)."""
    import torch

    info = {
        "python": platform.python_version(),
        "in_venv": sys.prefix != sys.base_prefix,
        "purelib": sysconfig.get_paths()["purelib"],
        "include": sysconfig.get_paths()["include"],
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda": torch.cuda.is_available(),
        "system_site_packages": True,
    }
    if info["in_venv"]:
        with open(os.path.join(sys.prefix, "pyvenv.cfg")) as f:
            info["system_site_packages"] = "include-system-site-packages = true" in f.read().lower()
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["capability"] = f"{props.major}{props.minor}"
        info["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        query = "--query-gpu=name,driver_version,memory.total"
        info["nvidia_smi"] = _run(["nvidia-smi", query, "--format=csv,noheader"])
    info["nvcc"], info["cuda_home"] = _find_cuda()
    if info["nvcc"]:
        info["nvcc_version"] = _run([info["nvcc"], "--version"]).splitlines()[-1]
    info["nccl_include"], info["nccl_library"] = _find_nccl()
    for tool in ("cmake", "make", "ninja", "g++", "mpirun", "mpicc"):
        info[tool] = shutil.which(tool)
    for tool, key in (("cmake", "cmake_version"), ("g++", "gxx_version")):
        if info[tool]:
            info[key] = _run([tool, "--version"]).splitlines()[0]
    try:
        import horovod

        info["horovod"] = horovod.__version__
    except ImportError:
        info["horovod"] = None
    return info


class Kit:
    """The phases of one run, their jobs and budgets, and the report they rewrite."""

    def __init__(self, args):
        self.args = args
        self.out, self.work = os.path.abspath(args.out), os.path.abspath(args.work)
        os.makedirs(self.out, exist_ok=True)
        os.makedirs(self.work, exist_ok=True)
        self.started = time.monotonic()
        self.set_size("tiny" if args.size == "auto" else args.size)  # until the probe says
        utc = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        run = {"command": " ".join(sys.argv), "started_utc": utc, "size": args.size}
        self.report = {**run, "phases": {}, "probe": {}}
        self.logs: dict[str, list[str]] = {}  # phase -> job logs, gathered into one file
        self.venvs: dict[str, str] = {}  # Horovod build -> its virtual environment

    # --- plumbing -------------------------------------------------------------------------
    def set_size(self, size: str) -> None:
        self.size, self.budgets = size, dict(BUDGETS[size], profile=PROFILE_S)
        self.budgets["total"] = self.args.budget or self.budgets["total"]
        self.deadline = self.started + self.budgets["total"] - RESERVE_S

    def budget(self, phase: str) -> float:
        """The deadline for a phase: its own budget, cut to what the whole run has left."""
        return min(time.monotonic() + self.budgets[phase], self.deadline)

    def env(self, **extra) -> dict:
        # Unless set: OMP_NUM_THREADS=1 (ranks share the cores), OpenMPI allowed as root.
        root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        env = {"OMP_NUM_THREADS": "1", **root, **os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        nccl = self.report["probe"].get("nccl_library")
        if nccl:  # Horovod's library links libnccl.so.2 of torch's wheel
            env["LD_LIBRARY_PATH"] = f"{os.path.dirname(nccl)}:{env.get('LD_LIBRARY_PATH', '')}"
        return {**env, **extra}

    def job(self, phase, name, cmd, env=None, **attributes) -> Job:
        """A job of `phase`: `cmd`, unless --fail or --stall says otherwise (the kit's tests)."""
        if phase in self.args.fail.split(","):
            cmd = [sys.executable, "-c", f"raise SystemExit('{phase}: failure injected by --fail')"]
        elif phase in self.args.stall.split(","):
            cmd = [sys.executable, "-c", "import time; time.sleep(3600)"]
        log = os.path.join(self.work, f"{phase}-{name}.log")
        self.logs.setdefault(phase, []).append(log)
        return Job(f"{phase}/{name}", cmd, log, env or self.env(), **attributes)

    def measure(self, phase, name, command, build=None, ranks=None, env=None) -> Job:
        """gpu_timing.py's `command` as a job, its JSON at the job's `path`: with `ranks` under
        horovodrun, else by the build's python (or this one)."""
        path = os.path.join(self.work, f"{phase}-{name}.json")
        cmd = [os.path.join(KIT, "gpu_timing.py"), command, "--json", path, "--size", self.size]
        cmd = self.horovodrun(build, ranks, *cmd) if ranks else [self.python(build), *cmd]
        return self.job(phase, name, cmd, env, path=path)

    def python(self, build) -> str:
        venv = self.venvs.get(build)
        return os.path.join(venv, "bin", "python") if venv else sys.executable

    def horovodrun(self, build, np, *cmd, mpi=False) -> list[str]:
        """horovodrun of `cmd` under a Horovod build's python, or this environment's."""
        python = self.python(build)
        horovodrun = os.path.join(os.path.dirname(python), "horovodrun")
        hosts = ["-np", str(np), "-H", f"localhost:{np}", "--mpi" if mpi else "--gloo"]
        return [horovodrun, *hosts, python, *cmd]

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
            parts = {
                log: f"===== {os.path.basename(log)} =====\n{_tail(log, LOG_LIMIT // len(logs))}\n"
                for log in logs
            }
            if phase != "build":
                parts = {f"{phase}.log": "".join(parts.values())}
            for log, part in parts.items():
                _atomic_write(os.path.join(self.out, os.path.basename(log)), part)
        _atomic_write(os.path.join(self.out, "report.json"), json.dumps(self.report, indent=1))
        _atomic_write(os.path.join(self.out, "report.md"), "\n".join(Report(self.report)) + "\n")

    def wanted(self, phase) -> bool:
        if phase in self.args.phases.split(","):
            return True
        self.set_phase(phase, "skipped", note="not in --phases")
        return False

    def guarded(self, phases, step, *args) -> None:
        """`step(*args)`; should the kit itself fail there, its phases say so and the run
        goes on (one phase must not cost the others' report)."""
        try:
            step(*args)
        except Exception:  # the kit's own bug: reported, never the end of the run
            error = traceback.format_exc()[-2000:]
            for phase in phases:
                self.set_phase(phase, "failed", note="the kit failed here: see log", log=error)

    # --- phases ---------------------------------------------------------------------------
    def run(self) -> int:
        self.write()
        self.guarded(["probe"], self.phase_probe)
        cuda = bool(self.report["probe"].get("cuda"))
        if self.args.size == "auto":
            self.set_size("full" if cuda else "tiny")
            self.report["size"] = self.size
        if self.wanted("build"):
            self.guarded(["build"], self.phase_build, cuda)
        # Timed after the builds, alone on the machine (it needs no Horovod).
        if self.wanted("timing"):
            self.guarded(["timing"], self.phase_timing)
        self.guarded(["contract", "syncs"], self.phase_contract_and_syncs, cuda)
        if self.wanted("e2e"):
            self.guarded(["e2e"], self.phase_e2e, cuda)
        self.write()
        statuses = [e["status"] for e in self.report["phases"].values()]
        return 1 if any(s not in ("ok", "skipped") for s in statuses) else 0

    def phase_probe(self):
        path = os.path.join(self.work, "probe.json")
        job = self.job("probe", "probe", [sys.executable, __file__, "probe", path])
        result = wait_all([job], self.budget("probe"))[0].result
        self.logs.pop("probe")  # its output is in the report
        self.report["probe"] = _read_json(path) or {}
        self.set_phase("probe", result["status"], result["seconds"], result["log_tail"][-500:])

    def phase_build(self, cuda: bool) -> None:
        if self.args.build == "no" or (self.args.build == "auto" and not cuda):
            note = "--build no" if cuda else "no CUDA: the Horovod already installed here is used"
            return self.set_phase("build", "skipped", note=note)
        if not glob.glob(os.path.join(BUNDLE, "horovod-*.tar.gz")):
            note = f"no Horovod sdist in {BUNDLE}: run `make gpu-bundle` and carry it (docs/gpu.md)"
            return self.set_phase("build", "failed", note=note)
        variants = {}
        self.report["build"] = {"bundle": sorted(os.listdir(BUNDLE)), "variants": variants}
        jobs = []
        # nccl,gloo without a GPU: a rehearsal of the device's builds.
        for variant in (self.args.build_variants or ("nccl,gloo" if cuda else "cpu")).split(","):
            try:
                venv = make_venv(self.work, variant, self.report["probe"])
                env = build_env(self, variant, self.report["probe"], venv)
            except (OSError, RuntimeError) as exc:
                variants[variant] = {"status": "failed", "note": f"preparing it: {exc}"}
                continue
            # cffi from the bundle (Horovod's setup.py asks for it; the image lacks it), then
            # bootstrap.sh, then what the build holds: the log's last line.
            python = os.path.join(venv, "bin", "python")
            steps = [
                f'"{python}" -m pip install -q cffi pycparser',
                "nice -n 19 bash scripts/bootstrap.sh",
                f'"{python}" -c "$0"',
            ]
            cmd = ["bash", "-c", " && ".join(steps), BUILT]
            jobs.append(self.job("build", variant, cmd, env, venv=venv, variant=variant))
        self.write()
        for job in wait_all(jobs, self.budget("build")):
            entry = variants[job.variant] = {**job.result, "venv": os.path.relpath(job.venv, ROOT)}
            if job.result["status"] == "ok":
                entry["built"] = json.loads(_tail(job.log, 1000).strip().splitlines()[-1])
                self.venvs[job.variant] = job.venv
        ok = variants and all(v["status"] == "ok" for v in variants.values())
        seconds = max((v.get("seconds", 0) for v in variants.values()), default=0)
        note = ", ".join(f"{k}: {v['status']}" for k, v in variants.items())
        self.set_phase("build", "ok" if ok else "failed", seconds, note=note)

    def phase_timing(self) -> None:
        # Not OMP_NUM_THREADS=1 here: this process is alone on its device.
        env = self.env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))
        job = self.measure("timing", "local", "local", build="nccl", env=env)
        result = wait_all([job], self.budget("timing"))[0].result
        self.report["timing"] = _read_json(job.path)
        self.set_phase("timing", result["status"], result["seconds"], log=result["log_tail"])

    def phase_contract_and_syncs(self, cuda: bool) -> None:
        contract, syncs = self.wanted("contract"), self.wanted("syncs")
        one, two = self.builds_for_runs(cuda)
        device = "cuda" if cuda else "cpu"
        runs = [("1 rank", one, 1, False), ("2 ranks, Gloo", two, 2, False)] if contract else []
        if contract and self.report["probe"].get("mpirun") and self._built(two, "mpi"):
            runs.append(("2 ranks, MPI", two, 2, True))
        jobs = []
        for label, build, np, mpi in runs:
            if not cuda or build in self.venvs:
                cmd = self.horovodrun(build, np, *PYTEST, *CONTRACT, "--device", device, mpi=mpi)
                name = f"{np}-ranks-{'mpi' if mpi else 'gloo'}"
                jobs.append(self.job("contract", name, cmd, label=label, ranks=np))
        if contract and cuda and "nccl" in self.venvs:
            # What NCCL says to two ranks on one GPU (expected: it refuses; a refusal may
            # hang, so within a time of its own).
            cmd = self.horovodrun("nccl", 2, "-c", NCCL_TWO_RANKS)
            limit, label = time.monotonic() + 45, "2 ranks, NCCL on one GPU"
            jobs.append(self.job("contract", "nccl-2-ranks", cmd, limit=limit, label=label))
        if syncs and cuda and one not in self.venvs:
            self.set_phase("syncs", "failed", note="no Horovod build with NCCL to run on")
        elif syncs:
            jobs.append(self.measure("syncs", "probe", "syncs", build=one, ranks=1))
            if cuda:  # its CUDA cases (the CPU ones ran where the kit was made)
                test = [*PYTEST, "tests/parallel/test_host_syncs.py", "-k", "cuda or catches"]
                jobs.append(self.job("syncs", "test", self.horovodrun(one, 1, *test)))
        self.report.setdefault("contract", {})
        self.report.setdefault("syncs", {})
        for job in wait_all(jobs, min(self.budget("contract"), self.budget("syncs"))):
            phase, name = job.name.split("/")
            entry, log = dict(job.result), _tail(job.log, 20000)
            if name == "nccl-2-ranks":
                entry["outcome"] = _nccl_outcome(log)
            elif phase == "contract":
                entry.update(_pytest_outcome(log), ranks=job.ranks, device=device)
            elif name == "probe":
                entry["result"] = _read_json(job.path)
            else:
                entry.update(_pytest_outcome(log))
            self.report[phase][getattr(job, "label", name)] = entry
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
        return one, next((b for b in ("gloo", "cpu") if b in self.venvs), None)

    def _built(self, build, feature) -> bool:
        if build in self.venvs:
            return bool(self.report["build"]["variants"][build]["built"].get(feature))
        code = f"import horovod.torch as hvd, sys; sys.exit(not hvd.{feature}_built())"
        return subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0

    def phase_e2e(self, cuda: bool) -> None:
        build = self.builds_for_runs(cuda)[0]
        if cuda and build not in self.venvs:
            return self.set_phase("e2e", "failed", note="no Horovod build with NCCL to run on")
        # Whole steps, then rank="auto"'s profile of each model (docs/scale.md): in the e2e
        # phase's report and log, its status only a note (the phase's verdict is the steps').
        steps = self.measure("e2e", "steps", "e2e", build=build, ranks=1)
        steps = wait_all([steps], self.budget("e2e"))[0]
        self.report["e2e"] = _read_json(steps.path)
        result = steps.result
        self.set_phase("e2e", result["status"], result["seconds"], log=result["log_tail"])
        profile = self.measure("e2e", "profile", "profile", build=build, ranks=1)
        profile = wait_all([profile], self.budget("profile"))[0]
        self.report["profile"] = _read_json(profile.path)
        note = f"profile: {profile.result['status']} in {profile.result['seconds']:.1f} s"
        self.set_phase("e2e", result["status"], result["seconds"], note, log=result["log_tail"])


# --- building Horovod -----------------------------------------------------------------------
def make_venv(work, variant, info) -> str:
    """A virtual environment that sees the machine's torch, for one Horovod build: what
    `python -m venv --without-pip` makes, written by hand (Debian's python may come without
    its venv module). bootstrap.sh installs Horovod into it; the image's own environment,
    with the device's torch, stays untouched: a .pth file adds its site-packages (and runs
    its .pth files) behind this environment's own."""
    venv = os.path.join(work, f"venv-{variant}")
    base = getattr(sys, "_base_executable", sys.executable)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = os.path.join(venv, "lib", version, "site-packages")
    os.makedirs(os.path.join(venv, "bin"), exist_ok=True)
    os.makedirs(site, exist_ok=True)
    for name in ("python", "python3", version):
        if not os.path.lexists(os.path.join(venv, "bin", name)):
            os.symlink(base, os.path.join(venv, "bin", name))
    system = str(bool(info.get("system_site_packages"))).lower()
    config = f"home = {os.path.dirname(base)}\ninclude-system-site-packages = {system}\n"
    config += f"version = {platform.python_version()}\n"
    _atomic_write(os.path.join(venv, "pyvenv.cfg"), config)
    if info.get("in_venv"):
        pth = f"import site; site.addsitedir({info['purelib']!r})\n"
        _atomic_write(os.path.join(site, "_gpu_check_base.pth"), pth)
    # bootstrap.sh installs the project itself unless this stamp is newer than
    # setup.py: here the project comes from PYTHONPATH, and nothing can be fetched.
    _atomic_write(os.path.join(venv, ".project-installed"), "")
    return venv


def build_env(kit, variant, info, venv) -> dict:
    """The environment of one Horovod build through bootstrap.sh, offline, from the bundle."""
    env = kit.env(
        SKIP_APT="1",
        VENV=os.path.relpath(venv, ROOT),  # bootstrap.sh takes it relative to the root
        TORCH_VERSION=info["torch"].split("+")[0],
        WHEEL_CACHE=os.path.join(kit.work, "wheels"),
        PIP_NO_INDEX="1",  # nothing can be fetched there: the bundle is the index
        PIP_FIND_LINKS=BUNDLE,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        MAKEFLAGS=f"-j{info.get('cores') or os.cpu_count()}",
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
    if not info.get("cuda_home"):
        raise RuntimeError("no CUDA toolkit found (nvcc on PATH, /usr/local/cuda*)")
    env.update(
        HOROVOD_CUDA_HOME=info["cuda_home"],
        CUDA_HOME=info["cuda_home"],
        # Kernels for this GPU only: nvcc 13 knows a dozen architectures, all compiled twice.
        HOROVOD_BUILD_CUDA_CC_LIST=info.get("capability") or CUDA_ARCH,
    )
    if variant == "nccl":
        if not info.get("nccl_include"):
            raise RuntimeError("no NCCL headers found (torch's nvidia-nccl wheel, /usr)")
        # Horovod's FindNCCL looks for libnccl.so; the wheel has libnccl.so.2 only.
        shim = os.path.join(kit.work, "nccl-lib")
        os.makedirs(shim, exist_ok=True)
        if not os.path.lexists(os.path.join(shim, "libnccl.so")):
            os.symlink(info["nccl_library"], os.path.join(shim, "libnccl.so"))
        env.update(
            HOROVOD_NCCL_INCLUDE=info["nccl_include"],
            HOROVOD_NCCL_LIB=shim,
            HOROVOD_NCCL_LINK="SHARED",
            PATH=os.path.dirname(info["nvcc"]) + os.pathsep + env["PATH"],
        )
    else:
        # bootstrap.sh builds with NCCL wherever `nvcc` is on PATH: hide it, so this one
        # gets no GPU operations (CMake still finds CUDA through HOROVOD_CUDA_HOME).
        env["PATH"] = _path_without(env["PATH"], "nvcc", os.path.join(kit.work, "path"))
    return env


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
def _nccl_outcome(log: str) -> str:
    for line in log.splitlines():
        if "Duplicate GPU" in line or "invalid usage" in line.lower():
            return line.strip()[-300:]
    if "sum 2.0" in log:
        return "NCCL accepted two ranks on one GPU (sum 2.0)"
    return "no NCCL message found: " + log.strip().splitlines()[-1][-300:] if log.strip() else ""


def _pytest_outcome(log: str) -> dict:
    """pytest's summary line ("3 passed, 1 failed in 9.1s", without horovodrun's prefix),
    the number passed and the tests that failed (its -rf lines)."""
    summaries = re.findall(r"\d+ (?:passed|failed|error|skipped|deselected).*", log)
    summary = summaries[-1].strip("= ") if summaries else ""
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


# --- the markdown report ----------------------------------------------------------------------
def _ms(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"


def _pct(part, whole) -> str:
    return "-" if part is None or not whole else f"{100 * part / whole:.1f} %"


def _verdict(model, cuda) -> list[str]:
    """The target at rank 4: local work under 5 % of the step, and no more than the hook,
    judged on the orthogonalisation a GPU uses by default (CholeskyQR: its rows' keys end
    in ", cholesky"; a report without them, from before, on Householder's)."""
    local = model.get("local_work") or {}
    work = local.get("rank 4, rounds=2, cholesky") or local.get("rank 4, rounds=2")
    hooks = model.get("hook") or {}
    hook = hooks.get("rank 4, batched") or hooks.get("rank 4") or {}
    out = []
    for precision, step in (model.get("forward_backward_ms") or {}).items() if work else ():
        hook_ms, ms = hook.get("overhead_ms", {}).get(precision), work["with_statistics_ms"]
        meets = ms / step < TARGET_SHARE and (hook_ms is None or ms <= hook_ms)
        word = ("meets" if meets else "misses") + " the target" if cuda else "not judged (CPU)"
        share = f"rank 4 local work with statistics {_pct(ms, step)} of forward+backward"
        out.append(f"{precision}: {share}, hook {_ms(hook_ms)} ms: {word}")
    target = "Target (under 5 % of the step at rank 4, and no more than the hook): "
    return ["", target + "; ".join(out) + "."] if out else []


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


class Report(list):
    """report.md's lines, a block at a time, each after a blank line: the phases, the
    machine, then a part per key of report.json, each rendered by the method of its name."""

    SECTIONS = ("build", "contract", "timing", "e2e", "profile", "syncs")
    MACHINE = (
        "nvidia_smi torch torch_cuda torch_nccl nvcc_version cmake_version gxx_version python "
        "cores mpirun horovod"
    )
    LOCAL_WORK = (
        "local work | ms | of fp32 step | of bf16 step | + statistics ms | hook fp32 ms | "
        "hook bf16 ms"
    )

    def __init__(self, report: dict):
        super().__init__(["# GPU check report"])
        probe = report.get("probe") or {}
        self.cuda = bool(probe.get("cuda"))
        self.text(
            f"Size `{report['size']}` on {probe.get('gpu') or 'the CPU'}, started ",
            f"{report['started_utc']} UTC, {report.get('seconds', 0):.0f} s; ",
            f"`{report['command']}`.",
        )
        if not self.cuda:
            self.text(
                "**CPU run, tiny models: these numbers say nothing about a GPU.** They show the ",
                "report's format and that every phase runs.",
            )
        self.text("## Phases")
        phases = report["phases"].items()
        rows = [
            (p, e["status"], e.get("seconds", "-"), e["note"].replace("\n", " ")) for p, e in phases
        ]
        self.table("phase | status | seconds | note", rows)
        self.text("## Machine")
        self += [""] + [f"- {k}: {probe[k]}" for k in self.MACHINE.split() if k in probe]
        for key in self.SECTIONS:  # each with what its phase reported, if anything
            if report.get(key):
                getattr(self, key)(report[key])

    def text(self, *parts: str) -> None:
        self += ["", "".join(parts)]

    def table(self, header: str, rows) -> None:
        """`header` "a | b | c", `rows` lists of cells."""
        self += ["", f"| {header} |", "|" + " --- |" * len(header.split(" | "))]
        self += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]

    def code(self, title: str, text: str) -> None:
        self += ["", title, "", "```", text.strip(), "```"]

    @staticmethod
    def last_line(text) -> str:
        return text.strip().splitlines()[-1][:120] if text and text.strip() else ""

    def build(self, build):
        """The Horovod builds, with the machine: what each holds, a failed one's end of log."""
        self.append(f"- Horovod builds by scripts/bootstrap.sh, from {', '.join(build['bundle'])}:")
        for variant, e in build["variants"].items():
            built = ", ".join(f"{k} {v}" for k, v in e.get("built", {}).items()) or "-"
            self.append(f"  - {variant}: {e['status']}, {e.get('seconds', '-')} s; built: {built}")
            if e["status"] != "ok":
                tail = (e.get("log_tail") or e.get("note"))[-1200:]
                self.code(f"{variant} build, end of its log:", tail)

    def contract(self, contract):
        self.text("## The user contract (tests/parallel, gpu_check.CONTRACT)")
        rows = []
        for label, e in contract.items():
            failed = len(e["failed"]) if "failed" in e else e.get("outcome") or e["status"]
            device, ranks, passed = (e.get(k, "-") for k in ("device", "ranks", "passed"))
            rows.append([label, device, ranks, passed, failed, e["seconds"]])
        self.table("run | device | ranks | passed | failed | seconds", rows)
        for label, e in contract.items():
            self += [f"- **{label}**: {name}" for name in e.get("failed", [])]
            if "failed" in e and e["status"] != "ok":
                self.append(f"- **{label}**: run {e['status']}: {e.get('summary')}")

    def timing(self, timing):
        self.text("## Local work against forward+backward (1 worker)")
        self.text(
            f"{timing['device']}, {timing['clock']}, median of {timing['iterations']} after ",
            f"{timing['warmup']} warm-up; TF32: matmul {timing['matmul_tf32']}, cuDNN ",
            f"{timing['cudnn_tf32']}. Local work: the compressor as DistributedOptimizer drives ",
            "it. Hook: what torch's powerSGD_hook adds to a 1-rank DDP step (default / batched).",
        )
        for name, model in timing["models"].items():
            fb, ddp, hooks = (model.get(k) or {} for k in ("forward_backward_ms", "ddp_ms", "hook"))
            self.text(f"### {model.get('description', name)}")
            self.text(
                f"forward+backward: fp32 {_ms(fb.get('fp32'))} ms, bf16 autocast ",
                f"{_ms(fb.get('bf16'))} ms; through DDP: fp32 {_ms(ddp.get('fp32'))} ms, bf16 ",
                f"{_ms(ddp.get('bf16'))} ms",
            )
            rows = []
            for key, work in model["local_work"].items():
                ms, none = work["ms"], "" if work["compressed_tensors"] else " (none compressed)"
                rank = f"rank {work['rank']}"
                of = [hooks.get(rank + b, {}).get("overhead_ms", {}) for b in ("", ", batched")]
                hook = [f"{_ms(of[0].get(p))} / {_ms(of[1].get(p))}" for p in ("fp32", "bf16")]
                shares = [_pct(ms, fb.get("fp32")), _pct(ms, fb.get("bf16"))]
                hook = hook if work["rounds"] == 2 else ["", ""]
                rows.append([key + none, _ms(ms), *shares, _ms(work["with_statistics_ms"]), *hook])
            self.table(self.LOCAL_WORK, rows)
            first = next(iter(model["local_work"].values()), None)
            if first:
                phases = ", ".join(f"{k} {_ms(v)}" for k, v in first["phases_ms"].items())
                self.text(
                    f"Rank {first['rank']}, rounds={first['rounds']}, by phase (ms; buckets ",
                    f"{first['buckets']}, compressed {first['compressed_tensors']}): {phases}.",
                )
            for key, graphed in (model.get("graphed") or {}).items():
                eager, graph = _ms(graphed["eager_ms"]), _ms(graphed["graph_ms"])
                times = f"eager {eager} ms, replayed {graph} ms"
                self.text(f"The local work at {key} as one CUDA graph: {times}.")
            self += _verdict(model, self.cuda)
            for key, error in model["errors"].items():
                self.code(f"Error in {key}:", error[-800:])

    def e2e(self, e2e):
        ranks, nccl = e2e["ranks"], e2e["nccl_built"]
        self.text(f"## Whole steps through Horovod ({ranks} rank, NCCL built: {nccl})")
        rows = []
        for name, m in e2e["models"].items():
            rows += [[name, k, _ms(t["fp32"]), _ms(t["bf16"])] for k, t in m["step_ms"].items()]
            rows += [[name, k, "error: " + self.last_line(e), ""] for k, e in m["errors"].items()]
        self.table("model | configuration | fp32 step ms | bf16 step ms", rows)

    def profile(self, profile):
        self.text(
            f'## rank="auto"\'s profile on this device ({profile["ranks"]} rank; ',
            "`python -m horovod_powersgd.bench.scale --profile`, docs/scale.md)",
        )
        rows = []
        for name, model in profile["models"].items():
            got = model.get("profile") or {}
            times = [_ms(got[k] * 1000.0) if got.get(k) else "-" for k in ("step_s", "backward_s")]
            steps, buckets = len(model.get("steps_ms") or []), len(got.get("buckets") or [])
            error = self.last_line(model.get("error"))
            rows.append([name, model["precision"], steps, *times, buckets, error])
        self.table("model | precision | steps | step ms | backward ms | buckets | error", rows)

    def syncs(self, syncs):
        self.text("## Host reads and syncs in training steps (gpu_timing.py syncs)")
        probe = (syncs.get("probe") or {}).get("result") or {}
        every = probe.get("drift_check_every", 20)
        for config in probe.get("configs", []):
            waits = ", ".join(map(str, sorted(set(config["collective_waits_per_step"].values()))))
            where = f"{probe['model']} on {probe['device']}"
            graphs = ", cuda_graphs=True" if config.get("graphs") else ""
            self.text(f"### {where}, rounds={config['rounds']}, {config['wire']} wire{graphs}")
            self.text(
                f'drift_check_every={every}, statistics every 10 steps. Sync debug mode "error" ',
                f"on step {config['error_mode_step']}: {config['error_mode']}. Host waits for ",
                f"collectives per step: {waits} (by design: Horovod returns a collective's result ",
                "to the host; on 1 rank none, as a set of one rank makes no request).",
            )
            rows = []
            for source, key in (("counted", "counted"), ("sync debug", "cuda_sync_debug")):
                for e in config[key]:
                    steps = ", ".join(map(str, e["steps"][:6])) + " ..." * (len(e["steps"]) > 6)
                    why = classify(e, every)
                    rows.append([source, f"`{e['site']}`", e["method"], steps, e["count"], why])
            self.table("source | site | call | steps | count | why", rows)
        if test := syncs.get("test"):
            summary = f"{test.get('summary')} ({test['status']})"
            self.text(f"tests/parallel/test_host_syncs.py on this machine: {summary}.")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:  # the probe phase's subprocess: `probe PATH`
        _atomic_write(argv[1], json.dumps(probe(), indent=1))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "build", "gpu-check"))
    work = os.path.join(ROOT, "build", "gpu-work")
    add("--work", default=work, help="build environments, partial results (not sent back)")
    add("--size", default="auto", choices=["auto", "full", "tiny"], help="auto: full with CUDA")
    add("--build", default="auto", choices=["auto", "yes", "no"], help="auto: where CUDA is")
    add("--build-variants", default="", help="of nccl,gloo,cpu (default: nccl,gloo with CUDA)")
    add("--budget", type=float, default=0, help="seconds in all (0: the size's)")
    add("--phases", default=",".join(PHASES), help="the phases to run")
    add("--fail", default="", help="phases made to fail (tests the report)")
    add("--stall", default="", help="phases made to hang (tests the limits)")
    return Kit(parser.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
