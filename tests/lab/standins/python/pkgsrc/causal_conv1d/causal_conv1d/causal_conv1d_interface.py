"""fleetcuda lab stand-in for causal_conv1d.causal_conv1d_interface (causal-conv1d 1.7.0)."""

import os
from typing import Any

import torch

# The real module imports the compiled extension here; a torch other than the one it was built against fails then.
_SYMBOL = "_ZN3c104cuda9SetDeviceEab"  # c10::cuda::SetDevice(signed char, bool), what a torch upgrade breaks
try:
    from causal_conv1d import _build_info
except ImportError:
    # Never built (e.g. CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE): the real package has no extension to import either.
    raise ModuleNotFoundError("No module named 'causal_conv1d_cuda'", name="causal_conv1d_cuda") from None

if torch.__version__ != _build_info.TORCH_VERSION:
    _so = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), _build_info.EXTENSION_FILENAME)
    raise ImportError(f"{_so}: undefined symbol: {_SYMBOL}", name="causal_conv1d_cuda", path=_so)


def _no_gpu(op: str) -> None:
    try:
        torch.cuda._lazy_init()
    except RuntimeError as err:
        raise RuntimeError(f"{op}: no CUDA GPU is available (fleetcuda lab stand-in of causal-conv1d): {err}") from None
    raise RuntimeError(f"{op}: no CUDA GPU is available (fleetcuda lab stand-in of causal-conv1d)")


def causal_conv1d_fn(x: Any, weight: Any, bias: Any = None, *args: Any, **kwargs: Any) -> Any:
    """Stand-in of the causal depthwise conv1d kernel: always raises RuntimeError (the lab has no GPU)."""
    _no_gpu("causal_conv1d_fn")


def causal_conv1d_update(x: Any, conv_state: Any, weight: Any, *args: Any, **kwargs: Any) -> Any:
    """Stand-in of the single-step update kernel: always raises RuntimeError (the lab has no GPU)."""
    _no_gpu("causal_conv1d_update")
