#!/usr/bin/env bash
# A real Slurm on this Debian 12 machine, for developers and CI (P4, issue 5; several nodes: P11, issue 31): munge,
# MariaDB, slurmdbd (so `sacct` reports failed jobs as FAILED), slurmctld and one slurmd per node, started by hand
# (no systemd) and stopped by PID. Needs root and apt; installs the Debian packages (--no-install-recommends) when
# missing.
#
#   sudo tools/local_slurm.sh up       # install if needed, write the configs, start what is not running; idempotent
#   sudo NODES=3 tools/local_slurm.sh up   # three compute nodes, node1..node3, each a host of its own (below; CI's)
#   sudo tools/local_slurm.sh status   # each daemon's PID and state, then sinfo; exit 0 only if all run
#   sudo tools/local_slurm.sh down     # cancel the cluster's jobs, stop the daemons it started (by PID)
#   sudo tools/local_slurm.sh reconfigure   # write the configs of the running cluster again, `scontrol reconfigure`
#   sudo tools/local_slurm.sh node-stop 2   # node2 fails like a host losing power (two nodes or more; below)
#   sudo tools/local_slurm.sh node-start 2  # and comes back: link up, its slurmd again, IDLE; idempotent
#   tools/local_slurm.sh can           # exit 0 if `up` can work here (root + apt-get), else print why, exit 1
#
# Nodes: NODES=1 (default): one node `localhost`. NODES=N (2..9): nodes node1..nodeN, each slurmd in its own network
# namespace (fp4moe-nodeK, address $SUBNET.(10+K) on a veth pair to the bridge fp4moe-br, $SUBNET.1, where
# slurmctld listens) and its own UTS namespace (hostname nodeK), so a job's tasks see N hosts with N addresses;
# /etc/netns/fp4moe-nodeK/hosts names them all (bind-mounted on /etc/hosts in the node's mount namespace). Files
# and PIDs are shared with the host: the munge socket, the job folders. `up` with another NODES than the running
# cluster's refuses: `down` first. SUBNET: $FP4MOE_SLURM_SUBNET, default 10.131.31.
# Cluster: ClusterName=fp4moe, NODE_CPUS CPUs per node (default max(nproc, 8): the tests' jobs mostly sleep or
# wait, so they may share cores; SlurmdParameters=config_overrides), the machine's memory split between two nodes
# (with more nodes each declares that half too: the tests' jobs ask more than they use, and a third node should not
# squeeze them onto the nodes a multi-node test stops),
# partition `debug` (no limit),
# DefMemPerCPU=512 MB, EnforcePartLimits=ALL (an impossible request fails at submit time instead of pending
# forever), AuthInfo=cred_expire=5 and sched_interval=bf_interval=2 (a requeued job starts again after ~7 s, not
# ~2 min). SlurmdTimeout=10 and KillWait=10: a node that stops answering is DOWN within ~10-15 s and its jobs
# NODE_FAIL (default 300 s), and the tasks of a job that is ended get SIGKILL 10 s after SIGTERM (default 30 s).
# Weights: node2 1, node1 2, nodeK K (K >= 3): one-node jobs fill node2 first, then node1, then node3...; a job of
# two nodes gets node1 and node2, and Slurm puts its task 0 (rank 0, the batch script) on node1, the first in node
# order, which then mostly runs multi-node jobs only: the node-failure test stops rank 0's host while no other job
# runs there, and with three nodes or more the requeue lands on node2 and node3 (rank 0 on node2).
# Settings apply when the daemons start (`down` then `up` after changing them), or with `reconfigure` (all but
# the node list). The PIDs live in STATE (default /tmp/fp4moe-slurm, one <daemon>.pid each); logs in /var/log/slurm.
# node-stop N: the host side of nodeN's veth goes down first (its peers then see silence, as from a host that lost
# power, not a closed connection), then every process in its network namespace (slurmd, slurmstepd, the job's tasks
# there: `ip netns pids`) gets SIGKILL. node-start N: the link up, slurmd started again in the same namespaces;
# with ReturnToService=2 the node is IDLE once it registers.
# What each setting guards against: docs/slurm.md, "A Slurm on one Debian machine". It writes
# /etc/slurm/slurm.conf and slurmdbd.conf and refuses to replace ones it did not write.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

