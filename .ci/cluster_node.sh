#!/usr/bin/env bash
# Faults and access for one node of the cluster of .ci/cluster_up.sh.
#
#   bash .ci/cluster_node.sh kill  rs-node2      # node lost: SIGKILL its slurmd, its steps and
#                                                # every task inside its namespace; Slurm marks
#                                                # it DOWN after SlurmdTimeout (and requeues or
#                                                # fails the jobs that ran on it)
#   bash .ci/cluster_node.sh start rs-node2      # its slurmd again; ReturnToService=2 makes it idle
#   bash .ci/cluster_node.sh cut   rs-node2      # network partition: its link goes down, its
#                                                # processes keep running (and hang on peers)
#   bash .ci/cluster_node.sh heal  rs-node2      # the link comes back
#   bash .ci/cluster_node.sh exec  rs-node2 CMD  # run CMD inside the node (its net + UTS namespaces)
#   bash .ci/cluster_node.sh pids  rs-node2      # the processes inside the node
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
. "$(dirname "$0")/cluster_lib.sh"

usage() { echo "usage: $0 kill|start|cut|heal|pids|exec NODE [CMD...]" >&2; exit 2; }
[ $# -ge 2 ] || usage
action=$1 node=$2; shift 2
rs_node_index "$node" >/dev/null
[ -e "/run/netns/$node" ] || { echo "no such node (is the cluster up?): $node" >&2; exit 1; }

case $action in
  kill)
    count=$(ip netns pids "$node" | wc -l)
    rs_kill_ns_procs "$node"
    rm -f "$RS_STATE/run/slurmd.$node.pid"
    echo "$node: killed $count process(es)"
    ;;
  start)
    if [ -s "$RS_STATE/run/slurmd.$node.pid" ] && kill -0 "$(cat "$RS_STATE/run/slurmd.$node.pid")" 2>/dev/null; then
      echo "$node: slurmd already running"
    else
      rs_start_slurmd "$node"
      echo "$node: slurmd started"
    fi
    ;;
  cut)  ip link set "$(rs_host_veth "$node")" down; echo "$node: link down" ;;
  heal) ip link set "$(rs_host_veth "$node")" up; echo "$node: link up" ;;
  pids) ip netns pids "$node" ;;
  exec) [ $# -ge 1 ] || usage; rs_in "$node" "$@" ;;
  *) usage ;;
esac
