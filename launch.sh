#!/usr/bin/env bash
# Start train_ddp.py in N processes on this machine with torchrun, after a dry run of its arguments:
#   bash launch.sh N [train_ddp.py args...]
# Several machines: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT and the rest in docs/launching.md.
set -euo pipefail

main() {
    local n=${1:-} cpus
    [[ $n =~ ^[1-9][0-9]*$ ]] ||
        fail "N must be a positive integer, got '$n'; usage: bash launch.sh N [train_ddp.py args]"
    shift
    settle_variables
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" >/dev/null && pwd)  # >/dev/null: CDPATH prints
    cpus=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)  # nproc: the CPUs this process may use
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus > n ? cpus / n : 1 ))}
    # Bad arguments, or more processes than GPUs, fail here, once, before any worker or port exists.
    LOCAL_WORLD_SIZE=$n python3 "$here/train_ddp.py" --dry-run "$@"
    # One machine: a port the OS picks, at 127.0.0.1 (a container's own name may not resolve).
    rendezvous=(--standalone --local-addr 127.0.0.1)
    if [[ -n $NNODES ]]; then several_nodes; fi
    # As python3 -m: the dry run's python3, whatever torchrun is first on PATH. SIGTERM: see stop().
    (trap '' TERM; PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT exec python3 -m \
        torch.distributed.run "${rendezvous[@]}" --nproc-per-node "$n" \
        --max-restarts "$MAX_RESTARTS" "$here/train_ddp.py" "$@") &
    torchrun_pid=$!
    if (( stopping )); then stop; fi  # a SIGTERM that came before torchrun had a pid
    wait "$torchrun_pid"  # its status is launch.sh's (after a SIGTERM, stop() exits with it)
}

fail() { echo "launch.sh: error: $*" >&2; exit 2; }

settle_variables() {  # the defaults, then one line for each value torchrun refuses late, or never
    # Kubeflow's PET_* variables, torchrun's defaults even with --standalone: launch.sh's instead.
    NNODES=${NNODES:-${PET_NNODES:-}} NODE_RANK=${NODE_RANK:-${PET_NODE_RANK:-}}
    MASTER_ADDR=${MASTER_ADDR:-${PET_MASTER_ADDR:-}}
    MASTER_PORT=${MASTER_PORT:-${PET_MASTER_PORT:-29500}}
    unset "${!PET_@}"
    elastic=$([[ $NNODES == *:* ]] && echo 1 || echo 0)
    RUN_ID=${RUN_ID:-${SLURM_JOB_ID:-}} RDZV_HOST=${RDZV_HOST:-} LAST_CALL=${LAST_CALL:-30}
    INIT_TIMEOUT=${INIT_TIMEOUT:-$((60 + 30*elastic))} MAX_RESTARTS=${MAX_RESTARTS:-$((3*elastic))}
    for name in INIT_TIMEOUT LAST_CALL MAX_RESTARTS NODE_RANK MASTER_PORT; do  # 0..: bash's octal
        [[ ${!name:-0} =~ ^(0|[1-9][0-9]*)$ ]] || fail "$name must be a whole number: '${!name}'"
    done
    (( INIT_TIMEOUT && LAST_CALL )) || fail "INIT_TIMEOUT and LAST_CALL must be 1 s or more"
    (( MASTER_PORT && MASTER_PORT < 65536 )) || fail "MASTER_PORT must be 1 to 65535: $MASTER_PORT"
    [[ $RDZV_HOST =~ ^[01]?$ ]] || fail "RDZV_HOST must be 1 (this node hosts the rendezvous) or 0"
    [[ -z $NNODES || $NNODES =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ && ${NNODES#*:} -ge ${NNODES%:*} ]] ||
        fail "NNODES must be a number of nodes N or a range MIN:MAX, 1 <= MIN <= MAX: '$NNODES'"
    [[ -z $NNODES || -n $MASTER_ADDR ]] || fail "NNODES=$NNODES needs MASTER_ADDR: node 0's address"
    if (( elastic )); then
        [[ -n $RUN_ID ]] || fail "NNODES=$NNODES needs RUN_ID: one id for the job, on every node"
        (( INIT_TIMEOUT > LAST_CALL + 30 )) || fail "INIT_TIMEOUT $INIT_TIMEOUT s must exceed" \
            "LAST_CALL $LAST_CALL s + 30 s: a node that joins waits for the others to stop (30 s)"
    elif [[ -n $NNODES ]] && ! (( ${NODE_RANK:-$NNODES} < NNODES )); then
        fail "NODE_RANK must be 0 (on MASTER_ADDR) to $((NNODES - 1)): '$NODE_RANK'"
    fi
}

several_nodes() {  # torchrun's rendezvous at MASTER_ADDR, and the interface that reaches it
    local facts held node_addr dev
    facts=$(discover 2>/dev/null) ||
        fail "MASTER_ADDR '$MASTER_ADDR' does not resolve here; expected node 0's name or address"
    read -r held node_addr <<<"$facts"
    # gloo takes the address its hostname resolves to (often 127.0.1.1): the one toward MASTER_ADDR.
    if [[ -z ${GLOO_SOCKET_IFNAME:-} && -n $node_addr ]] && command -v ip >/dev/null; then
        dev=$(ip -o addr show to "$node_addr" | awk '{print $2; exit}')
        export GLOO_SOCKET_IFNAME=$dev NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$dev}
        echo "launch.sh: GLOO_SOCKET_IFNAME=$dev NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME" >&2
    fi
    if (( !elastic )); then
        rendezvous=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR"
            --master-port "$MASTER_PORT" --rdzv-id "${RUN_ID:-none}"
            --rdzv-conf timeout="$INIT_TIMEOUT")
        return
    fi
    # Elastic: MASTER_ADDR's launcher hosts it (a second one there finds the port taken, and joins).
    if (( held )) && (exec 3<>"/dev/tcp/$MASTER_ADDR/$MASTER_PORT") 2>/dev/null; then held=0; fi
    RDZV_HOST=${RDZV_HOST:-$held} RDZV_ENDPOINT=$MASTER_ADDR:$MASTER_PORT
    # Each round's rank 0 hosts its workers' store, not the first round's, which may be gone. The
    # workers know the job is elastic, and whether a SIGTERM here ends it.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 NNODES RDZV_HOST RDZV_ENDPOINT
    rendezvous=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
        --rdzv-id "$RUN_ID" ${node_addr:+--local-addr "$node_addr"}
        --rdzv-conf "join_timeout=$INIT_TIMEOUT,last_call_timeout=$LAST_CALL,is_host=$RDZV_HOST")
    if (( RDZV_HOST )); then
        echo "launch.sh: this node hosts the rendezvous at $RDZV_ENDPOINT, and must stay" >&2
        return
    fi
    echo "launch.sh: joining the rendezvous at $RDZV_ENDPOINT, which another node hosts" >&2
    # Until it answers, in the background: a SIGTERM ends the wait at once.
    timeout "$INIT_TIMEOUT" bash -c 'until (exec 3<>"/dev/tcp/$0/$1"); do sleep 0.5; done' \
        "$MASTER_ADDR" "$MASTER_PORT" 2>/dev/null &
    if wait $!; then return; fi
    if (( stopping )); then kill $! 2>/dev/null || true; exit 143; fi
    fail "no rendezvous answered at MASTER_ADDR:MASTER_PORT $RDZV_ENDPOINT within INIT_TIMEOUT" \
        "$INIT_TIMEOUT s; expected launch.sh running on the node that holds $MASTER_ADDR"
}

