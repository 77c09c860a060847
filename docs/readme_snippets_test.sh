#!/bin/bash
# Every ```cpp block of the README appears, line for line (leading spaces
# aside), in docs/readme_snippets_test.cc, which compiles and runs them: the
# README cannot show code that does not build.
set -uo pipefail
readme=$1 code=$2
strip() { sed 's/^[[:space:]]*//'; }
have=$(strip <"$code")
n=0 fail=0
block=""
inside=0
while IFS= read -r line; do
  if [ $inside -eq 0 ] && [ "$line" = '```cpp' ]; then inside=1; block=""; continue; fi
  if [ $inside -eq 1 ] && [ "$line" = '```' ]; then
    inside=0
    n=$((n + 1))
    # Includes and using-directives are the file's own; the rest must be there.
    while IFS= read -r l; do
      case "$l" in "" | "#include"* | "using namespace"*) continue ;; esac
      if ! grep -qxF -- "$l" <<<"$have"; then
        echo "FAIL: README block $n: not in $(basename "$code"): $l"
        fail=1
      fi
    done < <(strip <<<"$block")
    continue
  fi
  [ $inside -eq 1 ] && block+="$line"$'\n'
done <"$readme"
[ "$n" -ge 4 ] || { echo "FAIL: only $n cpp blocks found in the README"; exit 1; }
[ $fail -eq 0 ] && echo "PASS: $n README blocks are compiled by $(basename "$code")"
exit $fail
