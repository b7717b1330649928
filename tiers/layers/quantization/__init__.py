"""Weight-only and weight-activation quantization formats and the model rewrite that installs them.
May import ``tiers.layers``, kernels and core."""
