#!/usr/bin/env bash
# `make slurm-check`: run docker/slurm/*.sbatch on a real, throw-away Slurm
# (Debian's slurm-wlm and munge) made on this machine, then take it down.
# Not part of `make test`: it installs packages and starts daemons as root.
#
#   1. installs what is missing (slurmctld, slurmd, slurm-client, munge,
#      openssh-server/-client, iproute2) with apt;
#   2. makes two "nodes", node1 and node2: network namespaces joined by a veth
#      pair named eth0 at both ends, each with its own hostname (UTS namespace)
#      and /etc/hosts (mount namespace), as docker/check.sh makes its nodes;
#   3. writes slurm.conf for them into a temporary directory and starts, each
#      by its PID: munged (own key and socket), sshd on both nodes (horovodrun
#      checks ssh to the other nodes), slurmctld on node1, slurmd on each node;
#   4. submits with `sbatch --wait`, for both job scripts: 2 tasks on one node,
#      then 1 task on each of two nodes; each must print the example's
#      "Final:" line with an accuracy and a compression ratio above the bounds
#      below, and `scontrol show job` must say COMPLETED, exit code 0:0;
#   5. kills rank 1 (SIGKILL) of a longer job, for both scripts: the job must
#      end FAILED with a non-zero exit code within 60 s;
#   6. stops everything it started, by PID, also when a step fails (trap), and
#      returns only once all of it has ended: SIGTERM, then SIGKILL to what is
#      left; it fails, naming them, if any still runs STOP_WITHIN_S after that.
#
# Variables (defaults in brackets):
#   HPS_VENV [.venv]   the environment the jobs use (`make setup` makes it)
#   TRAIN_ARGS         the short training run, see below
#   KEEP=1             keep the temporary directory (logs, job output)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD

# One short epoch: 6400 training images (50 steps of 64 per rank at 2 ranks),
# 2000 test images, seconds of training. Measured here with mpirun -np 2 over
# seeds 1-6 and 42 (the default): accuracy 55.0-66.9 % (chance: 10 %), so 40 %
# says it learned; the compression ratio was 104.5x every time (it depends only
# on the model's shapes and the rank), and plain all-reduce would give 1.0x.
TRAIN_ARGS=${TRAIN_ARGS:---epochs 1 --train-subset 6400 --eval-subset 2000}
MIN_ACCURACY=${MIN_ACCURACY:-40}
MIN_RATIO=${MIN_RATIO:-100}
# Seconds from killing one rank to the job's end that count as "not hung".
FAIL_WITHIN_S=60
NS=hps-slurm-node  # network namespaces hps-slurm-node1, hps-slurm-node2
source docker/netns-pair.sh

log() { printf '[slurm-check] %s\n' "$*" >&2; }
fail() {
  log "FAIL: $*"
  exit 1
}

export HPS_VENV=${HPS_VENV:-$ROOT/.venv}
[[ -x "$HPS_VENV/bin/horovodrun" ]] || fail "no Horovod in $HPS_VENV: run \`make setup\` first"
[[ $(id -u) == 0 ]] || fail "must run as root (it starts slurmd, munged and network namespaces)"

# --- 1. packages --------------------------------------------------------------------
missing=()
for p in slurmctld slurmd slurm-client munge openssh-server openssh-client iproute2; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

# --- 2.-3. a two-node cluster, every daemon ours --------------------------------------
for ns in "${NS}1" "${NS}2"; do
  if ip netns list | grep -qw "$ns"; then fail "namespace $ns exists: another slurm-check running?"; fi
