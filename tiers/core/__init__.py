"""Torch-free request state: sequences, outputs, the token constraint protocol, the KV block manager;
``sched/`` is the scheduler. Imports nothing else of ``tiers``."""
