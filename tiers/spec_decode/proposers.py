"""Speculative proposers behind one interface: ``propose(batch, k)``, ``on_accept``, ``forget``.

``ModelDraft`` drafts with a lower tier's model: it feeds that model its chunks (catch-up and the
rows' backlogs, in the draft's own KV pool), then proposes up to k tokens for each speculating row,
one draft forward per proposed position. ``NgramDraft`` proposes by prompt lookup
(``ngram.NgramProposer``): no model and no KV. Neither writes a sequence's state: a proposal
says what the draft wrote into its KV (``Proposal.fed``), and ``Scheduler.update_from_output``
applies it with the target's outcome.

A constrained row's grammar must vet each drafted token, so ``ModelDraft`` advances the row's
matcher as it proposes; ``on_accept`` rolls back what the target rejected, and ``forget`` all of
it when a step fails before the target settled it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Literal, Protocol

import torch

from tiers.core.block_manager import BlockManager
from tiers.core.sched.scheduler import ScheduledBatch
from tiers.core.sequence import Sequence
from tiers.sample.sampler import Draft, propose_tokens
from tiers.spec_decode.controller import SpecController, fastest
from tiers.spec_decode.ngram import NgramProposer
from tiers.worker.model_runner import ModelRunner, RowInput

__all__ = ["DraftSource", "ModelDraft", "NgramDraft", "Proposal", "Proposer", "make_proposer"]

DraftSource = ModelRunner | NgramProposer
"""What a tier drafts with: the tier below's runner (its model on its own KV pool) or an n-gram lookup."""


@dataclass(slots=True)
class Proposal:
    drafts: list[Draft | None]
    """Each row's proposal (``None``: the row does not draft this step)."""
    fed: list[int]
    """Tokens each row's draft wrote into its KV this step (its chunk, then its proposals)."""

    @classmethod
    def empty(cls, rows: int) -> Proposal:
        return cls([None] * rows, [0] * rows)

    def target_rows(self, batch: ScheduledBatch) -> list[RowInput]:
        """The target's forward: each row's chunk, and the drafts it verifies (logits at every
        position then), else the logits of its last token once the prompt is all fed."""
        rows = []
        for seq, n, d in zip(batch.seqs, batch.num_new_tokens, self.drafts, strict=True):
            start = seq.num_computed_tokens
            fed = seq.token_ids[start : start + n]
            last: Literal["all", "last", "none"] = "last" if start + n == seq.num_tokens else "none"
            if seq.prompt_logprobs_pending:
                last = "all"  # every prompt position's logits (sampling.split_prompt_logprobs)
            if d is not None and d.tokens:
                fed, last = fed + d.tokens, "all"
            rows.append(RowInput(seq.block_table.blocks, start, fed, last))
        return rows


class Proposer(Protocol):
    blocks: BlockManager
    """The pool of the draft tables the scheduler grows (bookkeeping only for n-gram drafts)."""
    ragged: bool
    """Rows of one step may propose different numbers of tokens (the step's cost is then not
    that of every row feeding the most)."""
    num_deferred_feeds: int

    def propose(self, batch: ScheduledBatch, k: int) -> Proposal: ...
    def acceptance(self, seqs: list[Sequence]) -> float | None:
        """What the step's k is priced at: ``None`` for the engine's average acceptance."""
        ...

    def behind(self, seqs: list[Sequence]) -> tuple[int, int]:
        """Tokens ``seqs``' drafts must read before they can propose: the most of any one (the
        controller resumes drafting only on a clearer win behind it) and all of them together
        (what an exploration pays first: ``speculative.EXPLORE_BUDGET``)."""
        ...

    def on_accept(self, seq: Sequence, num_accepted: int) -> None: ...
    def forget(self, seq: Sequence) -> None: ...
    def profile(self, target: ModelRunner, prompt: list[int], sizes: list[int], ctx: int) -> float | None:
        """Seed the controller's cost model at batch ``sizes``; returns a full batch's decode
        step as drafting runs it (``None``: the plain step's measure stands)."""
        ...


