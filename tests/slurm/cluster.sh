#!/usr/bin/env bash
# A real one-node Slurm cluster for the Slurm tests (tests/slurm), as CTest's fixture:
#   cluster.sh start STATE_FILE   write a slurm.conf for this host, start munged, slurmctld and
#                                 slurmd, wait until sinfo shows the node idle; STATE_FILE then
#                                 holds `SLURM_CONF=...` and `dir=...` for the tests (and stop)
#   cluster.sh stop STATE_FILE    stop the daemons and remove the cluster's directory
#
# Everything the cluster has lives in a fresh directory under /tmp (not the build folder: munge's
# socket path must stay under the 108 bytes a unix socket's name may have, and munged refuses
# directories others may write): its own munge key and socket, state, spool, logs and pid files,
# and ports nobody listens to. Nothing touches /etc/slurm or the system's munged. The
# configuration needs no cgroups (containers rarely let a daemon create them):
# ProctrackType=proctrack/linuxproc, TaskPlugin=task/none, no accounting.
#
# Exits 77 (CTest: skipped) where the cluster cannot be had: not root (slurmd starts job steps
# as their user, which needs root), or slurm-wlm / munge not installed (scripts/run.sh test
# installs them). STATE_FILE then says `unavailable=REASON`, so every Slurm test skips saying
# why, and under CI=true fails (tests/skip.h). Any other failure to start is a failure (exit 1),
# with the daemons' logs printed.
set -uo pipefail

action="${1:-}"
state_file="${2:-}"
[ -n "$action" ] && [ -n "$state_file" ] || { echo "usage: cluster.sh start|stop STATE_FILE" >&2; exit 2; }

say() { printf '[slurm cluster] %s\n' "$*" >&2; }

# A TCP port nobody listens to on this host, from a range that the kernel does not hand out
# for outgoing connections (ip_local_port_range is 32768-60999 by default).
free_port() {
  local taken port i
  taken="$(ss -Htln 2>/dev/null | awk '{print $4}' | sed 's/.*://' | sort -u)"
  for i in $(seq 1 200); do
    port=$((20000 + RANDOM % 12000))
    grep -qx "$port" <<<"$taken" && continue
    [ "$port" = "${used_port:-}" ] && continue
    used_port="$port"
    echo "$port"
    return 0
  done
  return 1
}

unavailable() {
  say "cannot start a cluster here: $1"
  mkdir -p "$(dirname "$state_file")"
  printf 'unavailable=%s\n' "$1" >"$state_file"
  exit 77
}

