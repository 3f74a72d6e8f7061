#!/usr/bin/env bash
# Start/stop a throw-away Slurm on this machine (Debian's slurm-wlm + munge), for the Slurm
# executor's tests and for trying it by hand: munged on its own socket, slurmctld and slurmd on
# free loopback ports, one node (this host) in one partition, state under DIR. Nothing in /etc is
# touched: clients find it through SLURM_CONF (printed by `start` and `env`).
#
#   scripts/slurm.sh start [DIR]     # DIR defaults to /tmp/ranklens-slurm
#   eval "$(scripts/slurm.sh env [DIR])"; sinfo; sbatch --wrap 'sleep 60'
#   scripts/slurm.sh stop [DIR]
#
# As root (slurmd runs jobs as their users). ProctrackType=linuxproc and TaskPlugin=none: no cgroup
# is needed, so it also runs in a container.
set -euo pipefail
cmd=${1:?usage: $0 start|stop|env [DIR]}
dir=${2:-/tmp/ranklens-slurm}
node=$(hostname -s)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
stop_pid() {  # pidfile: TERM, wait up to 10 s, then KILL
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

case "$cmd" in
env)
  echo "export SLURM_CONF=$dir/slurm.conf"
  ;;
start)
  for tool in munged slurmctld slurmd scontrol sinfo; do
    command -v "$tool" >/dev/null || { echo "$tool is not installed (apt-get install slurm-wlm munge)" >&2; exit 2; }
  done
  [ "$(id -u)" = 0 ] || { echo "scripts/slurm.sh start needs root (slurmd starts jobs as their users)" >&2; exit 2; }
  if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
    echo "slurm already running under $dir"; echo "export SLURM_CONF=$dir/slurm.conf"; exit 0
  fi
  mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log"
  chmod 700 "$dir/munge"
  # munge: its own key, socket and pid file (the system's munged, if any, is left alone)
  [ -f "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none; chmod 400 "$dir/munge/munge.key"; }
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
  ctld_port=$(free_port); slurmd_port=$(free_port)
  cpus=$(nproc); mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  cat >"$dir/slurm.conf" <<CONF
# written by scripts/slurm.sh: a one-node Slurm for ranklens' tests
ClusterName=ranklens
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/slurmd-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/linear
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$dir/slurm.conf" -i
  slurmd -f "$dir/slurm.conf"
  # ready: the controller answers and the node registered as idle
  for _ in $(seq 1 120); do
    state=$(sinfo -h -n "$node" -o '%T' 2>/dev/null || true)
    case "$state" in
      idle*) echo "slurm up: node $node $state, slurmctld 127.0.0.1:$ctld_port"; echo "export SLURM_CONF=$dir/slurm.conf"; exit 0 ;;
    esac
    sleep 0.25
  done
  echo "slurm did not come up (node state: ${state:-none}); logs:" >&2
  tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd-$node.log" "$dir/log/munged.log" >&2 2>/dev/null || true
  exit 1
  ;;
stop)
  if [ -f "$dir/slurm.conf" ]; then
    export SLURM_CONF=$dir/slurm.conf
    scancel --full --quiet "--user=$(id -un)" 2>/dev/null || true
  fi
  stop_pid "$dir/slurmd-$node.pid"
  stop_pid "$dir/slurmctld.pid"
  stop_pid "$dir/munge/munged.pid"
  ;;
*) echo "usage: $0 start|stop|env [DIR]" >&2; exit 2 ;;
esac
