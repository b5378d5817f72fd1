// fleetcuda lab stand-in: placeholder for causal-conv1d 1.7.0 causal_conv1d.cpp; never compiled.
// The real file's includes, which the stand-in torch reads to fail as the real compile does without CUDA headers:
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/Context.h>
#include <torch/python.h>
