#!/usr/bin/env bash
# A real single-node Slurm on this Debian 12 machine, for developers and CI (P4, issue 5): munge, MariaDB,
# slurmdbd (so `sacct` reports failed jobs as FAILED), slurmctld and slurmd, started by hand (no systemd) and
# stopped by PID. Needs root and apt; installs the Debian packages (--no-install-recommends) when missing.
#
#   sudo tools/local_slurm.sh up       # install if needed, write the configs, start what is not running; idempotent
#   sudo tools/local_slurm.sh status   # each daemon's PID and state, then sinfo; exit 0 only if all run
#   sudo tools/local_slurm.sh down     # cancel the cluster's jobs, stop the daemons it started (by PID)
#   tools/local_slurm.sh can           # exit 0 if `up` can work here (root + apt-get), else print why, exit 1
#
# Cluster: ClusterName=fp4moe, one node `localhost` with NODE_CPUS CPUs (default max(nproc, 8): the tests' jobs
# mostly sleep or wait, so they may share cores; SlurmdParameters=config_overrides), partition `debug` (no limit),
# DefMemPerCPU=512 MB, EnforcePartLimits=ALL (an impossible request fails at submit time instead of pending
# forever), AuthInfo=cred_expire=5 and sched_interval=bf_interval=2 (a requeued job starts again after ~7 s, not
# ~2 min). Settings apply when the daemons start: `down` then `up` after changing them. The PIDs live in STATE (default /tmp/fp4moe-slurm, one <daemon>.pid each); logs in /var/log/slurm.
# What each setting guards against: docs/slurm.md, "A Slurm on one Debian machine". It writes
# /etc/slurm/slurm.conf and slurmdbd.conf and refuses to replace ones it did not write.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

STATE=${FP4MOE_SLURM_STATE:-/tmp/fp4moe-slurm}
NODE_CPUS=${NODE_CPUS:-$(( $(nproc) > 8 ? $(nproc) : 8 ))}
CLUSTER=fp4moe
MARK="# written by fp4moe tools/local_slurm.sh"
PACKAGES="munge slurm-client slurmctld slurmd slurmdbd mariadb-server"
DAEMONS="munged mariadbd slurmdbd slurmctld slurmd"   # start order; stopped in reverse
DB_PASS=fp4moe-local   # the local MariaDB user `slurm`, bound to 127.0.0.1 only

log() { echo "[local_slurm $(date +%T)] $*"; }
die() { echo "local_slurm: $*" >&2; exit 1; }

wait_for() {  # wait_for <seconds> <cmd...>: poll every 0.2 s, bounded
  local n=$(( $1 * 5 )); shift
  for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "local_slurm: timed out waiting for: $*" >&2; return 1
}

can_run() {  # why `up` cannot work here, or nothing
  [ "$(id -u)" = 0 ] || { echo "not root (uid $(id -u))"; return; }
  command -v apt-get >/dev/null || { echo "no apt-get (not Debian/Ubuntu)"; return; }
  [ -r /etc/debian_version ] || echo "no /etc/debian_version"
}

# ------------------------------------------------------------------------------------------ PIDs

pid_of() { cat "$STATE/$1.pid" 2>/dev/null || true; }

alive() {  # alive <daemon>: its recorded PID runs and is that program (not a reused PID)
  local pid; pid=$(pid_of "$1")
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$1" ]
}

record() {  # record <daemon> <pidfile>: copy the daemon's own pidfile into STATE once it appears
  wait_for 30 test -s "$2" || die "$1 did not write $2; see /var/log/slurm/"
  cp "$2" "$STATE/$1.pid"
  wait_for 5 alive "$1" || die "$1 (pid $(pid_of "$1")) exited at start; see /var/log/slurm/"
}

none_running() { local p; for p in "$@"; do kill -0 "$p" 2>/dev/null && return 1; done; return 0; }

stop() {  # stop <daemon>...: SIGTERM to each recorded PID (only), wait up to 15 s for all, then SIGKILL
  local pids="" d pid
  for d in "$@"; do
    if alive "$d"; then pid=$(pid_of "$d"); kill "$pid"; pids="$pids $pid"; log "stopping $d ($pid)"; fi
    rm -f "$STATE/$d.pid"
  done
  [ -n "$pids" ] || return 0
  wait_for 15 none_running $pids || kill -9 $pids 2>/dev/null || true
}

# ------------------------------------------------------------------------------------------ install, configs