dump_logs() {
  local f
  for f in "$dir"/log/*.log; do
    [ -f "$f" ] || continue
    say "---- $(basename "$f") (last 40 lines)"
    tail -n 40 "$f" >&2
  done
}

stop_daemons() {
  local name pidfile pid i
  for name in slurmd slurmctld munged; do
    pidfile="$dir/run/$name.pid"
    [ -f "$pidfile" ] || continue
    pid="$(cat "$pidfile" 2>/dev/null)"
    [ -n "$pid" ] || continue
    kill -TERM "$pid" 2>/dev/null || continue
    for i in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null && say "$name (pid $pid) did not stop within 5 s: killed"
  done
  # What a failed test left running: slurmstepd (daemonised, so no longer slurmd's child) and
  # the tasks under it. They all carry this cluster's SLURM_CONF in their environment (slurmd
  # hands it on, and srun passes the caller's on), and nothing else on the host does.
  local proc self=$$ left=0
  for proc in /proc/[0-9]*; do
    pid="${proc#/proc/}"
    [ "$pid" = "$self" ] && continue
    if { tr '\0' '\n' <"$proc/environ"; } 2>/dev/null | grep -qx "SLURM_CONF=$dir/slurm.conf"; then
      kill -KILL "$pid" 2>/dev/null && left=$((left + 1))
    fi
  done
  [ "$left" -eq 0 ] || say "killed $left process(es) a job of this cluster left behind"
}

# Cancels every job of the cluster and waits (10 s at most) until none is left.
cancel_jobs() {
  local ids i
  ids="$(SLURM_CONF="$dir/slurm.conf" squeue -h -o %i 2>/dev/null)"
  [ -n "$ids" ] || return 0
  say "cancelling jobs a test left: $(echo $ids)"
  SLURM_CONF="$dir/slurm.conf" scancel $ids 2>/dev/null
  for i in $(seq 1 100); do
    [ -z "$(SLURM_CONF="$dir/slurm.conf" squeue -h -o %i 2>/dev/null)" ] && return 0
    sleep 0.1
  done
}

case "$action" in
  start)
    rm -f "$state_file"
    [ "$(id -u)" = 0 ] || unavailable "not root (slurmd runs job steps as their user, which needs root)"
    for prog in munged mungekey slurmctld slurmd sinfo srun sbatch scancel; do
      command -v "$prog" >/dev/null || unavailable "$prog is missing (Debian: slurm-wlm and munge)"
    done
    dir="$(mktemp -d /tmp/baton-slurm.XXXXXX)"
    # munged wants its socket's directories searchable by all (clients of any user connect)
    # and its key's directory private.
    chmod 755 "$dir"
    mkdir -p "$dir/munge" "$dir/key" "$dir/state" "$dir/spool" "$dir/log" "$dir/run"
    chmod 755 "$dir/munge"
    chmod 700 "$dir/key"
    # A fresh key: this cluster trusts only itself.
    mungekey --create --keyfile="$dir/key/munge.key" --force >/dev/null 2>&1 ||
      dd if=/dev/urandom of="$dir/key/munge.key" bs=1024 count=1 status=none
    chmod 600 "$dir/key/munge.key"
    munged --socket="$dir/munge/munge.socket" --key-file="$dir/key/munge.key" \
      --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
      --seed-file="$dir/key/munged.seed" || { dump_logs; stop_daemons; rm -rf "$dir"; exit 1; }

    node="$(hostname -s)"
    # This host's CPUs and memory as slurmd sees them; the node's line copies them.
    hw="$(slurmd -C 2>/dev/null | head -n 1)"
    cpus="$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")"
    memory="$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")"
    [ -n "$cpus" ] && [ -n "$memory" ] || { say "slurmd -C said: '$hw'"; stop_daemons; exit 1; }
    ctld_port="$(free_port)" && slurmd_port="$(free_port)" || { say "no free port"; stop_daemons; exit 1; }
    conf="$dir/slurm.conf"
    cat >"$conf" <<EOF
# A one-node cluster for baton's tests (tests/slurm/cluster.sh): $(date -u +%FT%TZ)
ClusterName=baton-test
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# Short timers: a killed step is reaped in seconds, not minutes.
KillWait=5
MessageTimeout=10
SlurmdTimeout=60
InactiveLimit=0
PlugStackConfig=$dir/plugstack.conf
NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$node CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=baton Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    : >"$dir/plugstack.conf"
    export SLURM_CONF="$conf"
    slurmctld -f "$conf" -i || { say "slurmctld did not start"; dump_logs; stop_daemons; rm -rf "$dir"; exit 1; }
    slurmd -f "$conf" -N "$node" || { say "slurmd did not start"; dump_logs; stop_daemons; rm -rf "$dir"; exit 1; }
    # The node is idle once slurmd has registered with slurmctld: a second or two.
    idle=""
    for i in $(seq 1 300); do
      st="$(sinfo -h -N -o '%T' 2>/dev/null | head -n 1)"
      if [ "$st" = idle ]; then idle=1; break; fi
      sleep 0.1
    done
    if [ -z "$idle" ]; then
      say "the node did not become idle within 30 s (sinfo: '${st:-nothing}')"
      dump_logs
      stop_daemons
      rm -rf "$dir"
      exit 1
    fi
    # And it runs a job step: the path every test takes (munge, slurmctld, slurmd, slurmstepd).
    if ! probe="$(timeout 60 srun -n 1 -J baton-probe true 2>&1)"; then
      say "srun -n 1 true failed on the idle node: $probe"
      dump_logs
      stop_daemons
      rm -rf "$dir"
      exit 1
    fi
    printf 'SLURM_CONF=%s\ndir=%s\n' "$conf" "$dir" >"$state_file"
    say "up: node $node ($cpus CPUs, $memory MiB), slurmctld on port $ctld_port, slurmd on $slurmd_port, in $dir"
    ;;
  stop)
    [ -f "$state_file" ] || exit 0
    dir="$(sed -n 's/^dir=//p' "$state_file")"
    if [ -n "$dir" ] && [ -d "$dir" ]; then
      cancel_jobs
      stop_daemons
      rm -rf "$dir"
      say "stopped; removed $dir"
    fi
    rm -f "$state_file"
    ;;
  *)
    echo "usage: cluster.sh start|stop STATE_FILE" >&2
    exit 2
    ;;
esac
