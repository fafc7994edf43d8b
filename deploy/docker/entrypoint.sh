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
#
# Any arguments are passed on to torchserve, e.g. --log-config FILE.
set -euo pipefail

MODEL_NAMES="${MODEL_NAMES:-qwen-coder-spec}"
MODEL_STORE="${MODEL_STORE:-/home/model-server/model-store}"
TS_CONFIG="${TS_CONFIG:-/home/model-server/config.properties}"
DISABLE_TOKEN_AUTH="${DISABLE_TOKEN_AUTH:-false}"

fail() {
    echo "entrypoint: $*" >&2
    exit 1
}

[[ -f "$TS_CONFIG" ]] || fail "TorchServe config $TS_CONFIG not found (set TS_CONFIG)."
[[ -d "$MODEL_STORE" ]] || fail "model store $MODEL_STORE not found: mount it or set MODEL_STORE."

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

# `docker stop` and Kubernetes send SIGTERM to this script (through tini). The
# torchserve command is only a launcher waiting on the Java frontend, and it
# dies on SIGTERM without passing it on; `torchserve --stop` is the supported
# way to stop the frontend, which then stops its model workers. The trap is set
# before the start, so that no SIGTERM can arrive without it.
signalled=0
stopping=0
trap 'signalled=1; stopping=1; echo "entrypoint: stopping TorchServe"; torchserve --stop' TERM INT

echo "entrypoint: loading ${models[*]} from $MODEL_STORE"
torchserve "${args[@]}" "$@" &
ts_pid=$!

# A trapped signal interrupts `wait` (the trap sets `signalled`) while the
# launcher may still be stopping: wait again for the launcher's own status,
# which bash keeps even when the launcher ends during the trap.
while :; do
    signalled=0
    wait "$ts_pid" && rc=0 || rc=$?
    (( signalled )) || break
done
# The launcher exits 0 even when the Java frontend dies. A server that ends
# without being asked to has failed, whatever the status: say so, so that
# restart policies (docker run --restart on-failure) apply.
if (( ! stopping && rc == 0 )); then
    echo "entrypoint: TorchServe exited without being asked to stop; see the log above." >&2
    rc=1
fi
exit "$rc"
