"""Compiled kernels: the CPU extension's loader (``cpu.py``) beside its C++ sources (``csrc/``).
Imports nothing else of ``tiers``."""
