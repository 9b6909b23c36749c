# horovod-powersgd, CPU image: Debian bookworm, Python 3.11, Debian's OpenMPI,
# torch (CPU build) and Horovod compiled against it by scripts/bootstrap.sh, the
# same set-up `make test` runs. The GPU variant is docker/Dockerfile.gpu.
#
#   docker build -t horovod-powersgd:cpu .
#   docker run --rm horovod-powersgd:cpu                  # `make demo`: 2 ranks, Fashion-MNIST
#   docker run --rm horovod-powersgd:cpu make test        # the whole test suite
# Multi-node (sshd, compose, MPI/Gloo options): docker/README.md.

# Every version in one place. OpenMPI and OpenSSH come from Debian: the patterns
# pin the upstream release and take Debian's security revisions of it, since the
# archive keeps only the newest revision. Every node of a job needs the same
# OpenMPI, and Horovod is compiled against it.
ARG PYTHON_VERSION=3.11
ARG DEBIAN_RELEASE=bookworm
ARG TORCH_VERSION=2.13.0
ARG HOROVOD_VERSION=0.28.1
ARG OPENMPI_VERSION=4.1.4-*
ARG OPENSSH_VERSION=1:9.2p1-*
# Any Debian image with python${PYTHON_VERSION} (venv module and headers) as `python3`.
# Where no registry is reachable, docker/local-base.sh makes one from Debian packages.
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE}

FROM ${BASE_IMAGE}

ARG TORCH_VERSION
ARG HOROVOD_VERSION
ARG OPENMPI_VERSION
ARG OPENSSH_VERSION
# torch's CPU-only wheels: PyPI's Linux wheel is the CUDA build and pulls in
# gigabytes of CUDA libraries. Empty: use pip's configured indexes only.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The same extras as `make test`, so the image can run the test suite.
ARG EXTRAS=test,dev,examples

# The container runs as root (it is the isolation boundary, and multi-node ssh
# logs in as root): OpenMPI refuses root without these. Docker's default seccomp
# profile blocks the cross-process memory copy OpenMPI's shared-memory transport
# uses between ranks in one container, so turn that copy off rather than ask for
# CAP_SYS_PTRACE.
ENV PATH=/opt/horovod-powersgd/.venv/bin:${PATH} \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    OMPI_MCA_btl_vader_single_copy_mechanism=none \
    PYTHONUNBUFFERED=1

# After the ENV: hadolint 2.15 forgets a SHELL at a later ENV and lints bash as sh.
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]

WORKDIR /opt/horovod-powersgd

# OpenMPI pinned here (the bootstrap then finds it installed); sshd and its
# client for multi-node runs, which only containers need. The host keys the
# package generates are deleted: anyone holding the image would hold them too.
# docker/entrypoint.sh installs the cluster's own host key at start.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      "openmpi-bin=${OPENMPI_VERSION}" "libopenmpi-dev=${OPENMPI_VERSION}" \
      "openssh-client=${OPENSSH_VERSION}" "openssh-server=${OPENSSH_VERSION}" \
 && rm -f /etc/ssh/ssh_host_* \
 && apt-get clean && rm -rf /var/lib/apt/lists/*

# Dependency layer: only what scripts/bootstrap.sh reads (packaging metadata and
# the version line in the package's __init__.py), so editing code does not
# rebuild torch and Horovod. The cache mount keeps pip's cache and the bootstrap's
# Horovod wheel cache between builds, out of the image. The compiler toolchain
# stays in the image: `make` targets re-run the bootstrap, which checks for it.
COPY setup.py pyproject.toml README.md ./
COPY scripts/ scripts/
COPY horovod_powersgd/__init__.py horovod_powersgd/
RUN --mount=type=cache,target=/root/.cache \
    if [[ -n "${TORCH_INDEX_URL}" ]]; then export PIP_EXTRA_INDEX_URL="${TORCH_INDEX_URL}"; fi \
 && TORCH_VERSION="${TORCH_VERSION}" HOROVOD_VERSION="${HOROVOD_VERSION}" EXTRAS="${EXTRAS}" \
      bash scripts/bootstrap.sh \
 && apt-get clean && rm -rf /var/lib/apt/lists/*

COPY . .

# Prove the image works: Horovod sees torch, MPI and Gloo; the package imports;
# Horovod initialises.
RUN horovodrun --check-build \
 && python -c 'import horovod, horovod_powersgd, horovod.torch as hvd; hvd.init(); \
print(f"self-test passed: horovod-powersgd {horovod_powersgd.__version__}, horovod {horovod.__version__}, size {hvd.size()}")'

# sshd's port when docker/entrypoint.sh starts it (SSHD=1); see docker/README.md.
EXPOSE 2222
ENTRYPOINT ["/opt/horovod-powersgd/docker/entrypoint.sh"]
CMD ["make", "demo"]
