#!/bin/bash
# Builds a cp312 causal-conv1d 1.7.0 wheel for sm_90 here, with PyPI's nvcc 13.0 (NVIDIA's debs as the lab repackages them)
set -euxo pipefail
cd /work/gpu
rm -rf cuda && mkdir cuda
for d in /var/lib/fleetcuda-lab/cuda13-debs/*.deb; do dpkg -x "$d" cuda; done
export CUDA_HOME=/work/gpu/cuda/usr/local/cuda-13.0
ls $CUDA_HOME/bin
[ -x venv/bin/python ] || /root/.pyenv/versions/3.12.1/bin/python -m venv venv
true
venv/bin/pip install -q numpy typing_extensions sympy filelock jinja2 networkx fsspec wheel setuptools packaging ninja
venv/bin/python -c 'import torch; print(torch.__version__, torch.version.cuda)'
rm -rf src && mkdir src && tar -xzf /var/lib/fleetcuda-lab/real/pypi/causal_conv1d-1.7.0.tar.gz -C src
cd src/causal_conv1d-1.7.0
export PATH=$CUDA_HOME/bin:/work/gpu/venv/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=2
grep -n "gencode\|arch=compute" setup.py | head -30
# build only sm_90 (the H200): the same edit fleetcuda's arch_patch makes
# fleetcuda's own arch restriction (remote/arch_patch.py), as the recipe's cuda_archs: 90 does
python3 /work/main/fleetcuda/remote/arch_patch.py setup.py 90
grep -n "arch=compute" setup.py
time /work/gpu/venv/bin/pip wheel --no-build-isolation --no-deps -w /work/gpu/out . 
ls -la /work/gpu/out
