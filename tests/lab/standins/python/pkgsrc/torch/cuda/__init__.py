"""fleetcuda lab stand-in for torch.cuda on a machine without an NVIDIA GPU or driver (the lab has none).

The wheel is a "CUDA build" (``_is_compiled()`` is True and ``torch.version.cuda`` is set), so code paths that depend
on the CUDA flavour behave as with a real cu128/cu130 wheel; anything that needs a device fails as real torch does.
"""

from torch import _C

__all__ = [
    "current_device",
    "device_count",
    "get_arch_list",
    "get_device_capability",
    "get_device_name",
    "get_device_properties",
    "init",
    "is_available",
    "is_initialized",
]


def _is_compiled() -> bool:
    return True


def device_count() -> int:
    return _C._cuda_getDeviceCount()


def is_available() -> bool:
    return device_count() > 0


def is_initialized() -> bool:
    return False


def _lazy_init() -> None:
    # Real torch initialises CUDA here and raises the driver error when there is none.
    _C._cuda_init()


def init() -> None:
    _lazy_init()


def current_device() -> int:
    _lazy_init()
    return 0


def get_device_properties(device: object = None) -> object:
    _lazy_init()
    raise AssertionError("unreachable: the stand-in never has a device")


def get_device_capability(device: object = None) -> tuple[int, int]:
    """Real torch raises ``RuntimeError: Found no NVIDIA driver on your system...`` here when there is no GPU."""
    get_device_properties(device)
    return (0, 0)


def get_device_name(device: object = None) -> str:
    get_device_properties(device)
    return ""


def get_arch_list() -> list[str]:
    # Empty, as fleetcuda's lab expects with no GPU visible.  Note: torch 2.13's code (read) asks the compiled-in
    # arch flags, so a real CUDA wheel may list e.g. sm_90 even without a GPU; do not rely on [] meaning "no GPU".
    return []
