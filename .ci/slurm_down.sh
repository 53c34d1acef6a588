#!/usr/bin/env bash
# Stop what .ci/slurm_up.sh started: cancel jobs, stop slurmd, slurmctld and munged.
set -uo pipefail
STATE=${SLURM_CI_STATE:-/var/lib/realscale-slurm}
# cancel jobs only while a controller runs (scancel would retry an absent one for ~20 s)
if [ -s "$STATE/slurmctld.pid" ] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; then
  timeout 10 scancel --full --quiet --user root 2>/dev/null || true
fi
stop() {  # stop one daemon by its pid file, waiting for it to go
  local pidfile=$1
  [ -s "$pidfile" ] || return 0
  local pid; pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}
stop "$STATE/slurmd.pid"
stop "$STATE/slurmctld.pid"
stop /run/munge/munged.pid
echo "slurm down"
