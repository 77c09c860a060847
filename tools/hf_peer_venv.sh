#!/bin/bash
# Makes the peer Python that //tools:hf_compare_test and
# nn/testdata/hf/make_fixture.py use: a venv at ~/.venvs/hf (or $1) with
# torch, transformers and safetensors from the package index pip is set up
# with (torch's wheels there bring CUDA libraries too, a few GB). Not part
# of tools/setup.sh: the comparison is optional and skips without it.
set -euo pipefail
venv=${1:-$HOME/.venvs/hf}
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch transformers safetensors
"$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
