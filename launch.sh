#!/usr/bin/env bash
# Start train_ddp.py in N processes on this machine with torchrun.
#
#   bash launch.sh N [train_ddp.py args...]
#
# Environment (all optional):
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT  run on NNODES machines; start this on each, NODE_RANK 0..NNODES-1
#   NNODES=MIN:MAX elastic: MIN to MAX nodes, which may leave and join; no NODE_RANK, RUN_ID needed
#   INIT_TIMEOUT   seconds the nodes wait for each other (default 60)
#   LAST_CALL      elastic: seconds to wait for more nodes once MIN are there (default 30)
#   MAX_RESTARTS   restart failed workers this often (default 0, elastic 3); they resume from the job's last.pt
#   RUN_ID         one id per job, the same on every node (default: $SLURM_JOB_ID); train_ddp.py resumes
#                  only from a last.pt this job wrote (on one node torchrun makes a fresh id itself)
#   RDZV_HOST      elastic: 1 on the node that hosts the rendezvous, 0 elsewhere; found by itself unless
#                  MASTER_ADDR is an address no node holds (a NAT or public address) or ip is missing
#   GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME  passed on as they are; default: the interface to MASTER_ADDR
#   OMP_NUM_THREADS  default: CPU cores / N, at least 1
# train_ddp.py picks the backend itself: nccl with GPUs, gloo without.
set -euo pipefail

