#!/bin/bash
# Every ```cpp block of the documentation appears, line for line (leading
# spaces aside), in the C++ file(s) that compile it, so no page can show code
# that does not build. Arguments: PAGE=CODE[,CODE...] pairs, e.g.
#   README.md=docs/readme_snippets_test.cc docs/ddp.md=docs/docs_snippets_test.cc
set -uo pipefail
strip() { sed 's/^[[:space:]]*//'; }
fail=0 total=0
for pair in "$@"; do
  page=${pair%%=*}
  codes=${pair#*=}
  have=""
  IFS=',' read -ra files <<<"$codes"
  for c in "${files[@]}"; do have+=$(strip <"$c")$'\n'; done
  n=0 inside=0 block=""
  while IFS= read -r line; do
    if [ $inside -eq 0 ] && [ "$line" = '```cpp' ]; then inside=1; block=""; continue; fi
    if [ $inside -eq 1 ] && [ "$line" = '```' ]; then
      inside=0
      n=$((n + 1))
      # Includes and using-directives are the files' own; the rest must be there.
      while IFS= read -r l; do
        case "$l" in "" | "#include"* | "using namespace"*) continue ;; esac
        if ! grep -qxF -- "$l" <<<"$have"; then
          echo "FAIL: $(basename "$page") block $n: not in $codes: $l"
          fail=1
        fi
      done < <(strip <<<"$block")
      continue
    fi
    [ $inside -eq 1 ] && block+="$line"$'\n'
  done <"$page"
  total=$((total + n))
done
[ $fail -eq 0 ] && echo "PASS: $total C++ blocks in $# page(s) are compiled"
exit $fail
