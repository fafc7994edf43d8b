#!/usr/bin/env bash
# Starts TorchServe in the foreground with the models of the model store.
#
# Environment:
#   MODEL_NAMES         models to load, separated by spaces or commas
#                       (default: qwen-coder-spec). Each NAME is served at
#                       /predictions/NAME from NAME.mar in the model store, or
#                       from the folder NAME/ made with
#                       `torch-model-archiver --archive-format no-archive`,
#                       which TorchServe loads without unpacking it first.
#   MODEL_STORE         default: /home/model-server/model-store
#   TS_CONFIG           default: /home/model-server/config.properties
#   DISABLE_TOKEN_AUTH  "true" starts TorchServe with --disable-token-auth.
#                       Only for a server that something else protects, such
#                       as the Kubernetes manifests in deploy/k8s.
#   DRAIN_TIMEOUT_S     longest wait, after SIGTERM, for the requests in flight
#                       to finish before TorchServe is stopped (default: 270).
#                       Keep it below the time the container is given to stop:
#                       Kubernetes' terminationGracePeriodSeconds minus the
#                       preStop wait, or `docker stop -t` / `--stop-timeout`
#                       (Docker's default is only 10 s).
#   DRAIN_QUIET_S       the inference port must have had no connection for this
#                       long before the drain ends (default: 2).
#   DRAIN_MARKER        the file whose presence makes `healthcheck.py --ready`
#                       report "draining" (default: /tmp/torchserve-draining).
#   SPEC_COST_TABLE_DIR where the workers cache the cost table they measure at
#                       start-up (default: /home/model-server/cost-tables).
#                       Mount a volume there to keep it across containers; the
#                       archive's own folder is unpacked anew at every start.
#
# Any arguments are passed on to torchserve, e.g. --log-config FILE.
#
# Stopping (SIGTERM from `docker stop` or the kubelet, or SIGINT) drains first:
#   1. the drain marker is created, so the readiness check fails and nothing
#      that follows readiness sends new requests here (in Kubernetes the preStop
#      hook has created it already, before the SIGTERM);
#   2. TorchServe keeps running until no connection to the inference port has
#      been open for DRAIN_QUIET_S, or until DRAIN_TIMEOUT_S, whichever is first;
#   3. `torchserve --stop`. A second signal skips what is left of step 2.
set -euo pipefail

MODEL_NAMES="${MODEL_NAMES:-qwen-coder-spec}"
MODEL_STORE="${MODEL_STORE:-/home/model-server/model-store}"
TS_CONFIG="${TS_CONFIG:-/home/model-server/config.properties}"
DISABLE_TOKEN_AUTH="${DISABLE_TOKEN_AUTH:-false}"
DRAIN_TIMEOUT_S="${DRAIN_TIMEOUT_S:-270}"
DRAIN_QUIET_S="${DRAIN_QUIET_S:-2}"
DRAIN_MARKER="${DRAIN_MARKER:-/tmp/torchserve-draining}"
export SPEC_COST_TABLE_DIR="${SPEC_COST_TABLE_DIR:-/home/model-server/cost-tables}"
DRAIN_POLL_S=0.5

fail() {
    echo "entrypoint: $*" >&2
    exit 1
}

[[ -f "$TS_CONFIG" ]] || fail "TorchServe config $TS_CONFIG not found (set TS_CONFIG)."
[[ -d "$MODEL_STORE" ]] || fail "model store $MODEL_STORE not found: mount it or set MODEL_STORE."
[[ "$DRAIN_TIMEOUT_S" =~ ^[0-9]+$ ]] || fail "DRAIN_TIMEOUT_S must be a whole number of seconds, not '$DRAIN_TIMEOUT_S'."
[[ "$DRAIN_QUIET_S" =~ ^[0-9]+$ ]] || fail "DRAIN_QUIET_S must be a whole number of seconds, not '$DRAIN_QUIET_S'."

