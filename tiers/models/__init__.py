"""Model code and loading: the fast Llama decoder, loading from HF / GGUF / the embedded default,
and memory planning. May import attention, layers, kernels and core."""
