#!/usr/bin/env bash
# Start train_ddp.py in N processes on this machine with torchrun, after a dry run of its arguments:
#   bash launch.sh N [train_ddp.py args...]
# Several machines: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT and the rest in docs/launching.md.
# Exit 0: training is done. Ctrl-C, SIGTERM, SIGHUP: the workers save last.pt at their next step,
# exit 75 (0 under SLURM): run it again to go on. A second Ctrl-C stops at once: 130.
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
    # One machine: a port the OS picks, at 127.0.0.1 (a container's own name may not resolve).
    rendezvous=(--standalone --local-addr 127.0.0.1)
    [[ -z $NNODES ]] || several_nodes
    export STOP_FILE=$scratch/stopped  # the workers' word that they stopped before the end
    # As python3 -m: the dry run's python3. The signals are for launch.sh to act on, not torchrun.
    (
        trap '' INT TERM HUP
        PET_SIGNALS_TO_HANDLE=SIGQUIT exec python3 -m torch.distributed.run "${rendezvous[@]}" \
            --nproc-per-node "$n" --max-restarts "$MAX_RESTARTS" "$here/train_ddp.py" "$@"
    ) &
    torchrun_pid=$!
    until [[ -n $signalled ]] || ! kill -0 "$torchrun_pid" 2>/dev/null; do
        wait "$torchrun_pid" || true  # which a signal ends early
    done
    [[ -z $signalled ]] || stop
    wait "$torchrun_pid" || exit  # with torchrun's status: it exits 0 when its workers stopped too
    [[ ! -e $STOP_FILE ]] || exit "$stop_code"
}

fail() {
    echo "launch.sh: error: $*" >&2
    exit 2
}

settle_variables() {  # the defaults, then one line for each value torchrun refuses late, or never
    # Kubeflow's PET_* variables, torchrun's defaults even with --standalone: launch.sh's instead.
    NNODES=${NNODES:-${PET_NNODES:-}}
    NODE_RANK=${NODE_RANK:-${PET_NODE_RANK:-}}
    MASTER_ADDR=${MASTER_ADDR:-${PET_MASTER_ADDR:-}}
    MASTER_PORT=${MASTER_PORT:-${PET_MASTER_PORT:-29500}}
    # A job restarted on new pods or nodes finds its last.pt by it (docs/launching.md).
    RUN_ID=${RUN_ID:-${SLURM_JOB_ID:-${SKYPILOT_TASK_ID:-}}}
    [[ -z ${PET_NNODES:-} || -n $RUN_ID ]] || fail "a Kubeflow TrainJob needs RUN_ID, its pod" \
        "label jobset.sigs.k8s.io/jobset-uid: new pods start afresh over the job's last.pt without it"
    unset "${!PET_@}"
    elastic=0
    [[ $NNODES != *:* ]] || elastic=1
    RDZV_HOST=${RDZV_HOST:-}
    LAST_CALL=${LAST_CALL:-30}
    INIT_TIMEOUT=${INIT_TIMEOUT:-600}  # torchrun's: for nodes minutes apart (a cold image pull)
    MAX_RESTARTS=${MAX_RESTARTS:-$((3 * elastic))}
    for name in INIT_TIMEOUT LAST_CALL MAX_RESTARTS NODE_RANK MASTER_PORT; do  # 0..: bash's octal
        [[ ${!name:-0} =~ ^(0|[1-9][0-9]*)$ ]] || fail "$name must be a whole number: '${!name}'"
    done
    (( INIT_TIMEOUT > 0 )) || fail "INIT_TIMEOUT must be 1 s or more"
    (( LAST_CALL > 0 )) || fail "LAST_CALL must be 1 s or more"
    (( MASTER_PORT > 0 && MASTER_PORT < 65536 )) || fail "MASTER_PORT must be 1 to 65535: '$MASTER_PORT'"
    [[ $RDZV_HOST =~ ^[01]?$ ]] || fail "RDZV_HOST must be 1 (this node hosts the rendezvous) or 0"
    nodes="NNODES must be a number of nodes N or a range MIN:MAX, 1 <= MIN <= MAX: '$NNODES'"
    [[ $NNODES =~ ^([1-9][0-9]*(:[1-9][0-9]*)?)?$ ]] || fail "$nodes"
    [[ -z $NNODES || -n $MASTER_ADDR ]] || fail "NNODES=$NNODES needs MASTER_ADDR: node 0's address"
    if (( elastic )); then
        (( ${NNODES#*:} >= ${NNODES%:*} )) || fail "$nodes"
        [[ -n $RUN_ID ]] || fail "NNODES=$NNODES needs RUN_ID: one id for the job, on every node"
        (( INIT_TIMEOUT > LAST_CALL + 30 )) || fail "INIT_TIMEOUT $INIT_TIMEOUT s must exceed" \
            "LAST_CALL $LAST_CALL s + 30 s: a node that joins waits for the others to stop (30 s)"
    elif [[ -n $NNODES ]] && ! (( ${NODE_RANK:-$NNODES} < NNODES )); then
        fail "NODE_RANK must be 0 (on MASTER_ADDR) to $((NNODES - 1)): '$NODE_RANK'"
    fi
}

several_nodes() {  # torchrun's rendezvous at MASTER_ADDR, and the interface that reaches it
    local held node_addr dev
    in_background discover >"$scratch/facts" ||
        fail "MASTER_ADDR '$MASTER_ADDR' did not resolve within INIT_TIMEOUT $INIT_TIMEOUT s"
    read -r held node_addr <"$scratch/facts"
    # gloo takes the address its hostname resolves to (often 127.0.1.1): the one toward MASTER_ADDR.
    if [[ -z ${GLOO_SOCKET_IFNAME:-} && -n $node_addr ]] && command -v ip >/dev/null; then
        dev=$(ip -o addr show to "$node_addr" | awk '{print $2; exit}')
        export GLOO_SOCKET_IFNAME=$dev
        export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$dev}
        echo "launch.sh: GLOO_SOCKET_IFNAME=$dev NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME" >&2
    fi
    if (( !elastic )); then
        rendezvous=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR"
            --master-port "$MASTER_PORT" --rdzv-id "${RUN_ID:-none}"
            --rdzv-conf timeout="$INIT_TIMEOUT")
        return
    fi
    # Elastic: MASTER_ADDR's launcher hosts it (a second one there finds the port taken, and joins).
    if (( held )) && (exec 3<>"/dev/tcp/$MASTER_ADDR/$MASTER_PORT") 2>/dev/null; then
        held=0
    fi
    RDZV_HOST=${RDZV_HOST:-$held}
    RDZV_ENDPOINT=$MASTER_ADDR:$MASTER_PORT
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
    in_background timeout "$INIT_TIMEOUT" bash -c 'until (exec 3<>"/dev/tcp/$0/$1"); do
        sleep 0.5; done' "$MASTER_ADDR" "$MASTER_PORT" 2>/dev/null ||
        fail "no rendezvous answered at MASTER_ADDR:MASTER_PORT $RDZV_ENDPOINT within INIT_TIMEOUT" \
            "$INIT_TIMEOUT s; expected launch.sh running on the node that holds $MASTER_ADDR"
}

discover() {  # "held address": 1 if this machine holds MASTER_ADDR, else 0; its address toward it
    python3 - "$MASTER_ADDR" "$INIT_TIMEOUT" <<'PY'
import ipaddress, itertools, socket, sys, time
def source(addr, bind=False):  # bound: this machine's own; a UDP connect (sending nothing): the
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # address it sends from
            s.bind((addr, 0)) if bind else s.connect((addr, 9))
            return s.getsockname()[0]
        except OSError:
            return ""
name, seconds = sys.argv[1], float(sys.argv[2])
for waited in itertools.count():  # a pod's name resolves once that pod has an address
    try:
        found = list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(name, None)))
        break
    except socket.gaierror:
        if waited == 0:
            print(f"launch.sh: MASTER_ADDR '{name}' does not resolve yet; waiting", file=sys.stderr)
        if waited >= seconds:
            sys.exit(1)
        time.sleep(1)