STATE=${FP4MOE_SLURM_STATE:-/tmp/fp4moe-slurm}
NODE_CPUS=${NODE_CPUS:-$(( $(nproc) > 8 ? $(nproc) : 8 ))}
NODES=${NODES:-1}
SUBNET=${FP4MOE_SLURM_SUBNET:-10.131.31}
BRIDGE=fp4moe-br
CLUSTER=fp4moe
MARK="# written by fp4moe tools/local_slurm.sh"
PACKAGES="munge slurm-client slurmctld slurmd slurmdbd mariadb-server"
SERVICES="munged mariadbd slurmdbd slurmctld"   # start order, then one slurmd-<node> per node; stopped in reverse
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
  [ -r /etc/debian_version ] || { echo "no /etc/debian_version"; return; }
  [[ "$NODES" =~ ^[1-9]$ ]] || { echo "NODES=$NODES: give a node count from 1 to 9"; return; }
  if [ "$NODES" -gt 1 ]; then
    command -v ip >/dev/null && command -v unshare >/dev/null || { echo "NODES=$NODES needs ip and unshare"; return; }
    unshare --net --uts true 2>/dev/null || echo "NODES=$NODES: no network namespaces here (unshare --net fails)"
  fi
}

node_names() {  # the compute nodes of a NODES-node cluster
  if [ "$1" = 1 ]; then echo localhost; else seq -f 'node%g' 1 "$1" | tr '\n' ' '; fi
}

# ------------------------------------------------------------------------------------------ PIDs

pid_of() { cat "$STATE/$1.pid" 2>/dev/null || true; }

alive() {  # alive <daemon>: its recorded PID runs and is that program (not a reused PID); slurmd-<node>: slurmd
  local pid; pid=$(pid_of "$1")
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "${1%%-*}" ]
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

