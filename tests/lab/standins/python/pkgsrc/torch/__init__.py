"""fleetcuda lab stand-in for PyTorch 2.11 (a CUDA build): NOT the real torch.

It has no tensors and no kernels.  It reproduces only what fleetcuda's recipes and verifications touch: the version
attributes, ``torch.cuda`` on a machine without a GPU, and ``torch.utils.cpp_extension`` (CUDA_HOME discovery, the
nvcc/torch CUDA version check and a BuildExtension that pretends to compile).  ``torch/version.py`` is written by
tests/lab/standins/python/build_wheelhouse.py, one wheel per CUDA flavour.
"""

from torch import _C as _C
from torch import _logging as _logging
from torch import cuda as cuda
from torch import utils as utils
from torch import version as version
from torch.version import __version__ as __version__

STANDIN = "fleetcuda lab stand-in"

# Real torch installs its glog-style handler on the "torch" logger at import; cpp_extension's warnings go through it.
_logging._init_logs()
