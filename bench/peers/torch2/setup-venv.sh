#!/usr/bin/env bash
# Makes a virtualenv with a current PyTorch (2.15, CPU use only) for the peers
# in this folder: FSDP2 fully_shard, CPU autocast + GradScaler, and the
# distributed checkpoint (DCP) on Gloo. A measuring stick, never a dependency.
#   bench/peers/torch2/setup-venv.sh [VENV_DIR]     (default ~/.venvs/torch2-peer)
# The PyPI wheel is a CUDA build: `import torch` needs NVIDIA libraries even on a
# CPU. Where a CUDA 13 toolkit is installed (as on our machines) four small
# wheels complete it; elsewhere a plain `pip install torch==2.15.0` pulls the
# whole NVIDIA set (several GB).
set -euo pipefail
VENV=${1:-$HOME/.venvs/torch2-peer}
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then echo "$VENV ok"; exit 0; fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --no-deps torch==2.15.0
"$VENV/bin/pip" install -q filelock 'typing-extensions>=4.13.0' 'setuptools>=77.0.3' 'sympy>=1.13.3' \
  'networkx>=2.5.1' jinja2 'fsspec>=0.8.5' numpy
"$VENV/bin/pip" install -q --no-deps nvidia-cufile==1.17.1.22 nvidia-cusparselt-cu13==0.8.1 \
  nvidia-nvshmem-cu13==3.7.2 nvidia-nccl-cu13==2.30.7
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'gloo', torch.distributed.is_gloo_available())"
