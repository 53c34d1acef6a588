#!/usr/bin/env bash
# Remove everything .ci/cluster_up.sh made: jobs, slurmd/slurmctld/munged of this cluster
# and every process inside its namespaces, the namespaces (their veths go with them), the
# bridge, the UTS namespace files and the /etc/hosts lines. Works from any partial state
# (it looks for what exists, by name, not only at pid files). Logs stay under the state
# directory for a post-mortem. The one-node cluster of .ci/slurm_up.sh is left alone.
set -uo pipefail
# shellcheck source-path=SCRIPTDIR
. "$(dirname "$0")/cluster_lib.sh"
rs_lock

# cancel jobs only while the controller runs (scancel would retry an absent one for ~20 s)
if [ -s "$RS_STATE/run/slurmctld.pid" ] && kill -0 "$(cat "$RS_STATE/run/slurmctld.pid")" 2>/dev/null \
   && [ -s "$RS_CONF" ]; then
  SLURM_CONF=$RS_CONF timeout 10 scancel --full --quiet --user root 2>/dev/null || true
fi

# daemons by pid file, then anything left inside the namespaces (steps, tasks)
rs_stop_pidfiles "$RS_STATE"/run/slurmd.*.pid "$RS_STATE/run/slurmctld.pid"
for ns in $(rs_namespaces); do
  rs_kill_ns_procs "$ns"
done
# munged of this cluster only (its own socket and pid file; /run/munge is slurm_up.sh's)
rs_stop_pidfiles "$RS_STATE/munge/munged.pid"

for ns in $(rs_namespaces); do
  ip netns del "$ns" 2>/dev/null || true
done
# host ends of veths whose namespace went some other way
for hv in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^rs-v(-ctl|[0-9]+)$'); do
  ip link del "$hv" 2>/dev/null || true
done
ip link del "$RS_BRIDGE" 2>/dev/null || true

if [ -d "$RS_RUN/uts" ]; then
  for f in "$RS_RUN"/uts/*; do
    [ -e "$f" ] || continue
    umount "$f" 2>/dev/null || umount -l "$f" 2>/dev/null || true
    rm -f "$f"
  done
fi
rm -rf "$RS_RUN"
rs_hosts_remove
echo "cluster down"
