# Two network namespaces joined by a veth pair, as two hosts on one switch: the
# "nodes" of `make docker-check` (docker/check.sh) and `make slurm-check`
# (docker/slurm/check.sh). Sourced, not run; needs root and iproute2.
#
#   netns_pair_up NAME SUBNET      namespaces NAME-node1 and NAME-node2; in each the
#                                  link is called eth0 (as in a container), with
#                                  SUBNET.1/24 and SUBNET.2/24 (SUBNET e.g. 10.77.0)
#   netns_pair_down NAME [SIGNAL]  send SIGNAL (default TERM) to whatever still runs
#                                  in them, then delete them
netns_pair_up() {
  local name=$1 subnet=$2 i dev
  ip netns add "$name-node1"
  ip netns add "$name-node2"
  ip link add "$name-a" type veth peer name "$name-b"
  ip link set "$name-a" netns "$name-node1"
  ip link set "$name-b" netns "$name-node2"
  for i in 1 2; do
    dev=$( ((i == 1)) && echo "$name-a" || echo "$name-b")
    ip -n "$name-node$i" link set "$dev" name eth0
    ip -n "$name-node$i" addr add "$subnet.$i/24" dev eth0
    ip -n "$name-node$i" link set eth0 up
    ip -n "$name-node$i" link set lo up
  done
}

netns_pair_down() {
  local name=$1 signal=${2:-TERM} ns
  for ns in "$name-node1" "$name-node2"; do
    # Only processes in these namespaces, which only the check started.
    ip netns pids "$ns" 2>/dev/null | xargs -r kill "-$signal" 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
}
