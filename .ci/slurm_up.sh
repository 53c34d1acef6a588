#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for CI (tests/launch/test_slurm_*.py).
#
# Installs Debian's slurmctld / slurmd / slurm-client / munge, writes a slurm.conf for
# this host (its real CPU count and memory), creates a munge key, and starts munged,
# slurmctld and slurmd directly (no systemd: CI containers have none). Idempotent: a
# second call restarts the daemons with a fresh config. Stop with .ci/slurm_down.sh.
#
#   bash .ci/slurm_up.sh            # then: sinfo; sbatch --wait launch/slurm/ppo_tiny.sh
set -euo pipefail

STATE=${SLURM_CI_STATE:-/var/lib/realscale-slurm}   # spool, state and logs of this cluster
CONF_DIR=/etc/slurm

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
   || ! command -v sbatch >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d 101: the packages must not start daemons through init scripts (we start
  # them below); an existing policy (container images often ship one) is left alone
  own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && own_policy=1
  fi
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  [ "$own_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
fi

bash "$(dirname "$0")/slurm_down.sh" >/dev/null 2>&1 || true

host=$(hostname -s)
cpus=$(nproc)
# RealMemory in MiB, a little under the total so that slurmd does not drain the node
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 95 / 100 ))
mkdir -p "$CONF_DIR" "$STATE"/{ctld,d,log} /run/munge /var/log/munge /var/lib/munge /etc/munge

cat > "$CONF_DIR/slurm.conf" <<CONF
# written by .ci/slurm_up.sh: one node, root runs everything, no accounting database
ClusterName=realscale-ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# the scheduling loops run every second: a requeued job starts again within seconds
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
MailProg=/bin/true
ReturnToService=2
# jobs may requeue themselves (scontrol requeue) and are requeued by default; a
# requeued job waits cred_expire seconds before it may start again (default 120 s: too
# slow for CI; clusters keep their own value)
JobRequeue=1
AuthInfo=cred_expire=5
MinJobAge=600
KillWait=5
# the job step that outlives its tasks is reaped quickly (CI wants no hang)
UnkillableStepTimeout=30
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF

if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R root:root /etc/munge /run/munge /var/log/munge /var/lib/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
# munged refuses to run as root unless forced: in CI root is the only user
munged --force

slurmctld -i
slurmd
for _ in $(seq 1 100); do
  if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
    echo "slurm up: node $host, $cpus CPUs, ${mem_mb} MiB (state under $STATE)"
    exit 0
  fi
  sleep 0.1
done
echo "slurm did not come up; logs:" >&2
tail -n 20 "$STATE"/log/*.log >&2 || true
exit 1
