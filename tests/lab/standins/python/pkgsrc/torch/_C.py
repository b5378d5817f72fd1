"""fleetcuda lab stand-in for torch._C (the real one is a compiled extension): the few attributes callers read."""

# Official torch 2.x Linux wheels are built with the C++11 ABI; causal-conv1d puts this into its wheel name.
_GLIBCXX_USE_CXX11_ABI = True

NO_DRIVER_MESSAGE = (
    "Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed a driver from "
    "http://www.nvidia.com/Download/index.aspx"
)


def _cuda_getDeviceCount() -> int:  # noqa: N802 (torch's name)
    # The lab has no GPU: the CUDA runtime reports no devices instead of failing.
    return 0


def _cuda_init() -> None:
    # What the CUDA build of torch raises at lazy CUDA initialisation on a machine without the NVIDIA driver.
    raise RuntimeError(NO_DRIVER_MESSAGE)


def _cuda_getArchFlags() -> str | None:  # noqa: N802 (torch's name)
    return None