class ModelDraft:
    """Drafts with a (lower tier's) model; owns its feeding, catch-up and proposals."""

    ragged = False

    def __init__(
        self,
        runner: ModelRunner,
        spec: SpecController,
        *,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        generator: torch.Generator,
        max_num_seqs: int,
    ) -> None:
        self.runner = runner
        self.blocks = runner.blocks
        self.spec = spec
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.generator = generator
        self.max_num_seqs = max_num_seqs
        self.num_deferred_feeds = 0
        """Prompts whose last chunk ran without the draft (its feed deferred to the first decode)."""
        self._grammar_steps: dict[int, int] = {}
        """Tokens each constrained row's matcher took during this step's drafting (rolled back by
        what the target rejects, or all of it when the step fails)."""

    def propose(self, batch: ScheduledBatch, k: int) -> Proposal:
        """Feed the draft its chunks (catch-up and the rows' backlogs), then propose up to
        ``batch.num_spec_tokens[i]`` tokens for each speculating row."""
        self._grammar_steps = {}
        out = Proposal.empty(batch.num_seqs)
        if k == 0 and not any(batch.num_spec_tokens):
            # Speculation is off this step: feeding the draft (new prompts, above all) would be
            # work for nothing while it stays off; the scheduler catches the draft up in chunks
            # when it is back on. Measured: large at 16 streams spent ~2 s per wave of 16 new
            # prompts in the int4 draft's prefill while never drafting (156 vs 209 tok/s).
            return out
        seqs = batch.seqs
        # A prompt's last chunk gives the first token from the target alone: the draft's feed of
        # it is deferred, so TTFT never pays for the draft's prefill. The scheduler then catches
        # the draft up in the row's first decode step, and it speculates from the next one. The
        # last chunk may be one token: the prefix cache serves prompts to the token.
        wants = [i for i, n in enumerate(batch.num_draft_tokens) if n > 0]
        feeding = [
            i
            for i in wants
            if not (
                batch.num_spec_tokens[i] == 0
                and (batch.num_new_tokens[i] > 1 or seqs[i].num_output_tokens == 0)
                and seqs[i].num_computed_tokens + batch.num_new_tokens[i] == seqs[i].num_tokens
            )
        ]
        self.num_deferred_feeds += len(wants) - len(feeding)
        if not feeding:
            return out
        rows = []
        for i in feeding:
            seq, n = seqs[i], batch.num_draft_tokens[i]
            dc = seq.num_draft_computed_tokens
            rows.append(
                RowInput(
                    seq.draft_table.blocks,
                    dc,
                    seq.token_ids[dc : dc + n],
                    "last" if batch.num_spec_tokens[i] else "none",
                )
            )
        started = time.perf_counter()
        logits = self.runner.forward(rows)
        read = sum(len(r.token_ids) for r in rows)
        if read >= 8 * len(rows):  # a catch-up: what the next exploration's is priced at
            self.spec.record_catch_up(read, time.perf_counter() - started)
        for i in feeding:
            out.fed[i] = batch.num_draft_tokens[i]
        active = {
            i: lg
            for i, lg in zip(feeding, logits, strict=True)
            if batch.num_spec_tokens[i] and lg is not None
        }
        props = {i: Draft() for i in active}
        for i, d in props.items():
            out.drafts[i] = d
        while active:
            idx = list(active)
            proposed = self._propose_one(
                [seqs[i] for i in idx], torch.cat([active[i] for i in idx]), [props[i] for i in idx]
            )
            nxt = []
            for i, tok in zip(idx, proposed, strict=True):
                if tok is None:  # the grammar allows nothing more (complete): stop drafting
                    continue
                if len(props[i].tokens) < batch.num_spec_tokens[i]:
                    nxt.append(i)
            # A row's draft KV already holds everything before its last proposal; feed that one.
            if not nxt:
                break
            rows = [
                RowInput(
                    seqs[i].draft_table.blocks,
                    seqs[i].num_draft_computed_tokens + out.fed[i],
                    [props[i].tokens[-1]],
                    "last",
                )
                for i in nxt
            ]
            started = time.perf_counter()
            logits = self.runner.forward(rows)
            self.spec.record_draft(len(rows), 1, time.perf_counter() - started)
            for i in nxt:
                out.fed[i] += 1
            active = dict(zip(nxt, logits, strict=True))  # type: ignore[arg-type]
        return out

    def _propose_one(
        self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[Draft]
    ) -> list[int | None]:
        """One draft token per row (None: the row stops drafting, its grammar being complete or
        refusing the token), advancing each constrained row's matcher over what it proposes."""
        tokens, laws, masks = propose_tokens(
            seqs, logits, self.vocab_size, self.eos_token_ids, self.generator
        )
        out: list[int | None] = []
        for r, seq in enumerate(seqs):
            tok, c, mask = tokens[r], seq.params.constraint, masks[r]
            stop = False
            if c is not None and mask is not None:
                if not c.accept(tok):
                    out.append(None)
                    continue
                self._grammar_steps[seq.seq_id] = self._grammar_steps.get(seq.seq_id, 0) + 1
                drafts[r].masks.append(mask)
                stop = c.is_terminated
            drafts[r].tokens.append(tok)
            if r in laws:
                drafts[r].probs.append(laws[r])
            out.append(None if stop else tok)
        return out

    def acceptance(self, seqs: list[Sequence]) -> float | None:
        """The engine's average: a model draft runs for every row of a drafting step or none
        (a row left out falls behind and must be caught up)."""
        return None

    def behind(self, seqs: list[Sequence]) -> tuple[int, int]:
        """The draft model's KV is fed only while drafting: after plain steps (or for a new
        prompt) it must first read every token since, a forward of that length on the draft."""
        lags = [s.num_tokens - s.num_draft_computed_tokens for s in seqs]
        return max(lags, default=0), sum(lags)

    def on_accept(self, seq: Sequence, num_accepted: int) -> None:
        steps = self._grammar_steps.pop(seq.seq_id, 0)
        if steps > num_accepted and seq.params.constraint is not None:
            seq.params.constraint.rollback(steps - num_accepted)

    def forget(self, seq: Sequence) -> None:
        self.on_accept(seq, 0)

    def profile(self, target: ModelRunner, prompt: list[int], sizes: list[int], ctx: int) -> float | None:
        """The target over 1 and k + 1 tokens and a draft forward, at each batch size."""
        k = self.spec.max_k
        self.runner.forward_scratch([prompt])
        for b in sizes:
            for tokens, runner, record in (
                (1, target, self.spec.record_target),
                (k + 1, target, self.spec.record_target),
                (1, self.runner, self.spec.record_draft),
            ):
                rows = [[prompt[0]] * tokens] * b
                record(b, tokens, fastest(partial(runner.forward_scratch, rows, start=ctx)))
        chunk = [prompt[0]] * ctx  # a backlog of ctx tokens, read in one forward
        self.spec.record_catch_up(ctx, fastest(partial(self.runner.forward_scratch, [chunk])))
        # A full batch's decode step drafts as the controller would: k draft forwards and the
        # target over k + 1 tokens, not the plain forward the seed timed.
        b = self.max_num_seqs
        k = self.spec.choose_k(b)
        t, d = self.spec.target_cost.get((b, k + 1)), self.spec.draft_cost.get((b, 1))
        return t + d * k if t is not None and d is not None else None


