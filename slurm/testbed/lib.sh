# Shared helpers for start.sh / stop.sh (sourced, not executed).
# Expects STATE_DIR to be set to an absolute path by the caller.

# Daemons live in /usr/sbin, which may be missing from PATH for some callers.
case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH="$PATH:/usr/sbin" ;; esac
case ":$PATH:" in *:/sbin:*) ;; *) PATH="$PATH:/sbin" ;; esac
export PATH

NODES=(n1 n2)

# Layout of STATE_DIR (see README.md).
ETC="$STATE_DIR/etc"
RUN="$STATE_DIR/run"
LOG="$STATE_DIR/log"
SPOOL="$STATE_DIR/spool"
MUNGE_DIR="$STATE_DIR/munge"           # socket dir; munged insists on mode 0711
MUNGE_SOCK="$MUNGE_DIR/munge.socket"
MYSQL_DATA="$STATE_DIR/mysql/data"
MYSQL_TMP="$STATE_DIR/mysql/tmp"
MYSQL_SOCK="$RUN/mysqld.sock"
SLURM_CONF_FILE="$ETC/slurm.conf"
ENV_FILE="$STATE_DIR/env.sh"

# Every daemon of this testbed is started with this variable in its environment,
# so that stop.sh can recognise our processes (and only ours) without pkill by name.
# It is never exported to clients (env.sh) nor to this shell.
MARKER="FSDP_BENCH_SLURM_TESTBED=$STATE_DIR"

# Pid files, in stop order: slurmctld first (saves state, flushes to slurmdbd),
# then the nodes, the database side, and munge last (everyone authenticates through it).
PID_SLURMCTLD="$RUN/slurmctld.pid"
PID_SLURMDBD="$RUN/slurmdbd.pid"
PID_MARIADB="$RUN/mariadb.pid"
PID_MUNGED="$RUN/munged.pid"
pid_slurmd() { echo "$RUN/slurmd-$1.pid"; }
uts_file() { echo "$RUN/$1.uts"; }

log() { printf '%s %s\n' "$(date +%H:%M:%S.%3N)" "$*" >&2; }

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

# True if PID is a live process started by this testbed (marker in its environment).
is_ours() {
    local pid=$1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [ -r "/proc/$pid/environ" ] || return 1
    # (kernel threads and exiting processes fail the read: not ours)
    { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -xF "$MARKER" >/dev/null # no -q: an early exit would SIGPIPE tr (pipefail)
}

# Prints the pid in a pid file if that process is alive and ours.
live_pid() {
    local f=$1 pid
    [ -s "$f" ] || return 1
    pid=$(tr -dc '0-9' <"$f" 2>/dev/null) || return 1
    is_ours "$pid" || return 1
    echo "$pid"
}

# Processes sharing the recorded UTS namespace of node $1 (slurmd, slurmstepd, job tasks).
# Refuses to match the namespace this script runs in, so a bad record can never
# select the whole machine.
node_ns_pids() {
    local node=$1 f ns mine p
    f=$(uts_file "$node")
    [ -s "$f" ] || return 0
    ns=$(cat "$f")
    mine=$(readlink /proc/self/ns/uts)
    [ -n "$ns" ] && [ "$ns" != "$mine" ] && [ "$ns" != "$(readlink /proc/1/ns/uts 2>/dev/null)" ] || return 0
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/ns/uts" 2>/dev/null)" = "$ns" ] && echo "${p#/proc/}"
    done
    return 0
}

# Every live process carrying our marker, except this script and its ancestors.
marker_pids() {
    local p pid skip a
    skip=" $$ "
    a=$$
    while [ "$a" -gt 1 ] 2>/dev/null; do
        a=$(awk '{print $4}' "/proc/$a/stat" 2>/dev/null) || break
        skip+="$a "
    done
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        case "$skip" in *" $pid "*) continue ;; esac
        is_ours "$pid" && echo "$pid"
    done
    return 0
}

# Send TERM to the given pids, wait up to $KILL_GRACE seconds, then KILL the rest.
kill_pids() {
    local grace=${KILL_GRACE:-10} pids=("$@") alive p i
    [ "${#pids[@]}" -gt 0 ] || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for ((i = 0; i < grace * 10; i++)); do
        alive=()
        for p in "${pids[@]}"; do [ -d "/proc/$p" ] && ! grep -q '^State:.*Z' "/proc/$p/status" 2>/dev/null && alive+=("$p"); done
        [ "${#alive[@]}" -eq 0 ] && return 0
        sleep 0.1
    done
    log "still alive after ${grace}s, sending KILL: ${alive[*]}"
    kill -KILL "${alive[@]}" 2>/dev/null || true
    sleep 0.2
}

# Take the per-STATE_DIR lock (fd 9). start.sh calling stop.sh passes the lock down
# through FSDP_BENCH_SLURM_LOCKED so stop.sh does not wait on its own caller.
take_lock() {
    [ "${FSDP_BENCH_SLURM_LOCKED:-}" = "$STATE_DIR" ] && return 0
    mkdir -p "$STATE_DIR"
    exec 9>"$STATE_DIR/.lock"
    if ! flock -w "${FSDP_BENCH_SLURM_LOCK_TIMEOUT:-300}" 9; then
        echo "ERROR: could not lock $STATE_DIR/.lock (another start.sh/stop.sh running?)" >&2
        exit 1
    fi
    export FSDP_BENCH_SLURM_LOCKED="$STATE_DIR"
}
