#!/bin/bash
# Runs the fault-injection suite's smoke set (see tools/BUILD).
set -euo pipefail
exec /usr/bin/python3 "$1" --smoke --resnet "$2" --launch "$3"