loopback = lambda addr: ipaddress.ip_address(addr).is_loopback
held = sorted((a for a in found if source(a, bind=True)), key=loopback)  # a network card's first
toward = (held or found)[0]
if loopback(toward):  # its name at 127.0.1.1: the others reach it by its default route's address
    toward = "2001:db8::1" if ":" in toward else "192.0.2.1"
print(int(bool(held)), source(toward))
PY
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
        kill -KILL "$torchrun_pid" $(children "$torchrun_pid") 2>/dev/null || true
        echo "launch.sh: stopped at once by a second Ctrl-C; the last save is kept" >&2
        exit 130
    fi
    signalled=${signalled:-$1}
}

stop() {  # to the workers each second, as one that starts late ignores it until its first line
    local workers idle=0
    local forward=$signalled  # SIGINT for a Ctrl-C, which their line names, then SIGTERM
    local leave=$(( elastic && !RDZV_HOST ))
    # A node that leaves an elastic job: its torchrun, stopped, starts no worker the signals miss,
    # nor takes their exit for the job's end, which would end the rendezvous for every node.
    kill -STOP "$torchrun_pid" || true
    if [[ -z $(children "$torchrun_pid") ]]; then  # still in its rendezvous: nothing to save
        leave=1
    elif (( !leave )); then
        kill -CONT "$torchrun_pid" || true
    fi
    while kill -0 "$torchrun_pid" 2>/dev/null; do
        workers=$(children "$torchrun_pid")
        kill "-$forward" $workers 2>/dev/null || true
        forward=TERM
        if [[ -n $workers ]]; then
            idle=0
        # Its workers gone, torchrun may wait 300 s for nodes that left (a cancelled elastic job).
        elif (( leave || ++idle > 15 )); then
            kill -KILL "$torchrun_pid" || true
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
            stat=${stat#/proc/}
            echo "${stat%/stat}"
        fi
    done
}

torchrun_pid=
signalled=  # the first signal's name
stop_code=75  # sysexits.h's EX_TEMPFAIL, "try again later": Kubernetes and SkyPilot start it anew
[[ -z ${SLURM_JOB_ID:-} ]] || stop_code=0  # sbatch --dependency=afterok chains go on after 0 only
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM HUP
main "$@"
