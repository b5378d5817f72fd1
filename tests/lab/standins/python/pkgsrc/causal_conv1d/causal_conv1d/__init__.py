"""fleetcuda lab stand-in for causal-conv1d 1.7.0: NOT the real package (no CUDA kernels).

Import behaves like the real one built from source: it needs torch, and it fails with the real ABI-break ImportError
(``...causal_conv1d_cuda...so: undefined symbol: _ZN3c104cuda9SetDeviceEab``) when the installed torch is not the one
recorded at build time in ``causal_conv1d/_build_info.py``.  Calling the functions raises RuntimeError: no GPU.
"""

__version__ = "1.7.0"

from causal_conv1d.causal_conv1d_interface import causal_conv1d_fn, causal_conv1d_update  # noqa: E402

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]
STANDIN = "fleetcuda lab stand-in"
