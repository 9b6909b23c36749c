"""The Kubeflow MPIJob manifests (docker/k8s/), checked offline.

No cluster runs here, so these tests check what a cluster would reject or
what would break at run time without one: the MPIJob v2beta1 fields the MPI
Operator reads, the launcher's horovodrun and example arguments (parsed by
their own parsers), the agreement of ssh port, slots and -np, and that every
command and path the manifests name exists in the image the Dockerfiles build.
"""

import fnmatch
import os
import re
import sys
from pathlib import Path

import pytest
import yaml
from horovod.runner import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import fashion_mnist

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = {"cpu": ROOT / "docker/k8s/mpijob-cpu.yaml", "gpu": ROOT / "docker/k8s/mpijob-gpu.yaml"}
DOCKERFILES = {"cpu": ROOT / "Dockerfile", "gpu": ROOT / "docker/Dockerfile.gpu"}
ENTRYPOINT = ROOT / "docker/entrypoint.sh"

# MPIJobSpec and RunPolicy fields of kubeflow.org/v2beta1 (mpi-operator's
# pkg/apis/kubeflow/v2beta1/types.go); the API server drops or rejects others.
SPEC_FIELDS = {
    "slotsPerWorker",
    "runLauncherAsWorker",
    "runPolicy",
    "mpiReplicaSpecs",
    "sshAuthMountPath",
    "launcherCreationPolicy",
    "mpiImplementation",
}
RUN_POLICY_FIELDS = {
    "cleanPodPolicy",
    "ttlSecondsAfterFinished",
    "activeDeadlineSeconds",
    "backoffLimit",
    "schedulingPolicy",
    "suspend",
    "managedBy",
}
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
# The operator's ConfigMap mount: one "<worker> slots=<n>" line per worker pod.
OPERATOR_HOSTFILE = "/etc/mpi/hostfile"
# Where the operator mounts its own key when sshAuthMountPath is left out.
OPERATOR_DEFAULT_SSH_PATH = "/root/.ssh"


def load(kind):
    docs = list(yaml.safe_load_all(MANIFESTS[kind].read_text()))
    assert len(docs) == 1, f"{MANIFESTS[kind]}: one MPIJob per file"
    return docs[0]


def replica(job, role):
    return job["spec"]["mpiReplicaSpecs"][role]


def container(job, role):
    return replica(job, role)["template"]["spec"]["containers"][0]


def env(c):
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def dockerfile_instruction(kind, instruction):
    """Arguments of the last INSTRUCTION in that image's Dockerfile."""
    lines = [
        line.split(None, 1)[1].strip()
        for line in DOCKERFILES[kind].read_text().splitlines()
        if line.startswith(instruction + " ")
    ]
    assert lines, f"{DOCKERFILES[kind]} has no {instruction}"
    return lines[-1]


def entrypoint_default(variable):
    match = re.search(rf"^{variable}=\$\{{{variable}:-([^}}]+)\}}", ENTRYPOINT.read_text(), re.M)
    assert match, f"{ENTRYPOINT} sets no default for {variable}"
    return match.group(1)


def launcher_args(job, monkeypatch):
    """horovodrun's own parser on the launcher's arguments, and the command it runs."""
    args = container(job, "Launcher")["args"]
    assert args[0] == "horovodrun"
    monkeypatch.setattr(sys, "argv", args)
    return launch.parse_args()


kinds = pytest.mark.parametrize("kind", sorted(MANIFESTS))


@kinds
def test_is_a_v2beta1_mpijob_with_one_launcher_and_two_workers(kind):
    job = load(kind)
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    assert job["kind"] == "MPIJob"
    # A DNS-1123 label that still fits once the operator appends "-launcher".
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
    assert len(job["metadata"]["name"] + "-launcher") <= 63
    spec = job["spec"]
    assert set(spec) <= SPEC_FIELDS, set(spec) - SPEC_FIELDS
    assert set(spec.get("runPolicy", {})) <= RUN_POLICY_FIELDS
    assert spec.get("runPolicy", {}).get("cleanPodPolicy", "Running") in {"All", "Running", "None"}
    assert spec.get("launcherCreationPolicy", "AtStartup") in {"AtStartup", "WaitForWorkersReady"}
    # The images carry OpenMPI (Debian's or Ubuntu's), so the hostfile must be OpenMPI's.
    assert spec.get("mpiImplementation", "OpenMPI") == "OpenMPI"
    assert "openmpi-bin" in DOCKERFILES[kind].read_text()
    assert isinstance(spec["slotsPerWorker"], int) and spec["slotsPerWorker"] >= 1
    assert set(spec["mpiReplicaSpecs"]) == {"Launcher", "Worker"}
    assert replica(job, "Launcher")["replicas"] == 1
    assert replica(job, "Worker")["replicas"] == 2
    for role in ("Launcher", "Worker"):
        assert replica(job, role).get("restartPolicy", "Never") in RESTART_POLICIES
        c = container(job, role)
        assert c["name"] and c["image"]


