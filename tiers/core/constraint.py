"""The contract between the engine and a grammar matcher (structured outputs, tool calls).

The engine knows nothing of grammars: a sequence whose ``SamplingParams.constraint`` is set gets
its logits masked to the tokens the constraint allows before every sample, including speculative
draft proposals and the target's verification positions, and reports every token it keeps. A
grammar library (``tiers/sample/grammar.py``) implements this protocol; tests can implement it with a
plain allow-list.

Speculation: to check k draft tokens the engine advances the matcher through them (``accept``),
asking ``fill_mask`` at each position, then rolls back (``rollback``) what the target rejected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["TokenConstraint"]


class TokenConstraint(Protocol):
    def fill_mask(self, mask: torch.Tensor) -> None:
        """Write the tokens allowed next into ``mask``: a bool ``[V]`` row, True = allowed.

        ``V`` is the logits' width, which may exceed the tokenizer's vocabulary (padded heads);
        ids past the vocabulary must stay False."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and no state change) when the grammar forbids it."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""
        ...

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: the engine finishes the sequence with ``stop``."""
        ...
