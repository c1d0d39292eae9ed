#!/usr/bin/env bash
# Start train_ddp.py in N processes on this machine with torchrun, after a dry run of its arguments:
#   bash launch.sh N [train_ddp.py args...]      (several machines: docs/launching.md)
# Exit 0: trained to the end. 75 (0 under SLURM): stopped by Ctrl-C, SIGTERM or SIGHUP, saved.
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
    in_background env LOCAL_WORLD_SIZE="$n" python3 "$here/train_ddp.py" --dry-run "$@"
    rendezvous=(--standalone --local-addr 127.0.0.1)  # not this machine's name: it may not resolve
    [[ -z $NNODES ]] || several_nodes
    (  # as python3 -m: the dry run's python3. The signals are launch.sh's to act on.
        trap '' INT TERM HUP
        PET_SIGNALS_TO_HANDLE=SIGQUIT exec python3 -m torch.distributed.run "${rendezvous[@]}" \
            --nproc-per-node "$n" --max-restarts "$MAX_RESTARTS" "$here/train_ddp.py" "$@"
    ) &
    torchrun_pid=$!
    until [[ -n $signalled ]] || ! kill -0 "$torchrun_pid" 2>/dev/null; do
        wait "$torchrun_pid" || true  # which a signal ends early
    done
    [[ -z $signalled ]] || stop
    wait "$torchrun_pid" || exit  # torchrun's failure; it exits 0 if its workers stopped, too
    [[ ! -e $STOP_FILE ]] || exit "$stop_code"
}

fail() {
    echo "launch.sh: error: $*" >&2
    exit 2
}

settle_variables() {  # the defaults, then one line for each value torchrun refuses late, or never
    NNODES=${NNODES:-${PET_NNODES:-}}
    NODE_RANK=${NODE_RANK:-${PET_NODE_RANK:-}}
    MASTER_ADDR=${MASTER_ADDR:-${PET_MASTER_ADDR:-}}
    MASTER_PORT=${MASTER_PORT:-${PET_MASTER_PORT:-29500}}
    RUN_ID=${RUN_ID:-${SLURM_JOB_ID:-${SKYPILOT_TASK_ID:-}}}  # by which new pods find last.pt
    unset "${!PET_@}"  # Kubeflow's, which torchrun takes as its defaults even with --standalone
    elastic=0
    [[ $NNODES != *:* ]] || elastic=1
    LAST_CALL=${LAST_CALL:-30}
    INIT_TIMEOUT=${INIT_TIMEOUT:-600}  # torchrun's: for nodes minutes apart (a cold image pull)
    MAX_RESTARTS=${MAX_RESTARTS:-$((3 * elastic))}
    for name in INIT_TIMEOUT LAST_CALL MAX_RESTARTS NODE_RANK MASTER_PORT; do  # 0..: bash's octal
        [[ ${!name:-0} =~ ^(0|[1-9][0-9]*)$ ]] || fail "$name must be a whole number: '${!name}'"
    done
    (( INIT_TIMEOUT > 0 )) || fail "INIT_TIMEOUT must be 1 s or more"
    (( MASTER_PORT > 0 )) || fail "MASTER_PORT must be 1 to 65535: $MASTER_PORT"
    [[ ${RDZV_HOST:-} =~ ^[01]?$ ]] || fail "RDZV_HOST must be 1 (this node hosts it) or 0"
    nodes="NNODES must be a number of nodes N or a range MIN:MAX, 1 <= MIN <= MAX: '$NNODES'"
    [[ $NNODES =~ ^([1-9][0-9]*(:[1-9][0-9]*)?)?$ ]] || fail "$nodes"
    [[ -z $NNODES || -n $MASTER_ADDR ]] || fail "NNODES=$NNODES needs MASTER_ADDR: node 0's address"
    [[ -z $NNODES || -n $RUN_ID ]] || fail "NNODES=$NNODES needs RUN_ID, the job's id on every node"
    if (( elastic )); then
        (( ${NNODES#*:} >= ${NNODES%:*} )) || fail "$nodes"
        (( INIT_TIMEOUT > LAST_CALL + 30 )) || fail "INIT_TIMEOUT $INIT_TIMEOUT s must exceed" \
            "LAST_CALL $LAST_CALL s + 30 s: a node that joins waits for the others to stop (30 s)"
    elif [[ -n $NNODES ]] && ! (( ${NODE_RANK:-$NNODES} < NNODES )); then
        fail "NODE_RANK must be 0 (on MASTER_ADDR) to $((NNODES - 1)): '$NODE_RANK'"
    fi
}

several_nodes() {  # torchrun's rendezvous at MASTER_ADDR, and the interface that reaches it
    local held node_addr dev
    read -r held node_addr < <(python3 - "$MASTER_ADDR" <<'PY'
import contextlib, ipaddress, socket, sys
def source(addr, bind=False):  # bound: this machine's own; connected (UDP: sends nothing): its own
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM) as s:
        with contextlib.suppress(OSError):
            s.bind((addr, 0)) if bind else s.connect((addr, 9))
            return s.getsockname()[0]
try:
    found = list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(sys.argv[1], None)))
except socket.gaierror:  # not yet, as launch.sh waits for it: toward the default route meanwhile
    found = ["192.0.2.1"]
loopback = lambda addr: ipaddress.ip_address(addr).is_loopback
held = sorted((a for a in found if source(a, bind=True)), key=loopback)  # a network card's first
toward = (held or found)[0]
if loopback(toward):  # its name at 127.0.1.1: the others reach it by its default route's address
    toward = "2001:db8::1" if ":" in toward else "192.0.2.1"
print(int(bool(held)), source(toward) or "")
PY
)
    # gloo takes the address its hostname resolves to (often 127.0.1.1): the one toward MASTER_ADDR.
    if [[ -z ${GLOO_SOCKET_IFNAME:-} && -n $node_addr ]] && command -v ip >/dev/null; then
        dev=$(ip -o addr show to "$node_addr" | awk '{print $2; exit}')
        export GLOO_SOCKET_IFNAME=$dev
        export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$dev}
        echo "launch.sh: GLOO_SOCKET_IFNAME=$dev NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME" >&2
    fi
    RDZV_ENDPOINT=$MASTER_ADDR:$MASTER_PORT
    if (( elastic )); then
        RDZV_HOST=${RDZV_HOST:-$held}  # MASTER_ADDR's launcher
        # A store per round (the first's host may be gone); the workers know the job is elastic.
        export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 NNODES RDZV_HOST RDZV_ENDPOINT
        rendezvous=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
            --rdzv-conf "join_timeout=$INIT_TIMEOUT,last_call_timeout=$LAST_CALL,is_host=$RDZV_HOST"
            --rdzv-id "$RUN_ID" ${node_addr:+--local-addr "$node_addr"})
    else
        RDZV_HOST=$(( NODE_RANK == 0 ))
        rendezvous=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-conf timeout="$INIT_TIMEOUT"
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --rdzv-id "$RUN_ID")
    fi
    if (( RDZV_HOST )); then
        echo "launch.sh: this node hosts the rendezvous at $RDZV_ENDPOINT, and must stay" >&2
        return
    fi
    echo "launch.sh: waiting for the rendezvous at $RDZV_ENDPOINT, which another node hosts" >&2
    in_background timeout "$INIT_TIMEOUT" bash -c 'until (: <"/dev/tcp/$0/$1"); do sleep 1; done' \
        "$MASTER_ADDR" "$MASTER_PORT" 2>/dev/null ||
        fail "no rendezvous answered at MASTER_ADDR:MASTER_PORT $RDZV_ENDPOINT within" \
            "INIT_TIMEOUT $INIT_TIMEOUT s; expected launch.sh on the node that holds $MASTER_ADDR"
}

