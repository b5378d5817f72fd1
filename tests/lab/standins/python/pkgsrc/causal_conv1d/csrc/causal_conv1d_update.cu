// fleetcuda lab stand-in: placeholder for causal-conv1d 1.7.0 causal_conv1d_update.cu; never compiled.