install_packages() {
  local missing=""
  for p in $PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
  [ -z "$missing" ] && return
  log "apt-get install --no-install-recommends$missing"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
}

write_conf() {  # write_conf <path> <owner> <mode>, text on stdin; refuses to replace a file it did not write
  local text; text=$(cat)
  if [ -e "$1" ] && ! grep -qF "$MARK" "$1"; then
    die "$1 exists and was not written by this tool; move it away first"
  fi
  printf '%s\n%s\n' "$MARK" "$text" > "$1.tmp"
  chown "$2" "$1.tmp"; chmod "$3" "$1.tmp"; mv "$1.tmp" "$1"
}

write_configs() {
  local mem; mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  install -d -m 0755 /etc/slurm
  write_conf /etc/slurm/slurm.conf root:root 0644 <<CONF
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobRequeue=1
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=512
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
ReturnToService=2
MailProg=/bin/true
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=localhost CPUs=$NODE_CPUS RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  write_conf /etc/slurm/slurmdbd.conf slurm:slurm 0600 <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=slurm
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
CONF
  install -d -o slurm -g slurm -m 0755 /var/spool/slurmctld /var/log/slurm
  install -d -m 0755 /var/spool/slurmd
}

# ------------------------------------------------------------------------------------------ daemons

start_munged() {
  [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey -c
  install -d -o munge -g munge -m 0755 /run/munge   # systemd's RuntimeDirectory would make it
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged
  record munged /run/munge/munged.pid
  munge -n | unmunge >/dev/null
}

start_mariadbd() {
  install -d -o mysql -g mysql -m 0755 /run/mysqld
  setsid /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 --innodb-buffer-pool-size=64M \
    >> /var/log/slurm/mariadb.log 2>&1 < /dev/null &
  echo $! > "$STATE/mariadbd.pid"
  wait_for 30 mariadb-admin ping || die "mariadbd did not answer; see /var/log/slurm/mariadb.log"
  mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
}

start_slurmdbd() {
  rm -f /run/slurmdbd.pid
  /usr/sbin/slurmdbd
  record slurmdbd /run/slurmdbd.pid
  wait_for 30 sacctmgr -n list cluster || die "slurmdbd does not answer; see /var/log/slurm/slurmdbd.log"
  # `sacctmgr add cluster` fails when the cluster exists: add it only once
  sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
}

start_slurmctld() {
  rm -f /run/slurmctld.pid   # SIGTERM leaves it behind
  /usr/sbin/slurmctld
  record slurmctld /run/slurmctld.pid
}

start_slurmd() {
  rm -f /run/slurmd.pid
  /usr/sbin/slurmd -N localhost
  record slurmd /run/slurmd.pid
}

node_ready() { sinfo -h -n localhost -o %T | grep -qE '^(idle|mixed|allocated)$'; }

cmd_up() {
  local why; why=$(can_run)
  [ -z "$why" ] || die "cannot start Slurm here: $why"
  mkdir -p "$STATE"
  install_packages
  local started=""
  for d in $DAEMONS; do
    if alive "$d"; then continue; fi
    [ -n "$started" ] || write_configs   # configs only change while a daemon restarts
    log "starting $d"
    "start_$d"
    started="$started $d"
  done
  wait_for 60 node_ready || die "node localhost is not idle: $(sinfo -h -n localhost -o '%T %E')"
  log "up${started:+ (started$started)}: $(sinfo -h -o '%P %a %D %T %N') cpus=$NODE_CPUS"
}

cmd_down() {
  if alive slurmctld; then   # a job left running would outlive slurmd
    local jobs; jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "${jobs// }" ]; then
      log "scancel $jobs"; scancel $jobs || true
      wait_for 20 sh -c '[ -z "$(squeue -h -o %A)" ]' || true
    fi
  fi
  stop slurmd slurmctld             # the daemons stop in parallel (about 2 s each): the Slurm pair first,
  stop slurmdbd mariadbd munged     # then accounting and authentication
  rm -f /run/slurmctld.pid /run/slurmd.pid /run/slurmdbd.pid   # stale pidfiles break apt's prerm
  log "down"
}

cmd_status() {
  local ok=0
  for d in $DAEMONS; do
    if alive "$d"; then echo "$d running (pid $(pid_of "$d"))"; else echo "$d not running"; ok=1; fi
  done
  if [ "$ok" = 0 ]; then sinfo; fi
  return "$ok"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  can) why=$(can_run); if [ -n "$why" ]; then echo "$why"; exit 1; fi ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac
