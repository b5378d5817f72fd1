"""fleetcuda lab stand-in: the failure every fla kernel gives in the lab, which has no GPU."""

from typing import NoReturn

import torch


def no_gpu(op: str) -> NoReturn:
    try:
        torch.cuda._lazy_init()
    except RuntimeError as err:
        raise RuntimeError(f"{op}: no CUDA GPU is available (fleetcuda lab stand-in of fla-core): {err}") from None
    raise RuntimeError(f"{op}: no CUDA GPU is available (fleetcuda lab stand-in of fla-core)")
