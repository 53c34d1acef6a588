# shellcheck shell=bash disable=SC2034  # (the variables are used by the scripts that source this)
# Shared by .ci/cluster_up.sh, .ci/cluster_down.sh and .ci/cluster_node.sh (sourced, not run).
#
# The multi-node cluster: every node is a network namespace (ip netns) with its own UTS
# namespace (its own `hostname`), its own address on a private bridge, and one slurmd
# started inside both. The controller gets a namespace of its own the same way, so this
# cluster can run beside the one-node cluster of .ci/slurm_up.sh (ports 6817/6818 in the
# root namespace) without a clash. The PID and mount namespaces and the filesystem stay
# shared, as a cluster shares its storage.
#
#   bridge  rs-br0       10.211.0.1/24   rs-host: the root namespace (sinfo, sbatch, srun run here)
#   rs-ctl               10.211.0.2      slurmctld
#   rs-node1 .. rs-nodeN 10.211.0.11 ..  slurmd -N rs-nodeI
#
# No namespace has a default route, so a node reaches only this /24 (the other nodes, the
# controller and the root namespace's end of the bridge); nothing else routes to it.

export PATH=$PATH:/usr/sbin:/sbin   # ip, slurmd, slurmctld, munged live there; some shells lack it

RS_STATE=${RS_CLUSTER_STATE:-/var/lib/realscale-cluster}   # config, spool, state, logs
RS_RUN=/run/realscale-cluster                              # persistent UTS namespaces
RS_CONF=$RS_STATE/slurm.conf
RS_BRIDGE=rs-br0
RS_NET=${RS_CLUSTER_NET:-10.211.0}   # a /24 used only by these namespaces and the bridge
RS_HOST=rs-host                # the root namespace, as the nodes see it
RS_HOST_IP=$RS_NET.1
RS_CTL=rs-ctl
RS_CTL_IP=$RS_NET.2
RS_IFNAME=rs0                  # the node's interface inside its namespace (GLOO_SOCKET_IFNAME)
RS_HOSTS_MARK="# realscale-cluster (.ci/cluster_up.sh)"
RS_MUNGE_SOCKET=$RS_STATE/munge/munge.socket
RS_MAX_NODES=9

rs_node_name() { echo "rs-node$1"; }
rs_node_ip() { echo "$RS_NET.$((10 + $1))"; }
rs_node_index() {  # rs-node3 -> 3
  local n=${1#rs-node}
  [[ $n =~ ^[1-9]$ ]] || { echo "not a node of this cluster: $1" >&2; return 1; }
  echo "$n"
}
# the host end of the veth pair of a namespace: rs-v-ctl, rs-v1, rs-v2, ...
rs_host_veth() { if [ "$1" = "$RS_CTL" ]; then echo rs-v-ctl; else echo "rs-v$(rs_node_index "$1")"; fi; }

# the namespaces of this cluster that exist now
rs_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^rs-(ctl|node[0-9]+)$' || true; }

# Run a command inside a node: its network namespace and its UTS namespace (hostname).
# nsenter, not `ip netns exec`: that one also makes a mount namespace and remounts /sys,
# which hides /sys/fs/cgroup, and slurmd will not start without it. So the mount namespace
# stays the host's (as a cluster shares its storage), and /sys/class/net inside a node
# lists the host's interfaces; `ip link` (netlink) and getifaddrs() show the node's own.
rs_in() {
  local ns=$1; shift
  nsenter --net="/run/netns/$ns" --uts="$RS_RUN/uts/$ns" -- "$@" 9<&-   # not the lock (rs_lock)
}

# Create namespace $1 with address $2: veth pair, host end on the bridge, the other end
# moved into the namespace and named $RS_IFNAME; a persistent UTS namespace whose
# hostname is the namespace's name.
rs_make_ns() {
  local ns=$1 ip=$2 hv; hv=$(rs_host_veth "$ns")
  ip netns add "$ns"
  ip link add "$hv" type veth peer name "$RS_IFNAME" netns "$ns"
  ip link set "$hv" master "$RS_BRIDGE" up
  ip -n "$ns" addr add "$ip/24" dev "$RS_IFNAME"
  ip -n "$ns" link set "$RS_IFNAME" up
  ip -n "$ns" link set lo up
  mkdir -p "$RS_RUN/uts"
  : > "$RS_RUN/uts/$ns"
  unshare --uts="$RS_RUN/uts/$ns" hostname "$ns"
}

# Kill every process inside namespace $1 (daemons and the job tasks they started), then
# wait for them to go.
rs_kill_ns_procs() {
  local ns=$1 pids
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [ -n "$pids" ] || return 0
  # shellcheck disable=SC2086
  kill -9 $pids 2>/dev/null || true
  for _ in $(seq 1 50); do
    [ -z "$(ip netns pids "$ns" 2>/dev/null || true)" ] && return 0
    sleep 0.1
  done
}

rs_start_slurmd() {  # slurmd for node $1, inside its namespaces
  local node=$1
  mkdir -p "$RS_STATE/spool/$node"
  rs_in "$node" slurmd -N "$node" -f "$RS_CONF"
}

# Stop daemons of this cluster by pid file, all at once: TERM, wait up to 3 s for all, then
# KILL the rest (slurmd takes seconds to exit on TERM; the state it would save is wiped
# anyway). A pid whose command line does not name the state directory is not ours (a
# stale pid file, the pid reused since) and is left alone.
rs_stop_pidfiles() {
  local f pid pids=()
  for f in "$@"; do
    [ -s "$f" ] || continue
    pid=$(cat "$f"); rm -f "$f"
    [[ $pid =~ ^[0-9]+$ ]] || continue
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF "$RS_STATE/" || continue
    kill "$pid" 2>/dev/null && pids+=("$pid")
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  for _ in $(seq 1 30); do
    kill -0 "${pids[@]}" 2>/dev/null || return 0   # true while any of them lives
    sleep 0.1
  done
  kill -9 "${pids[@]}" 2>/dev/null || true
}

# One cluster_up / cluster_down at a time: a lock on this file (fd 9, released when the
# process ends; no lock file to leave behind). cluster_up's own call of cluster_down inherits it;
# the daemons must not (they would hold it for their life): start them with 9<&-.
rs_lock() {
  [ "${RS_CLUSTER_LOCKED:-}" = 1 ] && return 0
  exec 9<"${BASH_SOURCE[0]}"
  flock -w 120 9 || { echo "another cluster_up/cluster_down runs (lock on ${BASH_SOURCE[0]})" >&2; exit 1; }
  export RS_CLUSTER_LOCKED=1
}

# /etc/hosts may be a bind mount (containers): rewrite it in place, never rename over it.
rs_hosts_remove() {
  [ -w /etc/hosts ] || return 0
  grep -qF "$RS_HOSTS_MARK" /etc/hosts || return 0
  local tmp; tmp=$(mktemp)
  grep -vF "$RS_HOSTS_MARK" /etc/hosts > "$tmp" || true
  cat "$tmp" > /etc/hosts
  rm -f "$tmp"
}
