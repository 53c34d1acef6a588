#!/usr/bin/env bash
# A real N-node Slurm cluster on this one machine, for the multi-node tests: each node is a
# network namespace + UTS namespace (own hostname, own address on a private bridge) with
# one `slurmd -N rs-nodeI` inside; slurmctld runs in a namespace of its own (rs-ctl); one
# munged (its own socket, under the state directory) serves them all through the shared
# filesystem. Layout and addresses: .ci/cluster_lib.sh.
#
#   bash .ci/cluster_up.sh 2                       # N = 1..9 (tested 1..4)
#   export SLURM_CONF=/var/lib/realscale-cluster/slurm.conf   # or: . /var/lib/realscale-cluster/env
#   sinfo; srun -N2 hostname; sbatch --wait job.sh
#   bash .ci/cluster_node.sh kill rs-node2         # the node-lost fault (see that file)
#   bash .ci/cluster_down.sh
#
# Idempotent: a second call tears the cluster down and builds it again with a fresh config
# and empty state. On any failure it tears down what it made (logs stay under the state
# directory) and exits 1. Where namespaces or Slurm are unavailable it prints one line
# "cluster unavailable: REASON" on stderr and exits 3, so that tests can skip saying why.
#
# Environment: RS_CLUSTER_CPUS (CPUs each node declares; default the machine's CPU count,
# so N nodes oversubscribe the real cores N times), RS_CLUSTER_STATE (state directory),
# RS_CLUSTER_NET (the private /24; default 10.211.0), RS_CLUSTER_SLURMD_TIMEOUT and
# RS_CLUSTER_MESSAGE_TIMEOUT (Slurm's SlurmdTimeout and MessageTimeout; default 4 and 3 s:
# a killed node is marked DOWN 7-12 s after its death here, where Slurm's defaults, 300
# and 10 s, would take minutes).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source-path=SCRIPTDIR
. "$here/cluster_lib.sh"

unavailable() { echo "cluster unavailable: $*" >&2; exit 3; }

n=${1:-2}
if ! [[ $n =~ ^[1-9]$ ]]; then
  echo "usage: $0 N   (N nodes, 1..$RS_MAX_NODES)" >&2
  exit 2
fi
cpus=${RS_CLUSTER_CPUS:-$(nproc)}
slurmd_timeout=${RS_CLUSTER_SLURMD_TIMEOUT:-4}
message_timeout=${RS_CLUSTER_MESSAGE_TIMEOUT:-3}
for v in cpus slurmd_timeout message_timeout; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "$0: $v must be a positive integer, not '${!v}'" >&2; exit 2; }
done
start_ns=$(date +%s%N)

# --- can this machine do it? ------------------------------------------------------------
[ "$(id -u)" = 0 ] || unavailable "needs root (network namespaces, bridge, daemons as root)"
for tool in ip unshare nsenter flock; do
  command -v "$tool" >/dev/null || unavailable "no '$tool' command (iproute2 / util-linux)"
