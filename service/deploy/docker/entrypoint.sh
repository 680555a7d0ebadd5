#!/bin/sh
# Container entrypoint.
#   gpt2-entrypoint [flags of python -m service]   prepare the model folder if needed, then serve
#   gpt2-entrypoint --prepare-only                 prepare the model folder if needed, then exit
#   gpt2-entrypoint COMMAND [ARGS]                 run COMMAND as is (e.g. python -m weights.prepare --help)
set -eu

case "${1:-}" in
    "" | -*) ;;
    *) exec "$@" ;;
esac

model_dir="${GPT2_MODEL_DIR:-/models/gpt2}"
volume_dir="$(dirname "$model_dir")"

# Only an absent or empty folder is prepared: a folder the user mounted with their own
# checkpoint is served as it is (the server checks it strictly) and never overwritten.
has_files() { [ -d "$1" ] && [ -n "$(ls -A "$1")" ]; }

if ! has_files "$model_dir"; then
    mkdir -p "$volume_dir"
    # Replicas share one volume and start together: the first to take the lock prepares, the
    # others wait for it and then find the folder there.
    exec 9>"$volume_dir/.prepare.lock"
    flock 9
    if ! has_files "$model_dir"; then
        # weights.prepare builds in a sibling folder and renames it into place: the folder
        # itself must not be a mount point.
        if [ -d "$model_dir" ] && ! rmdir "$model_dir" 2>/dev/null; then
            echo "gpt2-entrypoint: $model_dir is an empty mount point; mount the volume at $volume_dir instead" >&2
            exit 1
        fi
        echo "gpt2-entrypoint: $model_dir is empty: preparing the default model" >&2
        # GPT2_PREPARE_ARGS holds extra flags (e.g. "--source random"): split on purpose.
        # shellcheck disable=SC2086
        python -m weights.prepare --out "$model_dir" ${GPT2_PREPARE_ARGS:-}
    else
        echo "gpt2-entrypoint: $model_dir was prepared by another replica" >&2
    fi
    exec 9>&-
fi

if [ "${1:-}" = "--prepare-only" ]; then
    exit 0
fi
exec python -m service "$@"
