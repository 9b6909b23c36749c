#!/usr/bin/env bash
# A cluster of two nodes on this machine, for multi-node jobs and their tests.
#
#   bash scripts/nodes/two_nodes.sh [--rate RATE] [--per-node N] [--timeout S] -- PROGRAM [ARGS...]
#
# Two network namespaces joined by a veth pair (docker/netns-pair.sh) are the
# nodes, each with a hostname of its own (a UTS namespace per process tree), so
# Horovod sees 2 nodes of N workers: local_size N, cross_size 2. The link between
# them is capped at RATE (tc tbf on both ends, default 100mbit; "none": no cap);
# inside a node the workers talk through shared memory, uncapped, as on a real
# node. `mpirun -np 2N` runs PROGRAM, from inside node 1; OpenMPI reaches node 2
# through this script as its remote-shell agent (`--agent`), which enters node 2's
# namespaces instead of ssh. Everything started is ended, the namespaces deleted,
# on exit. Exit status: mpirun's (124 past --timeout). Needs root, iproute2, unshare.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SUBNET=10.88.0

if [[ "${1:-}" == --agent ]]; then # OpenMPI's rsh agent: --agent HOST COMMAND...
  host=$2
  shift 2
  case $host in
    "$SUBNET.1") node=1 ;;
    "$SUBNET.2") node=2 ;;
    *) echo "two_nodes.sh: unknown host $host" >&2 && exit 1 ;;
  esac
  exec ip netns exec "$HPS_NODES-node$node" unshare --uts sh -c "hostname node$node; $*"
fi

rate=100mbit per_node=2 timeout_s=600
while [[ $# -gt 0 ]]; do
  case $1 in
    --rate) rate=$2 && shift 2 ;;
    --per-node) per_node=$2 && shift 2 ;;
    --timeout) timeout_s=$2 && shift 2 ;;
    --) shift && break ;;
    *) echo "usage: $0 [--rate RATE] [--per-node N] [--timeout S] -- PROGRAM [ARGS...]" >&2 && exit 2 ;;
  esac
done
[[ $# -gt 0 ]] || { echo "two_nodes.sh: no program given" >&2 && exit 2; }

# shellcheck source=docker/netns-pair.sh
source "$ROOT/docker/netns-pair.sh"
export HPS_NODES="hps$$" # namespaces of this run alone: runs side by side do not meet
trap 'netns_pair_down "$HPS_NODES" KILL' EXIT
netns_pair_up "$HPS_NODES" "$SUBNET"
if [[ $rate != none ]]; then
  for node in 1 2; do
    ip netns exec "$HPS_NODES-node$node" tc qdisc add dev eth0 root tbf rate "$rate" \
      burst 256kb latency 100ms
  done
fi

printf -v program '%q ' "$@"
# btl tcp between the nodes (eth0 only), vader (shared memory) inside one.
# --per-node N: N workers on each node; A,B: A on node 1, B on node 2 (uneven).
first=${per_node%,*} second=${per_node#*,}
launch="mpirun --allow-run-as-root --oversubscribe -np $((first + second)) \
  -H $SUBNET.1:$first,$SUBNET.2:$second --bind-to none --map-by slot \
  --mca plm_rsh_agent '$ROOT/scripts/nodes/two_nodes.sh --agent' \
  --mca btl self,tcp,vader --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
  --mca mpi_yield_when_idle 1 -x PATH -x OMP_NUM_THREADS -x PYTHONUNBUFFERED \
  -x HPS_NODES $program"
set +e
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1 timeout --signal=KILL "$timeout_s" \
  ip netns exec "$HPS_NODES-node1" unshare --uts sh -c "hostname node1; cd '$PWD'; $launch"
status=$?
set -e
[[ $status -eq 137 ]] && status=124
exit $status