done
[ -w /etc/hosts ] || unavailable "/etc/hosts is not writable (the nodes' names go there)"
rs_lock   # before the probe too: its bridge has a fixed name
probe_ns=rs-probe$$
probe() {  # a namespace, a bridge, a veth pair into the namespace, a UTS namespace
  ip netns add "$probe_ns" 2>/dev/null || { echo "cannot create a network namespace (ip netns add)"; return 1; }
  ip link add rs-probe-br type bridge 2>/dev/null || { echo "cannot create a bridge (ip link add type bridge)"; return 1; }
  ip link add rs-probe-v type veth peer name rs-probe-p netns "$probe_ns" 2>/dev/null \
    || { echo "cannot create a veth pair into a namespace"; return 1; }
  unshare --uts true 2>/dev/null || { echo "cannot create a UTS namespace (unshare --uts)"; return 1; }
}
probe_cleanup() {
  ip link del rs-probe-v 2>/dev/null || true
  ip link del rs-probe-br 2>/dev/null || true
  ip netns del "$probe_ns" 2>/dev/null || true
}
if ! why=$(probe); then probe_cleanup; unavailable "$why"; fi
probe_cleanup
if [[ ! $RS_NET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "$0: RS_CLUSTER_NET must be the first three numbers of a /24, like 10.211.0" >&2; exit 2
fi
# the subnet must be ours alone: no other interface of the machine may sit in it
clash=$(ip -o -4 addr show | awk -v br="$RS_BRIDGE" -v net="$RS_NET." '$2 != br && index($4, net) == 1 {print $2 " " $4}')
[ -z "$clash" ] || unavailable "$RS_NET.0/24 is in use on this machine ($clash); choose another with RS_CLUSTER_NET"

# Slurm and munge from Debian's packages, as .ci/slurm_up.sh installs them
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
   || ! command -v sbatch >/dev/null; then
  command -v apt-get >/dev/null || unavailable "Slurm is not installed and there is no apt-get to install it"
  export DEBIAN_FRONTEND=noninteractive
  # policy-rc.d 101: the packages must not start daemons through init scripts (we start
  # them below); an existing policy (container images often ship one) is left alone
  own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && own_policy=1
  fi
  installed=1
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge; } \
    >/dev/null 2>&1 || installed=0
  [ "$own_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ "$installed" = 1 ] || unavailable "could not install slurmctld slurmd slurm-client munge with apt-get"
fi
for tool in slurmctld slurmd munged sbatch srun sinfo scontrol; do
  command -v "$tool" >/dev/null || unavailable "no '$tool' command after installing Slurm and munge"
done

# --- from here on, a failure tears down what was made -----------------------------------
bash "$here/cluster_down.sh" >/dev/null 2>&1 || true
up=0
# shellcheck disable=SC2329  # (run by the EXIT trap)
on_exit() {
  local rc=$?
  [ "$up" = 1 ] && return 0
  echo "cluster did not come up (exit $rc); logs under $RS_STATE/log:" >&2
  tail -n 15 "$RS_STATE"/log/*.log >&2 2>/dev/null || true
  bash "$here/cluster_down.sh" >/dev/null 2>&1 || true
}
trap on_exit EXIT
trap 'exit 130' INT TERM

rm -rf "${RS_STATE:?}"/{ctld,spool,run,log,munge} "$RS_CONF" "$RS_STATE/env"
mkdir -p "$RS_STATE"/{ctld,spool,run,log,munge} "$RS_RUN/uts"
chmod 0755 "$RS_STATE" "$RS_STATE/log"
chmod 0711 "$RS_STATE/munge"   # munged: clients need execute on the socket's directory

# network: the bridge (host side .1), the controller's namespace, one per node
ip link add "$RS_BRIDGE" type bridge
ip addr add "$RS_HOST_IP/24" dev "$RS_BRIDGE"
ip link set "$RS_BRIDGE" up
rs_make_ns "$RS_CTL" "$RS_CTL_IP"
for i in $(seq 1 "$n"); do
  rs_make_ns "$(rs_node_name "$i")" "$(rs_node_ip "$i")"
done

# names: every node resolves every other (and the controller) through /etc/hosts; rs-host
# is the root namespace's end of the bridge (a service a test starts outside the nodes must
# listen there, or on 0.0.0.0, to be reachable from them: a node's 127.0.0.1 is its own)
rs_hosts_remove
{
  echo "$RS_HOST_IP $RS_HOST $RS_HOSTS_MARK"
  echo "$RS_CTL_IP $RS_CTL $RS_HOSTS_MARK"
  for i in $(seq 1 "$n"); do echo "$(rs_node_ip "$i") $(rs_node_name "$i") $RS_HOSTS_MARK"; done
} >> /etc/hosts

# munge: one munged for the whole cluster; its socket is a path, so it serves every namespace
dd if=/dev/urandom bs=1 count=1024 of="$RS_STATE/munge/munge.key" status=none
chmod 0400 "$RS_STATE/munge/munge.key"
munged --force --socket="$RS_MUNGE_SOCKET" --key-file="$RS_STATE/munge/munge.key" \
  --pid-file="$RS_STATE/munge/munged.pid" --log-file="$RS_STATE/log/munged.log" \
  --seed-file="$RS_STATE/munge/munged.seed" 9<&-

# memory is shared by the nodes: each declares its share (not a consumable with CR_Core)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) * 90 / 100 / 1024 / n ))
[ "$mem_mb" -ge 1 ] || mem_mb=1
nodes="rs-node[1-$n]"; [ "$n" = 1 ] && nodes=rs-node1
cat > "$RS_CONF" <<CONF
# written by .ci/cluster_up.sh: $n nodes, each a network + UTS namespace on $RS_BRIDGE
# ($RS_NET.0/24); root runs everything, no accounting database
ClusterName=realscale-mn
SlurmctldHost=$RS_CTL($RS_CTL_IP)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# the cluster's own munged (socket under the state directory); a requeued job waits
# cred_expire seconds before it may start again (default 120 s: too slow for CI)
AuthInfo=socket=$RS_MUNGE_SOCKET,cred_expire=5
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
# one slurmd per node, all on one filesystem: pid, log and spool per node name
SlurmctldPidFile=$RS_STATE/run/slurmctld.pid
SlurmdPidFile=$RS_STATE/run/slurmd.%n.pid
StateSaveLocation=$RS_STATE/ctld
SlurmdSpoolDir=$RS_STATE/spool/%n
SlurmctldLogFile=$RS_STATE/log/slurmctld.log
SlurmdLogFile=$RS_STATE/log/slurmd.%n.log
SlurmctldPort=6817
SlurmdPort=6818
# every node runs on the same CPUs: it reports the CPUs and memory declared below, not
# what it detects (the nodes oversubscribe the real cores, on purpose)
SlurmdParameters=config_overrides
# the node-lost fault in CI time: the controller pings a node every SlurmdTimeout/3 s (a
# ping gives up after MessageTimeout) and marks it DOWN once its last answer is older
# than SlurmdTimeout at a ping round (measured: 7-12 s after a kill with 4 / 3)
SlurmdTimeout=$slurmd_timeout
MessageTimeout=$message_timeout
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=5
UnkillableStepTimeout=30
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
CONF
for i in $(seq 1 "$n"); do
  echo "NodeName=$(rs_node_name "$i") NodeAddr=$(rs_node_ip "$i") NodeHostname=$(rs_node_name "$i") CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN" >> "$RS_CONF"
done
echo "PartitionName=ci Nodes=$nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >> "$RS_CONF"
cat > "$RS_STATE/env" <<ENV
# source me: the clients (sinfo, sbatch, srun, scontrol) then talk to this cluster
export SLURM_CONF=$RS_CONF
ENV

# daemons: the controller in its namespace, one slurmd per node in the node's namespaces
rs_in "$RS_CTL" slurmctld -i -f "$RS_CONF"
for i in $(seq 1 "$n"); do
  rs_start_slurmd "$(rs_node_name "$i")"
done

export SLURM_CONF=$RS_CONF
for _ in $(seq 1 300); do
  idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | wc -l)
  if [ "$idle" = "$n" ]; then
    up=1
    took_ds=$(( ($(date +%s%N) - start_ns) / 100000000 ))
    echo "cluster up in $((took_ds / 10)).$((took_ds % 10)) s: $n node(s) $nodes (CPUs=$cpus, RealMemory=$mem_mb MiB each)," \
         "controller $RS_CTL $RS_CTL_IP, bridge $RS_BRIDGE $RS_HOST_IP; export SLURM_CONF=$RS_CONF"
    exit 0
  fi
  sleep 0.1
done
echo "not all $n nodes became idle in 30 s:" >&2
sinfo -N -o '%N %t %E' >&2 2>/dev/null || true
exit 1
