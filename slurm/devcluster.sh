#!/usr/bin/env bash
# A real multi-node Slurm 22.05 cluster on this one machine, for tests and demos.
#
#   slurm/devcluster.sh up       bring it up (idempotent: a running cluster is left as it is)
#   slurm/devcluster.sh down     tear everything down (processes, namespaces, bridge, /etc/hosts block, state dir)
#   slurm/devcluster.sh status   what is running; exit 0 only when every node is up
#   slurm/devcluster.sh env      print `export SLURM_CONF=...` for this cluster (eval "$(slurm/devcluster.sh env)")
#
# Shape (measured facts behind it: ../shared/notes/slurm-dev-cluster.md):
#   - one Linux bridge $BRIDGE with the private subnet $SUBNET.0/24 and NO route anywhere else;
#     slurmctld runs in the root network namespace on the bridge address $SUBNET.1 (host name
#     `gyrectl`, in its own UTS namespace so the machine's host name does not matter);
#   - nodes `head` ($SUBNET.10) and `node01..nodeNN` ($SUBNET.11..): each its own network namespace
#     (veth into the bridge, loopback up), each one `slurmd -N <name>` started with
#     `nsenter --net=/run/netns/<ns> unshare --uts --mount --propagation slave` (never `ip netns exec`:
#     it remounts /sys and slurmd dies), which sets the host name and bind-mounts a node-private
#     directory on the configured TmpFS (PMIx writes spmix_appdir_* there; a shared one breaks);
#   - node names sort in het-component order (`head` < `node01`), which PMIx het steps need;
#   - one munged (runuser -u munge -- munged) for every node through /run/munge;
#   - fake GPUs: gres.conf File= character devices made with `mknod c 1 3`, so Slurm sets
#     CUDA_VISIBLE_DEVICES per step as on a real cluster;
#   - no cgroup.conf (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none);
#   - everything else (slurm.conf, gres.conf, spool, logs, ctld state, node TmpFS, fake devices)
#     lives under $STATE, which `down` removes; names go into /etc/hosts in a marked block that
#     `down` removes.
#
# Client commands need SLURM_CONF=$STATE/slurm.conf (see `env`).
# Partitions: `head` (node head), `cells` (node01..NN, default), `all`.
#
# Knobs (environment):
#   GYRE_SLURM_DIR     state directory            (default /tmp/gyre-devcluster)
#   GYRE_SLURM_SUBNET  first three octets of a /24 (default 10.213.7)
#   GYRE_SLURM_NODES   compute nodes               (default 8)
#   GYRE_SLURM_GPUS    fake GPUs per compute node  (default 8)
#   GYRE_SLURM_CPUS    CPUs each node advertises   (default 8; config_overrides lets nodes claim
#                      more than the machine has)
#   GYRE_SLURM_PORT    slurmctld port; slurmd uses PORT+1 inside the namespaces (default 6817)
#   GYRE_SLURM_UP_TIMEOUT  seconds `up` waits for every node to register (default 30)
#
# Needs root, iproute2, util-linux (nsenter, unshare) and the Debian packages
#   slurmctld slurmd slurm-client munge
# Processes it starts are ended by pid (pid files, `ip netns pids`), never by name.

set -euo pipefail

STATE=${GYRE_SLURM_DIR:-/tmp/gyre-devcluster}
SUBNET=${GYRE_SLURM_SUBNET:-10.213.7}
NODES=${GYRE_SLURM_NODES:-8}
GPUS=${GYRE_SLURM_GPUS:-8}
CPUS=${GYRE_SLURM_CPUS:-8}
PORT=${GYRE_SLURM_PORT:-6817}
UP_TIMEOUT=${GYRE_SLURM_UP_TIMEOUT:-30}
BRIDGE=gyrebr0
CTLD_HOST=gyrectl
CTLD_ADDR=$SUBNET.1
NS_PREFIX=gyre-
HOSTS_BEGIN="# BEGIN gyre-devcluster ($STATE)"
HOSTS_END="# END gyre-devcluster ($STATE)"
CONF=$STATE/slurm.conf
TMPFS=$STATE/tmpfs          # the TmpFS mount point; each node bind-mounts its own directory here

die() { echo "devcluster: $*" >&2; exit 1; }
log() { echo "devcluster: $*" >&2; }

node_names() {
    echo head
    local i
    for ((i = 1; i <= NODES; i++)); do printf 'node%02d\n' "$i"; done
}
node_addr() {  # head -> .10, nodeNN -> .10+NN
    if [[ $1 == head ]]; then echo "$SUBNET.10"; else echo "$SUBNET.$((10 + 10#${1#node}))"; fi
}
compute_range() { printf 'node[01-%02d]' "$NODES"; }

