#!/bin/bash
# tools/exclude_locally.sh in a fresh clone without .git/info (it makes the
# folder), run twice (each pattern written once), from another directory
# (the clone is the script's, not the caller's).
set -euo pipefail
tool=$(realpath "$1")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git init -q "$tmp/repo"
rm -rf "$tmp/repo/.git/info"
mkdir -p "$tmp/repo/tools" "$tmp/elsewhere"
cp "$tool" "$tmp/repo/tools/"
cd "$tmp/elsewhere"
"$tmp/repo/tools/exclude_locally.sh" /.gpu/ /.gpudata/
"$tmp/repo/tools/exclude_locally.sh" /.gpu/
[ "$(cat "$tmp/repo/.git/info/exclude")" = "$(printf '/.gpu/\n/.gpudata/')" ] || { cat "$tmp/repo/.git/info/exclude"; exit 1; }
mkdir "$tmp/repo/.gpu" && touch "$tmp/repo/.gpu/x" "$tmp/repo/kept"
st=$(git -C "$tmp/repo" status --porcelain)
grep -qx '?? kept' <<<"$st" && ! grep -q gpu <<<"$st" || { echo "$st"; exit 1; }
if "$tmp/repo/tools/exclude_locally.sh" 2>/dev/null; then echo "accepted no pattern"; exit 1; fi
echo "exclude_locally: ok"
