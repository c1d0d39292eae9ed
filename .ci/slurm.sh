#!/usr/bin/env bash
# A one-node SLURM cluster on 127.0.0.1 for test_slurm.py: no systemd, no cgroups, no accounting.
#
#   bash .ci/slurm.sh start   install (apt) if needed, write the config, start munged, slurmctld
#                             and slurmd unless they run, wait until the node is idle
#   bash .ci/slurm.sh stop    stop the three daemons by their pids
#
# Both are safe to repeat. Logs and pid files: /var/lib/slurm-ci.
set -euo pipefail

dir=/var/lib/slurm-ci
host=$(hostname -s)

running() { [[ -f $dir/$1.pid ]] && kill -0 "$(cat "$dir/$1.pid")" 2>/dev/null; }

daemon() {  # name, command...: start it in the background unless it runs, and note its pid
    local name=$1; shift
    running "$name" && return 0
    "$@" >>"$dir/$name.log" 2>&1 &
    echo $! >"$dir/$name.pid"
}

stop() {
    local name pid
    for name in slurmd slurmctld munged; do
        running "$name" || continue
        pid=$(cat "$dir/$name.pid")
        kill -TERM "$pid"
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
        rm -f "$dir/$name.pid"
    done
}

start() {
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
        || ! command -v sbatch >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            slurmctld slurmd slurm-client munge >/dev/null
    fi
    mkdir -p "$dir/state" "$dir/spool" /run/munge
    chown munge:munge /run/munge
    # KillWait: the seconds between SIGTERM and SIGKILL, SLURM's default, in which a job saves its
    # checkpoint. MinJobAge keeps finished jobs in `scontrol show job` (there is no accounting).
    cat >/etc/slurm/slurm.conf <<EOF
ClusterName=ci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.daemon.pid
SlurmdPidFile=$dir/slurmd.daemon.pid
ReturnToService=2
KillWait=30
MinJobAge=3600
NodeName=$host NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    daemon munged setpriv --reuid munge --regid munge --init-groups munged --foreground
    for _ in $(seq 50); do [[ -S /run/munge/munge.socket.2 ]] && break; sleep 0.1; done
    daemon slurmctld slurmctld -D
    daemon slurmd slurmd -D
    for _ in $(seq 300); do
        [[ $(sinfo -h -n "$host" -o %T 2>/dev/null) == idle ]] && return 0
        sleep 0.1
    done
    echo "slurm.sh: error: node $host is not idle after 30 s; see $dir/*.log" >&2
    tail -n 5 "$dir"/*.log >&2
    exit 1
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    *) echo "usage: bash .ci/slurm.sh start|stop" >&2; exit 2 ;;
esac
