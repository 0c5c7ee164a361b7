#!/usr/bin/env bash
# Install the Debian packages the local Slurm testbed needs (idempotent).
# Fast no-op when every binary is already present.
set -euo pipefail

need=(slurmctld slurmd sbatch sacct munged slurmdbd mariadbd mariadb-install-db)
missing=()
for b in "${need[@]}"; do
    # Daemons live in /usr/sbin, which may be absent from a non-root PATH.
    if ! command -v "$b" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$b" ] && [ ! -x "/usr/bin/$b" ]; then
        missing+=("$b")
    fi
done
[ "${#missing[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: missing ${missing[*]} and not root; install as root:" >&2
    echo "  apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge slurmdbd mariadb-server" >&2
    exit 1
fi

echo "install.sh: missing ${missing[*]}; installing Slurm, munge, slurmdbd, MariaDB" >&2
export DEBIAN_FRONTEND=noninteractive
# Recommends would pull ~40 extra packages (plugins not needed here).
apt-get update -q
# Package post-install scripts try to start services; without systemd that is denied
# and harmless: nothing runs until start.sh starts it.
apt-get install -y -q --no-install-recommends \
    slurmctld slurmd slurm-client munge slurmdbd mariadb-server