@kinds
def test_np_is_workers_times_slots_and_hosts_come_from_the_operator(kind, monkeypatch):
    job = load(kind)
    args = launcher_args(job, monkeypatch)
    slots = job["spec"]["slotsPerWorker"]
    assert args.num_proc == replica(job, "Worker")["replicas"] * slots
    # horovodrun reads the operator's hostfile (same "host slots=n" format).
    assert args.hostfile == OPERATOR_HOSTFILE and args.hosts is None
    # Pods have several interfaces (lo, eth0); name the one between pods.
    assert args.nics == {"eth0"}
    resources = container(job, "Worker")["resources"]
    if kind == "gpu":
        assert int(resources["limits"]["nvidia.com/gpu"]) == slots  # one GPU per rank
    else:
        assert float(resources["requests"]["cpu"]) >= slots  # one core per rank


@kinds
def test_ssh_port_agrees_everywhere(kind, monkeypatch):
    job = load(kind)
    port = launcher_args(job, monkeypatch).ssh_port
    worker = container(job, "Worker")
    assert int(env(worker).get("SSH_PORT", entrypoint_default("SSH_PORT"))) == port
    assert int(env(container(job, "Launcher")).get("SSH_PORT", port)) == port
    assert [p["containerPort"] for p in worker["ports"]] == [port]
    assert worker["readinessProbe"]["tcpSocket"]["port"] == port
    assert str(port) in dockerfile_instruction(kind, "EXPOSE").split()


@kinds
def test_the_image_entrypoint_sets_up_ssh_from_the_mounted_key_set(kind):
    job = load(kind)
    key_dir = entrypoint_default("SSH_KEY_DIR")
    needed = re.search(r"for f in ([^;]+); do", ENTRYPOINT.read_text()).group(1).split()
    assert "id_ed25519" in needed
    for role in ("Launcher", "Worker"):
        c = container(job, role)
        # `command` would replace the image's ENTRYPOINT, and with it sshd's set-up.
        assert "command" not in c
        assert env(c).get("SSHD") == "1"
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert key_dir in mounts, f"{role}: nothing mounted at the entry point's {key_dir}"
        volumes = {v["name"]: v for v in replica(job, role)["template"]["spec"]["volumes"]}
        secret = volumes[mounts[key_dir]]["secret"]
        assert {item["path"] for item in secret["items"]} >= set(needed)
    # Without args the operator starts `sshd -De` in place of the entry point.
    assert container(job, "Worker")["args"]
    # The entry point writes root's ~/.ssh: the operator's read-only key mount must
    # not land there (its default).
    assert job["spec"]["sshAuthMountPath"] != OPERATOR_DEFAULT_SSH_PATH
    entry = dockerfile_instruction(kind, "ENTRYPOINT")
    workdir = dockerfile_instruction(kind, "WORKDIR")
    assert entry == f'["{workdir}/{ENTRYPOINT.relative_to(ROOT)}"]'


@kinds
def test_the_training_command_exists_in_the_image_and_parses(kind, monkeypatch):
    job = load(kind)
    command = launcher_args(job, monkeypatch).command
    assert command[0] == "python"  # the image's venv is first in PATH
    assert "/opt/horovod-powersgd/.venv/bin" in dockerfile_instruction(kind, "ENV")
    script, script_args = command[1], command[2:]
    # Relative to the image's WORKDIR, which holds the repository (COPY . .).
    for role in ("Launcher", "Worker"):
        assert container(job, role).get("workingDir", dockerfile_instruction(kind, "WORKDIR")) == (
            dockerfile_instruction(kind, "WORKDIR")
        )
    assert (ROOT / script).is_file()
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = Path(script).parts
    for pattern in ignored:
        prefixes = [os.path.join(*parts[:i]) for i in range(1, len(parts) + 1)]
        assert not any(fnmatch.fnmatch(p, pattern.lstrip("/")) for p in prefixes), pattern
    args = fashion_mnist.build_parser().parse_args(script_args)
    # The data set the images install from the distribution's package.
    assert args.data_dir == fashion_mnist.DEFAULT_DATA_DIR
    if kind == "gpu":
        # The ranks train on their GPUs (the example's default where CUDA is there).
        assert not args.no_cuda
    package_lists = DOCKERFILES[kind].read_text() + (ROOT / "scripts/bootstrap.sh").read_text()
    assert "dataset-fashion-mnist" in package_lists


@kinds
def test_workers_get_a_large_dev_shm(kind):
    job = load(kind)
    mounts = {m["mountPath"]: m["name"] for m in container(job, "Worker")["volumeMounts"]}
    volumes = {v["name"]: v for v in replica(job, "Worker")["template"]["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
