#!/usr/bin/env bash
# exclude_locally.sh PATTERN...: adds each pattern, once, to the exclude file
# of the clone this script lies in (.git/info/exclude: ignored here, not in
# the shared .gitignore), for what the GPU scripts write into the tree
# (.gpu/, .gpudata/). A fresh clone may have no info/ folder; a worktree's
# exclude file is the main clone's.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: exclude_locally.sh PATTERN..." >&2; exit 2; }
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
exclude=$(git -C "$root" rev-parse --git-path info/exclude)
case $exclude in /*) ;; *) exclude="$root/$exclude" ;; esac
mkdir -p "$(dirname "$exclude")"
for p in "$@"; do grep -qxF -- "$p" "$exclude" 2>/dev/null || echo "$p" >>"$exclude"; done
