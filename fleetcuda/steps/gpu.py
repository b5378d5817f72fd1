"""`kind: gpu_passthrough`: whether the container can use the host's NVIDIA GPUs, as the step's verify (an
assertion, nothing to apply). It runs on the host (`on: host`, implied):

    - name: gpu-passthrough
      kind: gpu_passthrough
      cuda_version: "{{ cuda_version }}"   # the CUDA torch and nvcc use: the driver must support it
      require_devices: true                # false: the /dev/nvidia* findings are said, not required

The host's driver version, the container config's passthrough lines (`[sudo -n] pct config VMID`), and what
the container sees (its libcuda.so / libnvidia-ml.so versions, its /dev/nvidia* nodes, read by
gpu_container_probe.sh through the same `pct exec ... env -i ... bash -c` as any step), all judged by
fleetcuda/remote/gpu_passthrough.py. On a target without containers, the machine itself.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import Field

from fleetcuda.plan.command import quote
from fleetcuda.remote import program, python_heredoc, shell_text
from fleetcuda.steps.base import Scripts, StepContext, StepSpec

# The host's own Python (the program needs nothing beyond its standard library): Proxmox VE ships one.
HOST_PYTHON = "python3"


class GpuPassthroughStep(StepSpec):
    kind: Literal["gpu_passthrough"]
    on: Literal["host"] = "host"
    cuda_version: str = Field(default="", description="X.Y (or X) that torch and nvcc use; empty: not checked")
    require_devices: str | bool = Field(default=True, description="the /dev/nvidia* nodes must open (false: said only)")

    def scripts(self, ctx: StepContext) -> Scripts:
        if ctx.in_target is None:
            raise ValueError("gpu_passthrough is planned for the host only")
        cuda = ctx.raw(self.cuda_version).strip()
        # `auto` is a fact not read yet: the target is planned again once it is (planner.plan_run).
        if cuda and cuda != "auto" and not re.fullmatch(r"\d+(?:\.\d+){0,2}", cuda):
            # Refused at plan time, where the error names the recipe's line; the program fails on it too.
            raise ValueError(f"cuda_version {cuda!r} is not a CUDA version: expected X.Y as torch and nvcc name "
                             "it (12.8), or X (13)")
        args = ["--container-probe", json.dumps(ctx.in_target(shell_text("gpu_container_probe")))]
        if ctx.pct is not None:
            args += ["--pct-config", json.dumps(ctx.pct("config"))]
        args += ["--cuda-version", cuda,
                 "--require-devices", ctx.raw(str(self.require_devices).lower())]
        verify = python_heredoc(HOST_PYTHON, "gpu_passthrough", " ".join(quote(a) for a in args))
        expect = self.description or ("host driver = the container's libcuda/libnvidia-ml version; /dev/nvidia* "
                                      "usable; passed through in the container's config; driver supports CUDA "
                                      + (cuda or "(not checked)"))
        return Scripts(None, None, verify, expect=expect)

    def describe(self, ctx: StepContext) -> str:
        cuda = ctx.raw(self.cuda_version).strip()
        devices = ctx.raw(str(self.require_devices).lower())
        required = "required" if devices.strip().lower() not in ("", "0", "false", "no", "off", "none") else \
            "said, not required"
        return (f"program: gpu_passthrough (sha256:{program('gpu_passthrough').sha256[:12]}) on the host, an "
                "assertion: host driver = the container's libcuda/libnvidia-ml; /dev/nvidia* usable "
                f"({required}); passed through in the container's config; a driver for CUDA {cuda or '(any)'}")