class NgramDraft:
    """Proposals by n-gram lookup for the rows allowed to speculate; constrained rows propose
    nothing (their grammar would have to vet each token). The lookup has no KV to catch up, so
    every row's draft position follows its tokens."""

    ragged = True

    def __init__(
        self,
        ngram: NgramProposer,
        spec: SpecController,
        *,
        vocab_size: int,
        device: torch.device | None = None,
    ) -> None:
        self.device = device or torch.device("cpu")
        """Where the sampler reads the drafts' laws (the target's logits' device)."""
        self.ngram = ngram
        self.blocks = ngram.blocks
        self.spec = spec
        self.vocab_size = vocab_size
        self.num_deferred_feeds = 0

    def acceptance(self, seqs: list[Sequence]) -> float | None:
        """The best row's own acceptance (``SpecController.row_acceptance``): each row then
        drafts only as far as its own record pays (``propose``)."""
        return max(
            (self.spec.row_acceptance(s.num_draft_tokens, s.num_accepted_tokens) for s in seqs), default=None
        )

    def behind(self, seqs: list[Sequence]) -> tuple[int, int]:
        """A lookup reads the row's tokens where they are: nothing to catch up."""
        return 0, 0

    def propose(self, batch: ScheduledBatch, k: int) -> Proposal:
        out = Proposal.empty(batch.num_seqs)
        started = time.perf_counter()
        proposed = 0
        for i, seq in enumerate(batch.seqs):
            out.fed[i] = seq.num_tokens - seq.num_draft_computed_tokens
            n = batch.num_spec_tokens[i]
            if n and seq.num_draft_tokens:  # a row with a record drafts as far as it pays
                n = self.spec.row_k(
                    batch.num_seqs, n, self.spec.row_acceptance(seq.num_draft_tokens, seq.num_accepted_tokens)
                )
            if not n or seq.params.constraint is not None:
                continue
            tokens = self.ngram.propose(seq.seq_id, seq.token_ids, n)
            if not tokens:
                continue
            d = out.drafts[i] = Draft(tokens)
            if not seq.params.is_greedy:  # the draft's law is one-hot at each proposed token
                for t in tokens:
                    law = torch.zeros(self.vocab_size, device=self.device)
                    law[t] = 1.0  # a fill of one element: no host-to-device copy
                    d.probs.append(law)
            proposed += 1
        if proposed:
            self.spec.record_draft(batch.num_seqs, 1, (time.perf_counter() - started) / k)
        return out

    def on_accept(self, seq: Sequence, num_accepted: int) -> None:
        """Nothing to settle: a lookup holds no grammar state."""

    def forget(self, seq: Sequence) -> None:
        self.ngram.forget(seq.seq_id)

    def profile(self, target: ModelRunner, prompt: list[int], sizes: list[int], ctx: int) -> float | None:
        """The target over every 1..k+1 tokens at each batch size (it is not linear in tokens:
        small at batch 1 measured 14 ms for 4 tokens and 19-22 ms for 5), and the lookup itself
        per proposed token."""
        k = self.spec.max_k
        for b in sizes:
            for tokens in range(1, k + 2):
                rows = [[prompt[0]] * tokens] * b
                self.spec.record_target(b, tokens, fastest(partial(target.forward_scratch, rows, start=ctx)))
        history = (prompt * (ctx // len(prompt) + 1))[:ctx]
        for b in sizes:
            started = time.perf_counter()
            for r in range(b):
                self.ngram.propose(-1 - r, history, k)
            self.spec.record_draft(b, 1, (time.perf_counter() - started) / k)
            for r in range(b):
                self.ngram.forget(-1 - r)
        return None


def make_proposer(
    tier: str,
    draft: DraftSource | None,
    spec: SpecController,
    *,
    vocab_size: int,
    eos_token_ids: frozenset[int],
    generator: torch.Generator,
    max_num_seqs: int,
) -> Proposer | None:
    """The proposer for tier ``tier``'s ``draft`` (a lower tier's runner, an n-gram lookup, or
    none); ``vocab_size``: the target's logits, which a draft model's may not exceed."""
    if draft is None:
        return None
    if isinstance(draft, NgramProposer):
        return NgramDraft(draft, spec, vocab_size=vocab_size, device=generator.device)
    if draft.vocab_size > vocab_size:
        raise ValueError(
            f"tier '{tier}': the draft's logits ({draft.vocab_size}) are wider than the target's "
            f"({vocab_size})"
        )
    return ModelDraft(
        draft,
        spec,
        vocab_size=vocab_size,
        eos_token_ids=eos_token_ids,
        generator=generator,
        max_num_seqs=max_num_seqs,
    )
