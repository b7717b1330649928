"""The scheduler: batches, fair sharing between callers, draft tables and the step-cost pacing model.
Torch-free; imports only ``tiers.core``."""
