"""fleetcuda: provision CUDA build toolchains into Proxmox LXC containers over SSH, idempotently."""

__version__ = "0.1.0"
