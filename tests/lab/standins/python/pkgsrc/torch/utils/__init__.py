"""fleetcuda lab stand-in for torch.utils: ``cmake_prefix_path``; ``cpp_extension`` is imported on demand."""

import os.path as _osp

cmake_prefix_path = _osp.join(_osp.dirname(_osp.dirname(__file__)), "share", "cmake")
