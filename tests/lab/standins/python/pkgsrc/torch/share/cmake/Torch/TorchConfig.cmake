# fleetcuda lab stand-in: NOT the real TorchConfig.cmake. It exists so that torch.utils.cmake_prefix_path points at a
# real directory; configuring against it fails on purpose.
message(FATAL_ERROR "fleetcuda lab stand-in torch: there is no libtorch to link against")
