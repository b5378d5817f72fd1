"""fleetcuda lab stand-in for torch._logging: the glog-style prefix real torch puts on its log records.

Real torch 2.11 prints e.g. ``W1130 12:24:35.694000 5732 torch/utils/cpp_extension.py:178] No CUDA runtime is found,
using CUDA_HOME='/usr/local/cuda'`` on stderr; tests and log scrapers see the same shape here.
"""

import logging
import os
import sys

_LEVELS = {"DEBUG": "D", "INFO": "I", "WARNING": "W", "ERROR": "E", "CRITICAL": "C"}


def _relative(path: str) -> str:
    # torch shows the module path relative to the sys.path entry it was imported from.
    best = path
    for entry in sys.path:
        if entry and path.startswith(entry.rstrip(os.sep) + os.sep):
            candidate = os.path.relpath(path, entry)
            if len(candidate) < len(best):
                best = candidate
    return best


class TorchLogsFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        stamp = self.formatTime(record, "%m%d %H:%M:%S")
        prefix = (
            f"{_LEVELS.get(record.levelname, record.levelname)}{stamp}.{int(record.msecs * 1000):06d} "
            f"{record.process} {_relative(record.pathname)}:{record.lineno}]"
        )
        return "\n".join(f"{prefix} {line}" for line in message.split("\n"))


def _init_logs() -> None:
    log = logging.getLogger("torch")
    if any(isinstance(h.formatter, TorchLogsFormatter) for h in log.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(TorchLogsFormatter())
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    log.propagate = False
