#!/bin/bash
# tools/hf_compare.py against a live transformers, both ways (logits of
# random GPT2LMHeadModel / LlamaForCausalLM models loaded by ember; ember's
# trained and exported checkpoints loaded by from_pretrained), when a peer
# Python with torch, transformers and safetensors exists:
# $EMBER_PEER_PYTHON, else ~/.venvs/hf/bin/python (tools/hf_peer_venv.sh
# makes it). Elsewhere it passes with a SKIP line; //nn:hf_test's committed
# fixture keeps a smaller check running everywhere.
set -euo pipefail
ckpt=$1 gpt=$2 script=$3
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
py=${EMBER_PEER_PYTHON:-$home/.venvs/hf/bin/python}
if [[ ! -x $py ]] || ! "$py" -c "import torch, transformers, safetensors" >/dev/null 2>&1; then
  echo "SKIP: no peer Python with torch, transformers and safetensors at $py" \
       "(set EMBER_PEER_PYTHON, or run tools/hf_peer_venv.sh); nothing compared against transformers"
  exit 0
fi
work="${TEST_TMPDIR:-$(mktemp -d)}/hf_compare"
rm -rf "$work"
# Offline, and transformers' caches inside the test's own directory.
export HF_HUB_OFFLINE=1 HF_HOME="$work/hf_home" TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 \
  TQDM_DISABLE=1 OMP_NUM_THREADS=1
"$py" -c "import torch, transformers; print('peer: torch', torch.__version__, 'transformers', transformers.__version__)"
"$py" "$script" --ckpt "$ckpt" --gpt "$gpt" --work "$work"
