"""Attention backends over the paged KV pool (FlexAttention's block mask and friends). May import
kernels and core."""
