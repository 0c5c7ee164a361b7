#!/usr/bin/env bash
# Stop the throwaway Slurm testbed started by start.sh.
#   stop.sh [STATE_DIR]        (default: $FSDP_BENCH_SLURM_STATE_DIR or /tmp/fsdp-bench-slurm)
# Idempotent: exits 0 when nothing is running. Keeps STATE_DIR (logs, job state, database).
# Only processes of this testbed are touched: pids from our pid files, processes inside
# the nodes' UTS namespaces recorded at start, and processes carrying our env marker.
set -euo pipefail

STATE_DIR=${1:-${FSDP_BENCH_SLURM_STATE_DIR:-/tmp/fsdp-bench-slurm}}
if [ -d "$STATE_DIR" ]; then
    STATE_DIR=$(cd "$STATE_DIR" && pwd -P)
else
    STATE_DIR=$(realpath -m -- "$STATE_DIR")
fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

if [ ! -d "$STATE_DIR" ]; then
    # STATE_DIR was deleted under a running cluster: pid files are gone, but the daemons
    # still carry the marker naming it.
    mapfile -t left < <(marker_pids)
    if [ "${#left[@]}" -gt 0 ]; then
        log "stop.sh: $STATE_DIR is gone; killing its daemons: ${left[*]}"
        KILL_GRACE=3 kill_pids "${left[@]}"
    fi
    exit 0
fi

take_lock
t0=$(now)

# Clients must not see a half-stopped cluster as ready.
rm -f "$ENV_FILE"

# 1. Cancel every job while slurmctld is still up: killing slurmd alone leaves
#    slurmstepd/srun/tasks behind, and the job would be recovered at next start.
if live_pid "$PID_SLURMCTLD" >/dev/null && [ -f "$SLURM_CONF_FILE" ]; then
    export SLURM_CONF="$SLURM_CONF_FILE"
    if jobs=$(timeout 10 squeue -h -o %A 2>/dev/null) && [ -n "$jobs" ]; then
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs 2>/dev/null || true
        # Give the nodes KillWait (2 s) + epilog time to clean up; bounded.
        for ((i = 0; i < 100; i++)); do
            left=$(timeout 5 squeue -h -o %A 2>/dev/null) || break
            [ -z "$left" ] && break
            sleep 0.1
        done
    fi
fi

# 2. Daemons by pid file, in dependency order.
stop_pidfile() {
    local f=$1 pid
    if pid=$(live_pid "$f"); then
        KILL_GRACE=${2:-10} kill_pids "$pid"
    fi
    rm -f "$f"
}
stop_pidfile "$PID_SLURMCTLD"
for n in "${NODES[@]}"; do stop_pidfile "$(pid_slurmd "$n")"; done
stop_pidfile "$PID_SLURMDBD"
stop_pidfile "$PID_MARIADB" 30 # InnoDB shutdown may take a few seconds
stop_pidfile "$PID_MUNGED"

# 3. Leftovers: job processes still in the nodes' namespaces (an orphaned srun was
#    seen ignoring SIGTERM, hence the KILL fallback), then anything with our marker.
left=()
for n in "${NODES[@]}"; do
    mapfile -t -O "${#left[@]}" left < <(node_ns_pids "$n")
done
mapfile -t -O "${#left[@]}" left < <(marker_pids)
if [ "${#left[@]}" -gt 0 ]; then
    mapfile -t left < <(printf '%s\n' "${left[@]}" | sort -un)
    log "stop.sh: killing leftover testbed processes: ${left[*]}"
    KILL_GRACE=3 kill_pids "${left[@]}"
fi
for n in "${NODES[@]}"; do rm -f "$(uts_file "$n")"; done
rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock" "$MYSQL_SOCK" "$RUN/fingerprint"

echo "slurm testbed stopped ($STATE_DIR) in $(elapsed "$t0") s"