in_background() {  # "$@" and its exit status, waited for in the background: a signal acts at once
    "$@" &
    wait $!
}

on_signal() {  # before torchrun, nothing to save: stop now; after, the workers save (stop)
    if [[ -z $torchrun_pid ]]; then
        kill -KILL "${!:-}" $(children "${!:-}") 2>/dev/null || true  # a dry run, a wait
        exit "$stop_code"
    fi
    if [[ -n $signalled && $1 == INT ]]; then
        kill -KILL "$torchrun_pid" $(children "$torchrun_pid") 2>/dev/null || true  # last.pt stays
        echo "launch.sh: stopped at once by a second Ctrl-C; the last save is kept" >&2
        exit 130
    fi
    signalled=${signalled:-$1}
}

stop() {  # to the workers each second, as one that starts late ignores it until its first line
    # An elastic node that leaves: its torchrun, stopped, starts no worker the signals miss, nor
    # takes their exit for the job's end, which would end the rendezvous for every node.
    local workers leave=$(( elastic && !RDZV_HOST ))
    kill -STOP "$torchrun_pid"
    [[ -n $(children "$torchrun_pid") ]] || leave=1  # still in its rendezvous: nothing to save
    (( leave )) || kill -CONT "$torchrun_pid"
    # Its workers gone, torchrun may wait 300 s for nodes that left (a cancelled elastic job).
    local grace=$(( leave ? 0 : 15 ))  # the seconds it then gets to end by itself
    while kill -0 "$torchrun_pid" 2>/dev/null; do
        workers=$(children "$torchrun_pid")
        kill "-$signalled" $workers 2>/dev/null || true  # SIGINT for a Ctrl-C, which they name
        signalled=TERM  # from the second on
        if [[ -z $workers ]] && (( grace-- == 0 )); then
            kill -KILL "$torchrun_pid"
            wait "$torchrun_pid" 2>/dev/null || exit "$stop_code"  # reaped: no "Killed" from bash
        fi
        in_background sleep 1 || true  # which a second signal ends early
    done
}

children() {  # of $1, not yet ended, from /proc: slim images lack procps
    local stat line state ppid
    for stat in /proc/[0-9]*/stat; do
        { read -r line <"$stat"; } 2>/dev/null || continue
        read -r state ppid _ <<<"${line##*) }"  # after the command's name, which may hold blanks
        if [[ $ppid == "$1" && $state != Z ]]; then
            echo "${stat:6:-5}"  # /proc/PID/stat's PID
        fi
    done
}

torchrun_pid=
signalled=  # the first signal's name; what stop() passes on to the workers
stop_code=75  # sysexits.h's EX_TEMPFAIL, "try again later": Kubernetes and SkyPilot start it anew
[[ -z ${SLURM_JOB_ID:-} ]] || stop_code=0  # sbatch --dependency=afterok chains go on after 0 only
export STOP_FILE=$(mktemp -u)  # where workers say they stopped early: torchrun exits 0 either way
trap 'rm -f "$STOP_FILE"' EXIT
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM HUP
main "$@"
