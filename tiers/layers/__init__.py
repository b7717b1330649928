"""Drop-in layers: fused projections, packed fp32 linears; ``quantization/`` holds the weight
formats. May import kernels and core."""