# Turn the model names into TorchServe's NAME=LOCATION pairs, and fail here,
# with the store's contents, rather than deep in TorchServe's log.
models=()
for name in ${MODEL_NAMES//,/ }; do
    [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] \
        || fail "invalid model name '$name' in MODEL_NAMES (letters, digits, '_', '.', '-')."
    if [[ -f "$MODEL_STORE/$name.mar" ]]; then
        models+=("$name=$name.mar")
    elif [[ -f "$MODEL_STORE/$name/MAR-INF/MANIFEST.json" ]]; then
        models+=("$name=$name")
    else
        echo "entrypoint: neither $MODEL_STORE/$name.mar nor an unpacked archive" \
            "$MODEL_STORE/$name/ exists. The model store holds:" >&2
        ls -la "$MODEL_STORE" >&2 || true
        fail "build the archive first, or set MODEL_NAMES to one of the archives above."
    fi
done
[[ ${#models[@]} -gt 0 ]] || fail "MODEL_NAMES is empty."

# --ncs: no config snapshots. A container starts from its image and its
# environment every time, never from the state a previous run left behind.
args=(--start --foreground --ncs --ts-config "$TS_CONFIG" --model-store "$MODEL_STORE"
      --models "${models[@]}")

case "$DISABLE_TOKEN_AUTH" in
    true)
        args+=(--disable-token-auth)
        echo "entrypoint: WARNING: token authorization is OFF. Anyone who can reach" \
            "ports 8080 and 8081 can call the APIs; keep them behind an authenticating" \
            "proxy and a network policy." >&2
        ;;
    false)
        # TorchServe writes the key file into its working directory.
        echo "entrypoint: token authorization is on. The keys will be in" \
            "$PWD/key_file.json once the server has started; read them with" \
            "'docker exec <container> cat $PWD/key_file.json' and send" \
            "'Authorization: Bearer <inference key>'."
        ;;
    *)
        fail "DISABLE_TOKEN_AUTH must be 'true' or 'false', not '$DISABLE_TOKEN_AUTH'."
        ;;
esac

# The port of the inference API, from TS_CONFIG's inference_address (TorchServe's
# default: 8080). The OpenAI routes are served on it too.
inference_port=8080
while IFS= read -r line || [[ -n "$line" ]]; do
    if [[ "$line" =~ ^[[:space:]]*inference_address[[:space:]]*=[[:space:]]*([^[:space:]]*) ]]; then
        address="${BASH_REMATCH[1]}"
        if [[ "$address" =~ :([0-9]+)/?$ ]]; then
            inference_port="${BASH_REMATCH[1]}"
        elif [[ "$address" == https:* ]]; then
            inference_port=443
        else
            inference_port=80
        fi
    fi
done < "$TS_CONFIG"

# What "in flight" means here: a TCP connection to the inference port in state
# ESTABLISHED. Every REST call, streamed or not, holds its client's connection
# open until its last byte is written, whatever the batching mode, so no open
# connection means nothing in flight. TorchServe 0.12 offers no better signal:
# the describe API's pendingRequests counts only the jobs still queued, not the
# ones a continuous batch is decoding, and its metrics have no in-flight gauge.
# The count can only err on the long side: an idle keep-alive connection (an
# ingress controller or a proxy keeping a pool to the pod) counts as in flight
# until its owner closes it, and then the drain lasts until DRAIN_TIMEOUT_S.
# Probe connections last milliseconds; DRAIN_QUIET_S rides over them, and over
# a client reconnecting between two requests.
#
# /proc/net/tcp and tcp6 list the sockets of this network namespace (the pod's),
# one per line: "sl local_address rem_address st ...", addresses as
# HEXADDRESS:HEXPORT, state 01 = ESTABLISHED. Pure bash: no ss or netstat in
# the image. Each table is read whole before it is parsed: bash's `read` on a
# file reads a little and seeks back to the line's end, and a table that changes
# between two of those reads (sockets opening and closing anywhere in the
# namespace) can skip a line, so that an open connection went uncounted in
# about 1 poll in 200 while other connections came and went.
count_connections() {
    local port_hex count=0 file table fields
    port_hex=$(printf '%04X' "$inference_port")
    for file in /proc/net/tcp /proc/net/tcp6; do
        [[ -r "$file" ]] || continue
        table=$(< "$file")
        while read -r -a fields; do
            if [[ "${fields[3]:-}" == 01 && "${fields[1]##*:}" == "$port_hex" ]]; then
                count=$((count + 1))
            fi
        done <<< "$table"
    done
    echo "$count"
}

# Milliseconds since the epoch (EPOCHREALTIME is bash 5's; whole seconds before).
now_ms() {
    if [[ -n "${EPOCHREALTIME:-}" ]]; then
        local now="${EPOCHREALTIME/[.,]/}"
        echo $((10#$now / 1000))
    else
        echo $((SECONDS * 1000))
    fi
}

# Marks the container as draining and waits until nothing is in flight (see
# above), for at most DRAIN_TIMEOUT_S. TorchServe itself cannot be told to
# refuse new requests while it finishes the running ones (unregistering or
# scaling the model to 0 workers kills them), so it serves whatever still
# reaches it; the marker only turns the readiness check off, which is what
# routes traffic: Kubernetes' endpoints, Docker's health status, a load
# balancer's health check. A request that arrives anyway keeps the drain going.
drain() {
    if ! : > "$DRAIN_MARKER"; then
        echo "entrypoint: cannot create the drain marker $DRAIN_MARKER; readiness keeps passing" >&2
    fi
    echo "entrypoint: draining: readiness now fails; waiting up to ${DRAIN_TIMEOUT_S} s for the" \
        "connections to port $inference_port to close"
    local now deadline next_report quiet_since=-1 num_connections
    now=$(now_ms)
    deadline=$((now + DRAIN_TIMEOUT_S * 1000))
    next_report=$((now + 10000))
    while :; do
        if (( num_signals > 1 )); then
            echo "entrypoint: second signal: stopping without waiting for the requests in flight" >&2
            return
        fi
        if ! kill -0 "$ts_pid" 2>/dev/null; then
            return
        fi
        num_connections=$(count_connections)
        now=$(now_ms)
        if (( num_connections > 0 )); then
            quiet_since=-1
        elif (( quiet_since < 0 )); then
            quiet_since=$now
        fi
        if (( quiet_since >= 0 && now - quiet_since >= DRAIN_QUIET_S * 1000 )); then
            echo "entrypoint: drained: no connection to port $inference_port for ${DRAIN_QUIET_S} s"
            return
        fi
        if (( now >= deadline )); then
            echo "entrypoint: DRAIN_TIMEOUT_S (${DRAIN_TIMEOUT_S} s) is over with $num_connections" \
                "connection(s) to port $inference_port still open: stopping anyway, which cuts" \
                "their requests" >&2
            return
        fi
        if (( now >= next_report )); then
            echo "entrypoint: draining: $num_connections connection(s) open," \
                "$(( (deadline - now) / 1000 )) s left"
            next_report=$((now + 10000))
        fi
        sleep "$DRAIN_POLL_S"
    done
}

# A marker left by this pod's previous container would keep the new one unready
# forever: /tmp is a volume that outlives a container restart in Kubernetes, and
# the kubelet runs the preStop hook before a liveness restart too.
rm -f "$DRAIN_MARKER"

# `docker stop` and Kubernetes send SIGTERM to this script (through tini). The
# torchserve command is only a launcher waiting on the Java frontend, and it
# dies on SIGTERM without passing it on; `torchserve --stop` is the supported
# way to stop the frontend, which then stops its model workers. The trap only
# counts the signal: the drain runs in the loop below, where bash can wait on
# the launcher again. It is set before the start, so that no SIGTERM can
# arrive without it.
num_signals=0
signalled=0
stopping=0
trap 'num_signals=$((num_signals + 1)); signalled=1' TERM INT

echo "entrypoint: loading ${models[*]} from $MODEL_STORE"
torchserve "${args[@]}" "$@" &
ts_pid=$!

# A trapped signal interrupts `wait` (the trap sets `signalled`) while the
# launcher still runs: drain, stop, then wait again for the launcher's own
# status, which bash keeps even when the launcher ends in the meantime.
while :; do
    signalled=0
    wait "$ts_pid" && rc=0 || rc=$?
    (( signalled )) || break
    if (( ! stopping )); then
        stopping=1
        drain
        echo "entrypoint: stopping TorchServe"
        torchserve --stop || echo "entrypoint: torchserve --stop failed" >&2
    fi
done
# The launcher exits 0 even when the Java frontend dies. A server that ends
# without being asked to has failed, whatever the status: say so, so that
# restart policies (docker run --restart on-failure) apply.
if (( ! stopping && rc == 0 )); then
    echo "entrypoint: TorchServe exited without being asked to stop; see the log above." >&2
    rc=1
fi
exit "$rc"
