#!/usr/bin/env bash
# A command on the GPU machine that may outlast one call (DEVICE.md in ../shared: ten minutes a
# call; the machine stays warm while the next call comes at once): started in a session of its own,
# so the call's end does not stop it, and waited for by later calls.
#
#   tools/gpu_detached.sh start NAME COMMAND...   start COMMAND (in the project root), return at once
#   tools/gpu_detached.sh wait NAME SECONDS [OUT] wait up to SECONDS for it; copy its folder to OUT
#
# A run's folder is $FLASHV41_RUNS/NAME (default /tmp/flashv41-runs/NAME): output.txt (its stdout
# and stderr), rc (its exit status, written when it ends), and whatever the command writes there
# (give it "$FLASHV41_RUN_DIR", exported to it, as its log folder). The command runs in src/ there,
# a copy of the project (without .git; .kernel-cache linked), so that a later call's copy of the
# working tree cannot move files, or the folder itself, from under it. `wait` prints the output's last
# lines and exits with the command's status once it has ended, or 3 while it still runs (call `wait`
# again in the next call). The whole GPU suite, when it needs more than one call:
#   tools/gpu_detached.sh start suite bash tools/gpu_suite.sh /tmp/flashv41-runs/suite/log
#   tools/gpu_detached.sh wait suite 560 "$OUT"          (then again in the next call, at once)
set -uo pipefail

action=${1:?usage: tools/gpu_detached.sh start NAME COMMAND... | wait NAME SECONDS [OUT]}
name=${2:?usage: tools/gpu_detached.sh start NAME COMMAND... | wait NAME SECONDS [OUT]}
shift 2
runs=${FLASHV41_RUNS:-/tmp/flashv41-runs}
dir="$runs/$name"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

case "$action" in
    start)
        [ $# -gt 0 ] || { echo "tools/gpu_detached.sh start $name: no command" >&2; exit 2; }
        if [ -d "$dir" ] && [ ! -e "$dir/rc" ]; then
            echo "tools/gpu_detached.sh: '$name' is still running ($dir)" >&2
            exit 2
        fi
        rm -rf "$dir"
        mkdir -p "$dir/src"
        tar -C "$here" --exclude=./.git --exclude=./.kernel-cache -cf - . | tar -C "$dir/src" -xf - || exit 2
        mkdir -p "$here/.kernel-cache"
        ln -s "$here/.kernel-cache" "$dir/src/.kernel-cache"
        (cd "$dir/src" && FLASHV41_RUN_DIR="$dir" setsid nohup bash -c '"$@"; echo $? > "$FLASHV41_RUN_DIR/rc"' \
            detached "$@" > "$dir/output.txt" 2>&1 < /dev/null &)
        echo "started '$name': $*  (folder $dir)"
        ;;
    wait)
        seconds=${1:?usage: tools/gpu_detached.sh wait NAME SECONDS [OUT]}
        out=${2:-}
        [ -d "$dir" ] || { echo "tools/gpu_detached.sh: no run '$name' in $runs" >&2; exit 2; }
        deadline=$(( $(date +%s) + seconds ))
        while [ ! -e "$dir/rc" ] && [ "$(date +%s)" -lt "$deadline" ]; do
            sleep 5
        done
        tail -n 30 "$dir/output.txt"
        if [ -n "$out" ]; then  # everything but the project's copy
            mkdir -p "$out"
            find "$dir" -mindepth 1 -maxdepth 1 ! -name src -exec cp -r {} "$out/" \;
        fi
        if [ -e "$dir/rc" ]; then
            echo "== '$name' ended: exit $(cat "$dir/rc")"
            exit "$(cat "$dir/rc")"
        fi
        echo "== '$name' still running; call 'tools/gpu_detached.sh wait $name SECONDS' again"
        exit 3
        ;;
    *)
        echo "tools/gpu_detached.sh: unknown action '$action' (start, wait)" >&2
        exit 2 ;;
esac