discover() {  # "held address": 1 if this machine holds MASTER_ADDR, else 0; its address toward it
    python3 - "$MASTER_ADDR" <<'PY'
import ipaddress, socket, sys
def source(addr, bind=False):  # bound: this machine's own; a UDP connect (sending nothing): the
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # address it sends from
            s.bind((addr, 0)) if bind else s.connect((addr, 9))
            return s.getsockname()[0]
        except OSError:
            return ""
found = list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(sys.argv[1], None)))
loopback = lambda addr: ipaddress.ip_address(addr).is_loopback
held = sorted((a for a in found if source(a, bind=True)), key=loopback)  # a network card's first
toward = (held or found)[0]
if loopback(toward):  # its name at 127.0.1.1: the others reach it by its default route's address
    toward = "2001:db8::1" if ":" in toward else "192.0.2.1"
print(int(bool(held)), source(toward))
PY
}

# SIGTERM (SLURM, Kubernetes, a spot notice): the workers agree on a step, save last.pt and exit 0.
# torchrun ignores it: it would stop them too and exit 1 with a traceback (docs/launching.md).
stopping=0 torchrun_pid=
trap 'stopping=1; [[ -z $torchrun_pid ]] || stop' TERM

stop() {  # once: a second SIGTERM must not cut the first one's stop short
    local pid workers idle=0 leave=0
    trap '' TERM
    # An elastic node other than the rendezvous host leaves: its torchrun, stopped, starts no worker
    # the SIGTERMs miss, nor takes their exit for the job's end, which would end the rendezvous.
    if (( elastic && !RDZV_HOST )); then leave=1; kill -STOP "$torchrun_pid" || true; fi
    # Each second, as a worker ignores it until train_ddp.py starts. An elastic host's torchrun,
    # its workers gone, would wait 300 s for the nodes that left (a cancelled job), then fail.
    while kill -0 "$torchrun_pid" 2>/dev/null; do
        workers=$(children "$torchrun_pid")
        for pid in $workers; do kill -TERM "$pid" 2>/dev/null || true; done
        if [[ -n $workers ]] || (( !elastic )); then
            idle=0
        elif (( leave || ++idle > 15 )); then
            kill -KILL "$torchrun_pid" || true
            wait "$torchrun_pid" 2>/dev/null || exit 143  # reaped: no "Killed" line from bash
        fi
        sleep 1
    done
    wait "$torchrun_pid" || exit  # with torchrun's status
    exit 0
}

children() {  # of $1, not yet ended: from /proc without procps (slim images), ps without /proc
    local stat line state ppid
    if [[ ! -d /proc/self ]]; then
        ps -A -o pid= -o ppid= -o stat= | awk -v p="$1" '$2 == p && $3 !~ /^Z/ {print $1}'
        return
    fi
    for stat in /proc/[0-9]*/stat; do
        { read -r line <"$stat"; } 2>/dev/null || continue
        read -r state ppid _ <<<"${line##*) }"  # after the command's name, which may hold blanks
        if [[ $ppid == "$1" && $state != Z ]]; then stat=${stat#/proc/}; echo "${stat%/stat}"; fi
    done
}

main "$@"