# SIGTERM (SLURM, Kubernetes, kill) goes to the workers: they agree on a step, save last.pt and
# exit 0, and torchrun with them. torchrun ignores it (SLURM signals every process of the job
# step), since it would stop the workers too, but exit 1 with a traceback (the torchrun of older
# releases, torch 2.3 for one, has no --signals-to-handle and still takes it).
# Trapped from the start, it is repeated each second until torchrun ends: workers it has yet to
# start get it too (they ignore all but the first). In an elastic job a node other than the
# rendezvous host leaves instead (a spot notice): its workers get the SIGTERM, and torchrun,
# which would take their exit for the job's end and close the rendezvous for every node, is
# killed; the workers save with the others and exit, and the other nodes go on without this one
# (docs/launching.md).
stopping=0 torchrun_pid=
children() {  # the pids whose parent is $1, read from /proc: slim images lack procps (pgrep)
    local stat line ppid
    for stat in /proc/[0-9]*/stat; do
        { read -r line <"$stat"; } 2>/dev/null || continue
        read -r _ ppid _ <<<"${line##*) }"  # after the command's name, which may hold blanks
        if [[ $ppid == "$1" ]]; then stat=${stat#/proc/}; echo "${stat%/stat}"; fi
    done
}
running() {  # pid: not ended, nor a zombie that nobody reaps (a container's init may not)
    local line
    { read -r line <"/proc/$1/stat"; } 2>/dev/null && [[ ${line##*) } != Z* ]]
}
forward() {
    local pid
    while [[ -n $torchrun_pid ]] && running "$torchrun_pid"; do
        for pid in $(children "$torchrun_pid"); do kill -TERM "$pid" 2>/dev/null || true; done
        sleep 1
    done
}
leave() {  # torchrun stopped first: it can start no worker that the SIGTERMs would miss
    local workers pid
    kill -STOP "$torchrun_pid" 2>/dev/null || true
    workers=$(children "$torchrun_pid")
    for pid in $workers; do kill -TERM "$pid" 2>/dev/null || true; done
    kill -KILL "$torchrun_pid" 2>/dev/null || true
    wait "$torchrun_pid" 2>/dev/null || true  # reaped here: no "Killed" line from bash
    for pid in $workers; do while running "$pid"; do sleep 0.2; done; done
    exit 143
}
stop() {  # once: a second SIGTERM must not cut the first one's stop short
    trap '' TERM
    if [[ ${NNODES:-} == *:* && ${RDZV_HOST:-} != 1 ]]; then leave; else forward; fi
}
trap 'stopping=1; [[ -z $torchrun_pid ]] || stop' TERM

wait_for_rendezvous() {  # address, port, seconds: until node 0's torchrun listens there; else one line, exit 1
    local probe status=0
    if (( stopping )); then exit 143; fi
    # In the background: a SIGTERM interrupts `wait` at once, not after the timeout.
    timeout "$3" bash -c 'until (exec 3<>"/dev/tcp/$0/$1") 2>/dev/null; do sleep 0.5; done' "$1" "$2" &
    probe=$!
    wait "$probe" || status=$?
    if (( stopping )); then kill "$probe" 2>/dev/null || true; exit 143; fi
    if (( status )); then
        echo "launch.sh: error: no rendezvous answered at MASTER_ADDR:MASTER_PORT $1:$2 within INIT_TIMEOUT $3 s;" \
            "expected launch.sh running on the node that holds $1 (it hosts the rendezvous), reachable from here" >&2
        exit 1
    fi
}

usage="usage: bash launch.sh N [train_ddp.py args...], N = processes on this machine"
n=${1:-}
if [[ ! $n =~ ^[1-9][0-9]*$ ]]; then
    echo "launch.sh: error: N must be a positive integer, got '$n'; $usage" >&2
    exit 2
fi
shift
if [[ -n ${NNODES:-} ]]; then
    if [[ ! $NNODES =~ ^([1-9][0-9]*)(:([1-9][0-9]*))?$ ]] || (( ${BASH_REMATCH[3]:-$NNODES} < BASH_REMATCH[1] )); then
        echo "launch.sh: error: NNODES must be a number of nodes N or a range MIN:MAX," \
            "1 <= MIN <= MAX; got '$NNODES'" >&2
        exit 2
    elif [[ $NNODES == *:* && -z ${RUN_ID:-${SLURM_JOB_ID:-}} ]]; then
        echo "launch.sh: error: NNODES=$NNODES needs RUN_ID: one id for the job, the same on every node" >&2
        exit 2
    fi
fi
for name in INIT_TIMEOUT LAST_CALL MAX_RESTARTS NODE_RANK MASTER_PORT; do
    if [[ ! ${!name:-0} =~ ^(0|[1-9][0-9]*)$ ]]; then  # a leading 0 would make bash read octal
        echo "launch.sh: error: $name must be a whole number, got '${!name}'" >&2
        exit 2
    fi
done
if [[ ! ${RDZV_HOST:-0} =~ ^[01]$ ]]; then
    echo "launch.sh: error: RDZV_HOST must be 1 (this node hosts the rendezvous) or 0, got '$RDZV_HOST'" >&2
    exit 2
fi
# A node that leaves stays in the rendezvous until it misses 3 heartbeats of 5 s; the others then wait
# LAST_CALL for more nodes: all of it within INIT_TIMEOUT, or every leave ends the job.
if [[ ${NNODES:-} == *:* ]] && (( ${INIT_TIMEOUT:-60} <= ${LAST_CALL:-30} + 15 )); then
    echo "launch.sh: error: INIT_TIMEOUT ${INIT_TIMEOUT:-60} s must be more than LAST_CALL ${LAST_CALL:-30} s" \
        "+ 15 s, the time a node that left stays in the rendezvous (3 missed heartbeats of 5 s)" >&2
    exit 2
fi

cores=$(getconf _NPROCESSORS_ONLN)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / n > 0 ? cores / n : 1 ))}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" >/dev/null && pwd)  # >/dev/null: cd prints it under CDPATH
# Bad arguments, or more processes than GPUs, fail here, once, with one line, before any
# worker or port exists.
LOCAL_WORLD_SIZE=$n python3 "$here/train_ddp.py" --dry-run "$@"

restarts=${MAX_RESTARTS:-0}
if [[ -n ${NNODES:-} ]]; then
    : "${MASTER_ADDR:?set MASTER_ADDR (node 0 host)}"
    port=${MASTER_PORT:-29500} addr=$MASTER_ADDR is_host= host_why= node_addr= dev=
    # Node 0 hosts an elastic job's rendezvous: MASTER_ADDR is this hostname, or it (or an address its name
    # resolves to, such as Debian's 127.0.1.1 for the machine's own name) is an address of this machine.
    if [[ ${MASTER_ADDR%%.*} == "${HOSTNAME%%.*}" ]]; then
        is_host=true host_why="MASTER_ADDR is this hostname"
    fi
    # gloo finds its address from the hostname, which often resolves to 127.0.1.1: unless set, both backends
    # use the interface that reaches MASTER_ADDR (on node 0, the one that holds it), and torchrun this node's
    # address there.
    if command -v ip >/dev/null; then
        addrs=$(getent ahostsv4 "$MASTER_ADDR" | awk '{print $1}' | sort -u) || true
        if [[ -z $addrs ]]; then
            echo "launch.sh: error: MASTER_ADDR '$MASTER_ADDR' has no IPv4 address here; expected node 0's name or" \
                "IPv4 address" >&2
            exit 2
        fi
        addr=${addrs%%$'\n'*} is_host=${is_host:-false}
        for candidate in $addrs; do
            if [[ $(ip route get "$candidate" 2>/dev/null) == local* ]]; then
                addr=$candidate is_host=true host_why="this machine holds MASTER_ADDR $candidate"
            fi
        done
        why="reaches MASTER_ADDR $addr"
        if [[ -n ${GLOO_SOCKET_IFNAME:-} ]]; then  # the user's, a list too (eth0,eth1): names gloo must find
            for dev in ${GLOO_SOCKET_IFNAME//,/ }; do
                if [[ ! -e /sys/class/net/$dev ]]; then
                    names=(/sys/class/net/*)
                    echo "launch.sh: error: GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME names '$dev', which this" \
                        "machine lacks; expected some of its interfaces: ${names[*]##*/}" >&2
                    exit 2
                fi
            done
            dev=${GLOO_SOCKET_IFNAME%%,*}
        elif [[ $is_host == true ]]; then  # the interface that holds it; for loopback, the default route's
            dev=$(ip -o addr show to "$addr" | awk '$2 != "lo" {print $2; exit}')
            if [[ -z $dev ]]; then
                dev=$(ip route show default | grep -o 'dev [^ ]*' | cut -d' ' -f2 | head -n 1) || true
                why="the default route's: MASTER_ADDR is $addr, on loopback here"
            fi
        else
            dev=$(ip route get "$addr" 2>/dev/null | grep -o 'dev [^ ]*' | cut -d' ' -f2) || true
        fi
        if [[ -n $dev && $dev != lo ]]; then
            node_addr=$(ip -o -4 addr show dev "$dev" | awk '{sub("/.*", "", $4); print $4; exit}')
        fi
        if [[ -z ${GLOO_SOCKET_IFNAME:-} && -n $node_addr ]]; then
            export GLOO_SOCKET_IFNAME=$dev NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$dev}
            echo "launch.sh: GLOO_SOCKET_IFNAME=$dev NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME ($why)" >&2
        elif [[ -z ${GLOO_SOCKET_IFNAME:-} ]]; then  # no route, or no interface but loopback
            echo "launch.sh: only loopback reaches MASTER_ADDR $addr: set GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME" >&2
        fi
    fi
    if [[ $NNODES == *:* ]]; then
        case ${RDZV_HOST:-} in
            1) is_host=true host_why="RDZV_HOST=1" ;;
            0) is_host=false ;;
        esac
        if [[ -z $is_host ]]; then  # its SIGTERM would take the rendezvous down, or end the job
            echo "launch.sh: error: without the ip command (iproute2), launch.sh cannot tell whether this node holds" \
                "MASTER_ADDR $MASTER_ADDR; set RDZV_HOST=1 on the node that does, 0 on the others" >&2
            exit 2
        fi
        # torchrun's c10d rendezvous, hosted by node 0's launcher, which must stay; every round's rank 0 hosts
        # its workers' store (not the first round's, which may be gone).
        # The workers know it too: a SIGTERM on this node ends the job, saved, on every node.
        export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 NNODES RDZV_ENDPOINT=$MASTER_ADDR:$port
        if [[ $is_host == true ]]; then export RDZV_HOST=1; else export RDZV_HOST=0; fi
        restarts=${MAX_RESTARTS:-3}
        conf="join_timeout=${INIT_TIMEOUT:-60},last_call_timeout=${LAST_CALL:-30}${is_host:+,is_host=$is_host}"
        rendezvous=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$port" --rdzv-conf "$conf"
                    --rdzv-id "${RUN_ID:-$SLURM_JOB_ID}" ${node_addr:+--local-addr "$node_addr"})
        if [[ $is_host == true ]]; then
            echo "launch.sh: this node hosts the rendezvous at $MASTER_ADDR:$port ($host_why): it must stay to" \
                "the job's end; MASTER_ADDR must not be a node that may leave (a spot node)" >&2
        elif [[ $is_host == false ]]; then  # the rendezvous must answer within INIT_TIMEOUT, or one line here
            echo "launch.sh: joining the rendezvous at $MASTER_ADDR:$port, which another node hosts" \
                "(RDZV_HOST=1 if this one does)" >&2
            wait_for_rendezvous "$MASTER_ADDR" "$port" "${INIT_TIMEOUT:-60}"
        fi
    else
        : "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
        rendezvous=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR"
                    --master-port "${MASTER_PORT:-29500}" --rdzv-conf "timeout=${INIT_TIMEOUT:-60}"
                    --rdzv-id "${RUN_ID:-${SLURM_JOB_ID:-none}}")
    fi
else
    # The OS picks a free port and torchrun holds it: no clash with port 29500 or another job.
    rendezvous=(--standalone)
fi
# torchrun as `python3 -m`: the python3 of the dry run, whatever torchrun comes first on PATH.
(trap '' TERM; PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT exec python3 -m torch.distributed.run \
    "${rendezvous[@]}" --nproc-per-node "$n" --max-restarts "$restarts" "$here/train_ddp.py" "$@") &
torchrun_pid=$!
if (( stopping )); then stop; fi  # a signal that came before torchrun had a pid
status=0
wait "$torchrun_pid" || status=$?
# A trapped signal interrupts `wait` (status > 128) before torchrun is done: wait for its own status.
while (( stopping && status > 128 )); do
    stopping=0 status=0
    wait "$torchrun_pid" || status=$?
done
exit "$status"
