#!/usr/bin/env bash
# A single-node SLURM cluster for the tests, started without systemd (root needed).
#
#   tools/slurm-cluster.sh start DIR   # configure under DIR and start munged, slurmctld, slurmd
#   tools/slurm-cluster.sh stop DIR    # stop the daemons started from DIR
#   tools/slurm-cluster.sh status DIR  # sinfo of the cluster configured under DIR
#
# DIR holds slurm.conf, the state and spool folders, the pid and log files. Clients find the
# cluster through SLURM_CONF=DIR/slurm.conf (`start` prints the export line). Packages
# (Debian): slurmctld slurmd munge slurm-client. The node is this machine, with its real CPU
# count and memory (`slurmd -C`); ProctrackType=proctrack/linuxproc and TaskPlugin=task/none
# need neither cgroups nor systemd. Exit status 3: a prerequisite is missing (the tests then
# skip, naming it).
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [[ -z "$cmd" || -z "$dir" ]]; then
    echo "usage: $0 start|stop|status DIR" >&2
    exit 2
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
conf="$dir/slurm.conf"

missing() { echo "slurm-cluster: $1" >&2; exit 3; }

start() {
    for bin in munged slurmctld slurmd sbatch sinfo scontrol; do
        command -v "$bin" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin" command -v "$bin" >/dev/null 2>&1 \
            || missing "$bin not found: apt-get install slurmctld slurmd munge slurm-client"
    done
    export PATH="$PATH:/usr/sbin"
    [[ $(id -u) -eq 0 ]] || missing "the daemons run as root here (no systemd); run as root"
    mkdir -p "$dir/state" "$dir/spool" "$dir/log"
    # munge: one key per machine; the daemon refuses to run as root without --force.
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        chmod 400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    if ! munge -n >/dev/null 2>&1; then
        munged --force
        for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
        munge -n >/dev/null 2>&1 || missing "munged did not start"
    fi
    local node cpus mem host
    host=$(hostname -s)
    node=$(slurmd -C | head -n 1)
    cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$node")
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
    cat >"$conf" <<CONF
# Written by tools/slurm-cluster.sh: a single-node test cluster.
ClusterName=ttabench
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=2
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    slurmctld -f "$conf"
    slurmd -f "$conf"
    export SLURM_CONF="$conf"
    for _ in $(seq 100); do
        if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "export SLURM_CONF=$conf"
            return 0
        fi
        sleep 0.2
    done
    echo "slurm-cluster: the node did not come up; logs in $dir/log" >&2
    sinfo >&2 || true
    exit 1
}

stop() {
    for name in slurmd slurmctld; do
        local pidfile="$dir/$name.pid"
        if [[ -s "$pidfile" ]]; then
            kill "$(cat "$pidfile")" 2>/dev/null || true
        fi
    done
    for name in slurmd slurmctld; do
        local pidfile="$dir/$name.pid"
        for _ in $(seq 50); do
            [[ -s "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null || break
            sleep 0.1
        done
        rm -f "$pidfile"
    done
}

case "$cmd" in
    start) start ;;
    stop) stop ;;
    status) SLURM_CONF="$conf" sinfo ;;
    *) echo "usage: $0 start|stop|status DIR" >&2; exit 2 ;;
esac