done
# Not under /tmp: every node gets a /tmp of its own (below), as real nodes have;
# Slurm's PMIx plugin keeps per-step folders there under names that would collide.
work=$(mktemp -d /var/tmp/hps-slurm.XXXXXX)
chmod 755 "$work"  # munged insists that everyone may reach its socket's folder
pids=()
alive() { # alive PID: still running (a zombie has ended; it only waits to be reaped)
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ $state != Z* ]]
}
daemon() { # daemon PID: PID still is a daemon this script started (its child), and runs
  [[ $(ps -o ppid= -p "$1" 2>/dev/null | tr -d ' ') == "$$" ]] && alive "$1"
}
ours_running() { # the PIDs of ours that still run: the daemons, and all in the nodes' namespaces
  local pid ns
  for pid in "${pids[@]}"; do if daemon "$pid"; then echo "$pid"; fi; done
  for ns in "${NS}1" "${NS}2"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do if alive "$pid"; then echo "$pid"; fi; done
  done
}
stop_within() { # stop_within SECONDS SIGNAL: send SIGNAL to ours that run, wait until none does
  local seconds=$1 signal=$2
  local -a left
  mapfile -t left < <(ours_running | sort -u)
  ((${#left[@]})) || return 0
  kill "-$signal" "${left[@]}" 2>/dev/null
  for _ in $(seq $((seconds * 5))); do
    [[ -n "$(ours_running)" ]] || return 0
    sleep 0.2
  done
  return 1
}
# A check that returns while its daemons still exit leaves them to the next command:
# a new slurm-check would meet their namespaces, `make test` their load.
STOP_WITHIN_S=30
cleanup() {
  local rc=$? pid
  local -a left
  set +e
  # Daemons in reverse order of start, each by the PID recorded at its start.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    if daemon "${pids[i]}"; then kill "${pids[i]}"; fi
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do daemon "$pid" || break; sleep 0.2; done
  done
  # Whatever still runs, daemons or what they started in the nodes' namespaces (job
  # steps), gets SIGTERM, then SIGKILL; then the wait until every one has ended,
  # before the namespaces go (afterwards nothing would find what is left in them).
  stop_within 5 TERM || stop_within "$STOP_WITHIN_S" KILL
  mapfile -t left < <(ours_running | sort -u)
  if ((${#left[@]})); then
    log "FAIL: ${#left[@]} processes it started still run $STOP_WITHIN_S s after SIGKILL:"
    ps -o pid,stat,etime,args -p "$(IFS=,; echo "${left[*]}")" >&2
    rc=1
  else
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done  # reap our own children
  fi
  netns_pair_down hps-slurm KILL
  if [[ "${KEEP:-0}" == 1 || $rc != 0 ]]; then
    log "logs and job output kept in $work"
  else
    rm -rf "$work"
  fi
  exit "$rc"
}
trap cleanup EXIT
mkdir -p "$work"/{etc,log,run,state,spool/node1,spool/node2,out,munge,ssh,bin}

# The nodes: namespaces on a veth pair, each end named eth0, as in docker/check.sh.
netns_pair_up hps-slurm 10.78.0
printf '127.0.0.1 localhost\n10.78.0.1 node1\n10.78.0.2 node2\n' >"$work/etc/hosts"

node_command() { # node_command ARRAY N COMMAND...: ARRAY := the command line of COMMAND on node N
  local -n into=$1
  local i=$2
  shift 2
  # unshare: private mounts and hostname. nsenter, not `ip netns exec`: that one
  # mounts a fresh /sys, without the cgroup file system slurmd insists on.
  # A checkout under /tmp (a fresh clone in /tmp, say) would vanish under the
  # node's own /tmp: it is bound back to its path there, as a shared file
  # system would show it. unshare, bash -c and nsenter each exec the next.
  mkdir -p "$work/checkout-node$i"
  into=(unshare --mount --uts -- bash -c
    'mount --bind "$0" /etc/hosts &&
     if [[ $4 == /tmp/* ]]; then mount --bind "$4" "$5"; fi &&
     mount -t tmpfs -o size=2g tmpfs /tmp &&
     if [[ $4 == /tmp/* ]]; then mkdir -p "$4" && mount --bind "$5" "$4"; fi &&
     hostname "$1" && exec nsenter --net="$2" "${@:6}"'
    "$work/etc/hosts" "node$i" "/run/netns/$NS$i" _ "$ROOT" "$work/checkout-node$i" "$@")
}
node() { # node N COMMAND...: run COMMAND on node N (network, hostname, /etc/hosts, /tmp)
  local -a cmdline
  node_command cmdline "$@"
  "${cmdline[@]}"
}
start_on_node() { # start_on_node N LOG COMMAND...: COMMAND on node N in the background
  local i=$1 log=$2
  shift 2
  local -a cmdline
  node_command cmdline "$i" "$@"
  # A plain command, not `node ... &`: a function in the background runs in a subshell of
  # its own, and $! would be that shell's PID; a TERM to it would leave COMMAND running.
  # Here the forked shell execs unshare, so $! is COMMAND's PID, stopped and waited for.
  "${cmdline[@]}" >>"$log" 2>&1 &
  pids+=($!)
}
wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...
  local seconds=$1 what=$2
  shift 2
  for _ in $(seq "$seconds"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  fail "$what not ready after $seconds s (logs: $work/log)"
}

# munge: its own key and socket; every Slurm daemon and command here uses it.
dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$work/munge/munge.key"
munged --foreground --socket="$work/munge/socket" --key-file="$work/munge/munge.key" \
  --pid-file="$work/run/munged.pid" --seed-file="$work/munge/seed" \
  --log-file="$work/log/munged.log" >>"$work/log/munged.log" 2>&1 &
pids+=($!)
wait_for 20 munged munge -S "$work/munge/socket" -n

# ssh between the nodes, for horovodrun's check of remote hosts: sshd on port 22
# of each node's own network, this run's keys, and an `ssh` first in PATH that
# reads this run's client config, so root's ~/.ssh is neither read nor written.
ssh-keygen -q -t ed25519 -N '' -f "$work/ssh/id_ed25519"
ssh-keygen -q -t ed25519 -N '' -f "$work/ssh/host_ed25519"
cp "$work/ssh/id_ed25519.pub" "$work/ssh/authorized_keys"
printf '* %s\n' "$(cut -d' ' -f1,2 "$work/ssh/host_ed25519.pub")" >"$work/ssh/known_hosts"
cat >"$work/ssh/sshd_config" <<EOF
Port 22
HostKey $work/ssh/host_ed25519
AuthorizedKeysFile $work/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PidFile none
# The key files sit under /tmp, which everyone may write to.
StrictModes no
EOF
cat >"$work/ssh/config" <<EOF
Host *
  IdentityFile $work/ssh/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $work/ssh/known_hosts
  LogLevel ERROR
EOF
printf '#!/bin/sh\nexec /usr/bin/ssh -F %s "$@"\n' "$work/ssh/config" >"$work/bin/ssh"
chmod 755 "$work/bin/ssh"
mkdir -p /run/sshd  # sshd's privilege-separation directory
for i in 1 2; do
  start_on_node "$i" "$work/log/sshd-node$i.log" /usr/sbin/sshd -D -e -f "$work/ssh/sshd_config"
done

# Slurm: no accounting daemon, so jobs are read back with `scontrol show job`,
# kept for an hour after they end (MinJobAge). Both nodes are this machine's 2
# cores; linuxproc tracks a job's processes without cgroups.
export SLURM_CONF=$work/etc/slurm.conf
cat >"$SLURM_CONF" <<EOF
ClusterName=hps-check
SlurmctldHost=node1(10.78.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/munge/socket
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool/%n
SlurmctldPidFile=$work/run/slurmctld.pid
SlurmdPidFile=$work/run/slurmd-%n.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=3600
KillWait=5
SlurmdTimeout=60
NodeName=node1 NodeAddr=10.78.0.1 CPUs=2 State=UNKNOWN
NodeName=node2 NodeAddr=10.78.0.2 CPUs=2 State=UNKNOWN
PartitionName=check Nodes=node1,node2 Default=YES MaxTime=30 State=UP
EOF
# slurmd needs a cgroup file system even with linuxproc; under cgroup v2 without
# systemd (containers) it makes its own scope instead of asking systemd for one.
printf 'CgroupPlugin=autodetect\nIgnoreSystemd=yes\n' >"$work/etc/cgroup.conf"
start_on_node 1 "$work/log/slurmctld.out" slurmctld -D -f "$SLURM_CONF"
wait_for 30 slurmctld node 1 scontrol ping
for i in 1 2; do
  start_on_node "$i" "$work/log/slurmd-node$i.out" slurmd -D -f "$SLURM_CONF" -N "node$i"
done
idle_nodes() { [[ $(node 1 sinfo -h -N -t idle -o %N | sort -u | wc -l) == 2 ]]; }
wait_for 60 "slurmd on both nodes" idle_nodes
log "Slurm $(node 1 sinfo -V) up: $(node 1 sinfo -h -N -o '%N %t %c' | sort -u | paste -sd ' ')"

# --- 4. the job scripts, one node and two ------------------------------------------------
# The jobs inherit this environment (sbatch --export=ALL): SLURM_CONF, the ssh
# wrapper in PATH, and OpenMPI's consent to run as root, which this check is.
export PATH=$work/bin:$PATH IFACE=eth0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1

job_field() { # job_field JOBID FIELD: one field of `scontrol show job`
  node 1 scontrol show job "$1" | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n1
}
read -ra train_args <<<"$TRAIN_ARGS"

run_job() { # run_job SCRIPT NODES TASKS_PER_NODE: submit, wait, assert
  local script=$1 nodes=$2 per_node=$3 out jobid rc final state exit_code accuracy ratio
  local name
  name=$(basename "$script" .sbatch)-${nodes}x$per_node
  out=$work/out/$name.out
  log "sbatch --wait -N $nodes --ntasks-per-node=$per_node $script $TRAIN_ARGS"
  rc=0
  jobid=$(node 1 timeout 900 sbatch --parsable --wait -N "$nodes" --ntasks-per-node="$per_node" \
    --job-name="$name" --chdir="$ROOT" --output="$out" "$script" "${train_args[@]}") || rc=$?
  jobid=${jobid%%;*}
  [[ -n "$jobid" ]] || fail "$name: sbatch did not submit (rc $rc)"
  state=$(job_field "$jobid" JobState)
  exit_code=$(job_field "$jobid" ExitCode)
  # horovodrun's mpirun prefixes rank 0's lines with "[1,0]<stdout>:".
  final=$(sed 's/\[[0-9]*,[0-9]*\]<std[a-z]*>://g' "$out" | grep -o 'Final: .*' | tail -n1 || true)
  [[ $rc == 0 ]] || {
    tail -n 30 "$out" >&2
    fail "$name: job $jobid ended $state, exit code $exit_code (sbatch rc $rc)"
  }
  [[ "$state" == COMPLETED && "$exit_code" == 0:0 ]] ||
    fail "$name: scontrol says JobState=$state ExitCode=$exit_code"
  [[ -n "$final" ]] || fail "$name: no 'Final:' line in $out"
  tail -n1 "$out" | grep -qF "$final" || fail "$name: 'Final:' is not the job's last line"
  grep -q "Fashion-MNIST: .*, $((nodes * per_node)) workers, PowerSGD rank 2" "$out" ||
    fail "$name: the job did not train with $((nodes * per_node)) workers"
  accuracy=$(sed -n 's/.*test accuracy \([0-9.]*\)%.*/\1/p' <<<"$final")
  ratio=$(sed -n 's/.*compression ratio \([0-9.]*\)x.*/\1/p' <<<"$final")
  awk -v a="$accuracy" -v r="$ratio" -v ma="$MIN_ACCURACY" -v mr="$MIN_RATIO" \
    'BEGIN { exit !(a + 0 >= ma && r + 0 >= mr) }' ||
    fail "$name: accuracy $accuracy % (want >= $MIN_ACCURACY) or ratio ${ratio}x (want >= $MIN_RATIO)"
  log "$name: job $jobid JobState=$state ExitCode=$exit_code on $(job_field "$jobid" NodeList)"
  log "  $final"
}

for script in docker/slurm/train-horovodrun.sbatch docker/slurm/train-srun.sbatch; do
  run_job "$script" 1 2
  run_job "$script" 2 1
done

# --- 5. a rank killed: the job must end, failed, within FAIL_WITHIN_S -----------------
rank_pid() { # rank_pid JOBID RANK: the PID of that Horovod rank of the job, if running
  local pid env
  for pid in $(pgrep -f 'examples/fashion_mnist.py' || true); do
    env=$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null) || continue
    # Ranks started by mpirun and by srun --mpi=pmix both carry PMIX_RANK.
    if grep -qx "SLURM_JOB_ID=$1" <<<"$env" && grep -qx "PMIX_RANK=$2" <<<"$env"; then
      echo "$pid"
      return 0
    fi
  done
  return 1
}

kill_rank_job() { # kill_rank_job SCRIPT: two ranks on two nodes, SIGKILL rank 1
  local script=$1 name jobid pid killed_at state exit_code
  name=$(basename "$script" .sbatch)-killed
  # A whole epoch: far longer than the test, so only the kill can end it early.
  jobid=$(node 1 sbatch --parsable -N 2 --ntasks-per-node=1 --job-name="$name" \
    --chdir="$ROOT" --output="$work/out/$name.out" "$script" --epochs 1)
  jobid=${jobid%%;*}
  wait_for 120 "rank 1 of job $jobid" rank_pid "$jobid" 1
  # Into training: past the imports, data loading and hvd.init().
  sleep 20
  pid=$(rank_pid "$jobid" 1) || fail "$name: rank 1 of job $jobid ended by itself"
  kill -KILL "$pid"
  killed_at=$SECONDS
  log "$name: job $jobid, killed rank 1 (PID $pid)"
  while [[ $(job_field "$jobid" JobState) =~ ^(PENDING|RUNNING|COMPLETING|CONFIGURING)$ ]]; do
    if ((SECONDS - killed_at > FAIL_WITHIN_S)); then
      node 1 scancel "$jobid" || true
      fail "$name: job $jobid still $(job_field "$jobid" JobState) ${FAIL_WITHIN_S} s after the kill"
    fi
    sleep 1
  done
  state=$(job_field "$jobid" JobState)
  exit_code=$(job_field "$jobid" ExitCode)
  [[ "$state" == FAILED && "$exit_code" != 0:0 ]] ||
    fail "$name: job $jobid ended JobState=$state ExitCode=$exit_code, want FAILED, non-zero"
  log "$name: job $jobid JobState=$state ExitCode=$exit_code $((SECONDS - killed_at)) s after the kill"
}

for script in docker/slurm/train-horovodrun.sbatch docker/slurm/train-srun.sbatch; do
  kill_rank_job "$script"
done

log "OK: both job scripts trained on 1 node x 2 tasks and on 2 nodes x 1 task; a killed rank failed each job within ${FAIL_WITHIN_S} s"