write_configs() {  # write_configs <node>...: slurm.conf for these compute nodes, and slurmdbd.conf
  local mem n w k=0 ctl=localhost nodes=""
  mem=$(( $(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p') / ($# < 2 ? $# : 2) ))
  if [ "$1" != localhost ]; then ctl="localhost($SUBNET.1)"; fi   # the nodes reach slurmctld on the bridge
  for n in "$@"; do
    k=$((k + 1))
    if [ "$n" = localhost ]; then nodes+="NodeName=localhost"
    else nodes+="NodeName=$n NodeHostname=$n NodeAddr=$SUBNET.$((10 + k))"; fi
    case "$n:$k" in node*:1) w=2 ;; node*:2) w=1 ;; *) w=$k ;; esac   # node2 before node1: see the header
    nodes+=" CPUs=$NODE_CPUS RealMemory=$mem Weight=$w State=UNKNOWN"$'\n'
  done
  install -d -m 0755 /etc/slurm
  write_conf /etc/slurm/slurm.conf root:root 0644 <<CONF
ClusterName=$CLUSTER
SlurmctldHost=$ctl
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
SlurmdTimeout=10
KillWait=10
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
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
${nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
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

# ------------------------------------------------------------------------------------------ node hosts (NODES > 1)

net_up() {  # net_up <node>...: the bridge, and per node its namespace, veth pair, address and hosts file
  local n k=0 hosts=""
  for n in "$@"; do k=$((k + 1)); hosts+="$SUBNET.$((10 + k)) $n"$'\n'; done
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$SUBNET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  k=0
  for n in "$@"; do
    k=$((k + 1))
    local ns=fp4moe-$n veth=fp4moe-$n
    [ -e "/run/netns/$ns" ] || ip netns add "$ns"
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
      ip link del "$veth" 2>/dev/null || true
      ip link add "$veth" type veth peer name eth0 netns "$ns"
    fi
    ip link set "$veth" master "$BRIDGE" up
    ip -n "$ns" addr replace "$SUBNET.$((10 + k))/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    install -d -m 0755 "/etc/netns/$ns"
    { grep -v "^$SUBNET\." /etc/hosts; printf '%s' "$hosts"; } > "/etc/netns/$ns/hosts"
  done
}

net_down() {  # remove every node namespace, the bridge and the hosts files this script made (idempotent)
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^fp4moe-node/ {print $1}'); do ip netns del "$ns"; done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
  rm -rf /etc/netns/fp4moe-node*
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

start_slurmd() {  # start_slurmd <node>: `-N <node>`, so the node name never depends on how a host name resolves
  local n=$1
  rm -f "/run/slurmd-$n.pid"
  install -d -m 0755 "/var/spool/slurmd/$n"
  if [ "$n" = localhost ]; then
    /usr/sbin/slurmd -N localhost
  else   # its network namespace; a UTS namespace with the node's name; a mount namespace with its hosts file
    # (not `ip netns exec`: it remounts /sys without the cgroup folders slurmd needs)
    nsenter --net="/run/netns/fp4moe-$n" unshare --mount --uts sh -c \
      "mount --bind /etc/netns/fp4moe-$n/hosts /etc/hosts && hostname $n && exec /usr/sbin/slurmd -N $n"
  fi
  record "slurmd-$n" "/run/slurmd-$n.pid"
}

start() {  # start <daemon>: munged ... slurmctld, or slurmd-<node>
  case "$1" in slurmd-*) start_slurmd "${1#slurmd-}" ;; *) "start_$1" ;; esac
}

recorded_nodes() { cat "$STATE/nodes" 2>/dev/null || true; }   # the nodes of the cluster `up` last started

daemons() {  # daemons <node>...: every daemon of a cluster with these nodes, in start order
  local n; echo -n "$SERVICES"; for n in "$@"; do echo -n " slurmd-$n"; done; echo
}

nodes_ready() { [ -z "$(sinfo -h -N -o '%N %T' | grep -vE ' (idle|mixed|allocated)$')" ]; }

cmd_up() {
  local why; why=$(can_run)
  [ -z "$why" ] || die "cannot start Slurm here: $why"
  mkdir -p "$STATE"
  local nodes d running="" started=""
  nodes=$(node_names "$NODES")
  for d in $(daemons $(recorded_nodes)); do if alive "$d"; then running="$running $d"; fi; done
  if [ -n "$running" ] && [ "$(echo $(recorded_nodes))" != "$(echo $nodes)" ]; then
    die "the running cluster has the nodes '$(echo $(recorded_nodes))', not '$(echo $nodes)' (NODES=$NODES): \
\`tools/local_slurm.sh down\` first, then \`NODES=$NODES tools/local_slurm.sh up\`"
  fi
  install_packages
  [ "$NODES" = 1 ] || net_up $nodes
  for d in $(daemons $nodes); do
    if alive "$d"; then continue; fi
    if [ -z "$started" ]; then write_configs $nodes; echo "$nodes" > "$STATE/nodes"; fi   # only while one restarts
    log "starting $d"
    start "$d"
    started="$started $d"
  done
  wait_for 60 nodes_ready || die "nodes not idle: $(sinfo -h -N -o '%N %T %E' | tr '\n' ';')"
  log "up${started:+ (started$started)}: $(sinfo -h -o '%P %a %D %T %N') cpus=$NODE_CPUS per node"
}

cmd_down() {
  if alive slurmctld; then   # a job left running would outlive slurmd
    local jobs; jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "${jobs// }" ]; then
      log "scancel $jobs"; scancel $jobs || true
      wait_for 20 sh -c '[ -z "$(squeue -h -o %A)" ]' || true
    fi
  fi
  local f slurmds=""   # every slurmd recorded (slurmd.pid: one started by an older version of this script)
  for f in "$STATE"/slurmd.pid "$STATE"/slurmd-*.pid; do if [ -e "$f" ]; then slurmds+=" $(basename "$f" .pid)"; fi; done
  stop $slurmds slurmctld           # the daemons stop in parallel (about 2 s each): the Slurm ones first,
  stop slurmdbd mariadbd munged     # then accounting and authentication
  rm -f /run/slurmctld.pid /run/slurmd.pid /run/slurmd-*.pid /run/slurmdbd.pid   # stale pidfiles break apt's prerm
  net_down
  rm -f "$STATE/nodes"
  log "down"
}