alive() {  # pid is running (zombies count as gone: they are reaped lazily here)
    local pid=$1 st
    [[ -n $pid && -r /proc/$pid/status ]] || return 1
    st=$(awk '/^State:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || return 1
    [[ -n $st && $st != Z && $st != X ]]
}
pidfile_alive() { [[ -r $1 ]] && alive "$(cat "$1" 2>/dev/null)"; }

preflight() {
    [[ $(id -u) == 0 ]] || die "needs root (network namespaces, bridge, mknod, /etc/hosts)"
    local missing=() c
    for c in slurmctld slurmd sinfo scontrol munged ip nsenter unshare runuser mknod; do
        command -v "$c" >/dev/null 2>&1 || missing+=("$c")
    done
    ((${#missing[@]} == 0)) || die "missing commands: ${missing[*]} (apt-get install -y slurmctld slurmd slurm-client munge iproute2)"
    ((NODES >= 1 && NODES <= 99)) || die "GYRE_SLURM_NODES must be 1..99"
}

write_conf() {
    local n
    mkdir -p "$STATE"/{ctld,log,spool,run,dev,nodes} "$TMPFS"
    chmod 700 "$STATE"
    for n in $(node_names); do mkdir -p "$STATE/nodes/$n/tmp" "$STATE/spool/$n"; done
    local g
    for ((g = 0; g < GPUS; g++)); do
        [[ -c $STATE/dev/gpu$g ]] || mknod "$STATE/dev/gpu$g" c 1 3
    done
    {
        cat <<EOF
# generated by slurm/devcluster.sh: a local multi-node Slurm for tests (do not edit; \`down\` removes it)
ClusterName=gyredev
SlurmctldHost=$CTLD_HOST($CTLD_ADDR)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
MpiDefault=none
GresTypes=gpu
TmpFS=$TMPFS
JobRequeue=1
KillWait=10
MinJobAge=600
InactiveLimit=0
# slurmctld pings the nodes every SlurmdTimeout/3 s and a ping's answers are what wake the backfill
# scheduler (the only one that starts het jobs) once a requeued job's BeginTime (cred_expire + 1 s)
# has passed: at 60 a requeued job waited 33-38 s to restart, at 30 12-18 s
SlurmdTimeout=30
MessageTimeout=10
MailProg=/bin/true
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.txt
EOF
        echo "NodeName=head NodeAddr=$(node_addr head) CPUs=$CPUS State=UNKNOWN"
        for n in $(node_names); do
            [[ $n == head ]] && continue
            echo "NodeName=$n NodeAddr=$(node_addr "$n") CPUs=$CPUS Gres=gpu:$GPUS State=UNKNOWN"
        done
        echo "PartitionName=cells Nodes=$(compute_range) Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
        echo "PartitionName=head Nodes=head MaxTime=INFINITE State=UP"
        echo "PartitionName=all Nodes=head,$(compute_range) MaxTime=INFINITE State=UP"
    } > "$CONF"
    if ((GPUS > 0)); then
        echo "NodeName=$(compute_range) Name=gpu File=$STATE/dev/gpu[0-$((GPUS - 1))]" > "$STATE/gres.conf"
    else
        : > "$STATE/gres.conf"
    fi
}

hosts_block_remove() {
    [[ -r /etc/hosts ]] || return 0
    grep -qF "$HOSTS_BEGIN" /etc/hosts || return 0
    local tmp
    tmp=$(mktemp)
    awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1; next} $0 == e {skip = 0; next} !skip' /etc/hosts > "$tmp"
    cat "$tmp" > /etc/hosts   # write in place: /etc/hosts is often a bind mount that cannot be renamed over
    rm -f "$tmp"
}
hosts_block_add() {
    hosts_block_remove
    {
        echo "$HOSTS_BEGIN"
        echo "$CTLD_ADDR $CTLD_HOST"
        local n
        for n in $(node_names); do echo "$(node_addr "$n") $n"; done
        echo "$HOSTS_END"
    } >> /etc/hosts
}

net_up() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
    fi
    ip addr replace "$CTLD_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local n ns veth
    for n in $(node_names); do
        ns=$NS_PREFIX$n
        veth=gyv-$n
        [[ -e /run/netns/$ns ]] || ip netns add "$ns"
        if ! ip link show "$veth" >/dev/null 2>&1; then
            ip link add "$veth" type veth peer name eth0 netns "$ns"
        fi
        ip link set "$veth" master "$BRIDGE" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr replace "$(node_addr "$n")/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
}

munge_up() {
    if command -v munge >/dev/null && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0  # a munged already serves /run/munge: share it
    fi
    [[ -r /etc/munge/munge.key ]] || die "no /etc/munge/munge.key (reinstall the munge package)"
    mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
    runuser -u munge -- munged
    local i
    for ((i = 0; i < 50; i++)); do
        [[ -r /run/munge/munged.pid ]] && break
        sleep 0.1
    done
    cp /run/munge/munged.pid "$STATE/run/munged.ours" 2>/dev/null || die "munged did not start"
}

ctld_up() {
    pidfile_alive "$STATE/run/slurmctld.pid" && return 0
    # its own UTS namespace so that its host name matches SlurmctldHost whatever the machine is called
    unshare --uts sh -c "hostname $CTLD_HOST && exec slurmctld -f '$CONF' -i"
}

slurmd_up() {
    local n=$1 ns=$NS_PREFIX$1
    pidfile_alive "$STATE/run/slurmd.$n.pid" && return 0
    nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation slave \
        sh -c "hostname $n && mount --bind '$STATE/nodes/$n/tmp' '$TMPFS' && exec slurmd -f '$CONF' -N $n" \
        >>"$STATE/log/slurmd.$n.start" 2>&1
}

wait_nodes() {
    local deadline=$((SECONDS + UP_TIMEOUT)) want bad
    want=$((NODES + 1))
    while ((SECONDS < deadline)); do
        bad=$(SLURM_CONF=$CONF sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | awk '$2 !~ /^(idle|mixed|allocated)/' | wc -l) || bad=x
        local have
        have=$(SLURM_CONF=$CONF sinfo -h -N -o '%N' 2>/dev/null | sort -u | wc -l) || have=0
        if [[ $bad == 0 && $have == "$want" ]]; then return 0; fi
        sleep 0.2
    done
    SLURM_CONF=$CONF sinfo -N >&2 || true
    die "nodes did not all come up within ${UP_TIMEOUT}s (logs in $STATE/log)"
}

cmd_up() {
    preflight
    local t0=$EPOCHREALTIME
    if [[ -r $CONF ]] && pidfile_alive "$STATE/run/slurmctld.pid" && cmd_status >/dev/null 2>&1; then
        log "already up ($CONF)"
        return 0
    fi
    write_conf
    hosts_block_add
    net_up
    munge_up
    ctld_up
    local n
    for n in $(node_names); do slurmd_up "$n"; done
    wait_nodes
    log "up: head + $NODES nodes in $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.2f", b - a}') s; export SLURM_CONF=$CONF"
}

kill_pids() {  # TERM, wait up to 3 s, then KILL; by pid only
    local pids=("$@") p i left
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for ((i = 0; i < 30; i++)); do
        left=0
        for p in "${pids[@]}"; do alive "$p" && left=1; done
        ((left)) || return 0
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

cmd_down() {
    [[ $(id -u) == 0 ]] || die "needs root"
    local n ns pids=()
    # every process in our namespaces is ours: slurmd, slurmstepd, job steps
    for n in $(node_names); do
        ns=$NS_PREFIX$n
        [[ -e /run/netns/$ns ]] || continue
        mapfile -t -O "${#pids[@]}" pids < <(ip netns pids "$ns" 2>/dev/null || true)
    done
    for n in $(node_names); do
        [[ -r $STATE/run/slurmd.$n.pid ]] && pids+=("$(cat "$STATE/run/slurmd.$n.pid")")
    done
    [[ -r $STATE/run/slurmctld.pid ]] && pids+=("$(cat "$STATE/run/slurmctld.pid")")
    local live=() p
    for p in "${pids[@]}"; do alive "$p" && live+=("$p"); done
    kill_pids "${live[@]}"
    if [[ -r $STATE/run/munged.ours ]]; then
        p=$(cat "$STATE/run/munged.ours")
        alive "$p" && kill_pids "$p"
    fi
    for n in $(node_names); do
        ns=$NS_PREFIX$n
        [[ -e /run/netns/$ns ]] && ip netns del "$ns" 2>/dev/null || true
        ip link del "gyv-$n" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    hosts_block_remove
    rm -rf "$STATE"
    log "down"
}

cmd_status() {
    local ok=0 n
    [[ -r $CONF ]] || { echo "not up (no $CONF)"; return 1; }
    if pidfile_alive "$STATE/run/slurmctld.pid"; then echo "slurmctld: running (pid $(cat "$STATE/run/slurmctld.pid"))"; else echo "slurmctld: not running"; ok=1; fi
    for n in $(node_names); do
        if pidfile_alive "$STATE/run/slurmd.$n.pid"; then echo "slurmd $n: running (netns $NS_PREFIX$n, $(node_addr "$n"))"
        else echo "slurmd $n: not running"; ok=1; fi
    done
    SLURM_CONF=$CONF sinfo 2>&1 || ok=1
    echo "export SLURM_CONF=$CONF"
    return $ok
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
