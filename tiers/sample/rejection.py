"""The speculative acceptance rule (rejection sampling over drafted tokens).

The draft proposes k tokens; the target scores all k+1 positions in one forward. The rule keeps
the output distribution exactly the target's (Leviathan et al. 2023, Chen et al. 2023); for greedy
requests both distributions are one-hot, so it reduces to "accept while the target's argmax agrees".
"""

from __future__ import annotations

import torch

__all__ = ["accept_batch"]


def accept_batch(
    draft_tokens: torch.Tensor,
    num_drafted: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule over R rows at once (padded to K drafts each).

    draft_tokens: [R, K] long   x_j, drafted tokens (padding anywhere past num_drafted)
    num_drafted:  [R]    long   k_r <= K
    draft_probs:  [R, K, V]     p_j, the distribution x_j was drawn from
    target_probs: [R, K+1, V]   q_j, the target's at the same positions (+ the bonus one)
    uniform:      [R, K]        u_j ~ U[0, 1)

    Returns ``(num_accepted [R], next_dist [R, V])``: x_0..x_{a-1} are kept, and the row's next
    token is drawn from ``next_dist`` - the residual ``norm(max(0, q_a - p_a))`` after a
    rejection, which restores the target's law (Leviathan et al. 2023), or ``q_k`` (a free bonus
    token) when every draft was accepted. For greedy rows both laws are one-hot, and this reduces to
    "accept while the target's argmax agrees, then take its argmax".
    """
    r, k = draft_tokens.shape
    q_x = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # [R, K]
    p_x = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    # q >= p: always accept; otherwise accept with probability q/p.
    ok = (uniform * p_x <= q_x) & (p_x > 0) & (q_x > 0)
    ok &= torch.arange(k, device=draft_tokens.device)[None, :] < num_drafted[:, None]
    # Accepted = length of the leading run of True.
    num_accepted = torch.cumprod(ok.to(torch.long), dim=1).sum(dim=1)  # [R]
    rows = torch.arange(r, device=draft_tokens.device)
    at = num_accepted.clamp(max=k - 1) if k else num_accepted
    q_a = target_probs[rows, num_accepted]  # [R, V]
    if k:
        residual = (q_a - draft_probs[rows, at]).clamp(min=0.0)
        total = residual.sum(dim=-1, keepdim=True)
        rejected = (num_accepted < num_drafted)[:, None] & (total > 0)
        next_dist = torch.where(rejected, residual / total.clamp(min=1e-30), q_a)
    else:
        next_dist = q_a
    return num_accepted, next_dist
