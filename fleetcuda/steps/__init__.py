"""Step kinds: each module knows how to check, apply and verify its own kind of change."""

from fleetcuda.steps.apt import AptKeyringStep, AptPackagesStep
from fleetcuda.steps.base import Scripts, StepContext, StepSpec
from fleetcuda.steps.envfile import EnvFileStep
from fleetcuda.steps.gpu import GpuPassthroughStep
from fleetcuda.steps.pip import PipInstallStep
from fleetcuda.steps.program import ProgramStep
from fleetcuda.steps.sdist import SdistBuildStep
from fleetcuda.steps.shell import ShellStep

KINDS: dict[str, type[StepSpec]] = {
    "shell": ShellStep,
    "apt_keyring": AptKeyringStep,
    "apt_packages": AptPackagesStep,
    "env_file": EnvFileStep,
    "pip_install": PipInstallStep,
    "sdist_build": SdistBuildStep,
    "program": ProgramStep,
    "gpu_passthrough": GpuPassthroughStep,
}

__all__ = ["KINDS", "Scripts", "StepContext", "StepSpec"]