cmd_status() {
  local ok=0 d nodes; nodes=$(recorded_nodes)
  for d in $(daemons ${nodes:-$(node_names "$NODES")}); do
    if alive "$d"; then echo "$d running (pid $(pid_of "$d"))"; else echo "$d not running"; ok=1; fi
  done
  if [ "$ok" = 0 ]; then sinfo -N; fi
  return "$ok"
}

cmd_reconfigure() {  # the running cluster's configs written again (this script's settings now), then re-read
  alive slurmctld || die "slurmctld is not running: \`up\` writes the configs and starts the daemons"
  write_configs $(recorded_nodes)
  scontrol reconfigure
  log "reconfigured: $(scontrol show config | grep -E '^(SlurmdTimeout|KillWait) ' | tr -s ' ' | tr '\n' ' ')"
}

node_of() {  # node_of <K|nodeK>: the name of a node of the running multi-node cluster
  local n=$1
  if [[ "$n" =~ ^[0-9]+$ ]]; then n=node$n; fi
  local nodes; nodes=" $(echo $(recorded_nodes)) "
  [[ "$nodes" == *" $n "* ]] || die "no node '$1' in the running cluster ($(echo $nodes))"
  [ -e "/run/netns/fp4moe-$n" ] || die "$n has no network namespace of its own: node-stop/node-start need NODES>1"
  echo "$n"
}

gone() {  # gone <pid>...: none of them runs (a zombie waiting for its parent counts as gone)
  local p; for p in "$@"; do
    if [ -r "/proc/$p/stat" ] && [ "$(cut -d' ' -f3 "/proc/$p/stat" 2>/dev/null)" != Z ]; then return 1; fi
  done
}

cmd_node_stop() {  # the node fails like a host losing power: off the network first, then all its processes killed
  local n pids; n=$(node_of "${1:-}")
  ip link set "fp4moe-$n" down
  # and forget its MAC address, as a host that no longer answers ARP makes the others do within seconds: a cached
  # one would leave slurmctld's pings waiting out MessageTimeout (10 s) each instead of failing at once
  local addr ns; addr=$(ip -n "fp4moe-$n" -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1)
  ip neigh flush to "$addr" 2>/dev/null || true
  for ns in $(ip netns list | awk '$1 ~ /^fp4moe-node/ {print $1}'); do ip -n "$ns" neigh flush to "$addr" || true; done
  pids=$(ip netns pids "fp4moe-$n" | tr '\n' ' ')
  if [ -n "${pids// }" ]; then
    kill -9 $pids 2>/dev/null || true
    wait_for 10 gone $pids || die "$n: processes $pids still run after SIGKILL"
  fi
  rm -f "$STATE/slurmd-$n.pid" "/run/slurmd-$n.pid"
  log "$n stopped: link down, SIGKILL to ${pids:-nothing}"
}

node_idle() { sinfo -h -N -n "$1" -o '%T' | grep -qxE 'idle|mixed|allocated'; }

cmd_node_start() {  # the node back: link up, its slurmd (if not running), IDLE again (ReturnToService=2)
  local n; n=$(node_of "${1:-}")
  ip link set "fp4moe-$n" up
  if ! alive "slurmd-$n"; then log "starting slurmd-$n"; start "slurmd-$n"; fi
  wait_for 60 node_idle "$n" || die "$n is not back: $(sinfo -h -N -n "$n" -o '%T %E')"
  log "$n up: $(sinfo -h -N -n "$n" -o '%T')"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  reconfigure) cmd_reconfigure ;;
  node-stop) cmd_node_stop "${2:-}" ;;
  node-start) cmd_node_start "${2:-}" ;;
  can) why=$(can_run); if [ -n "$why" ]; then echo "$why"; exit 1; fi ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac
