"""Sampling: logits processors, the sampler, prompt logprobs, and the grammar engine behind
structured outputs. May import core."""
