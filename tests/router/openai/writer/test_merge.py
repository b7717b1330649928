"""``Merged`` (router/openai/writer/merge.py): the choices of one answer read as ``(index, output)``
pairs - every output of every source exactly once, each with its own source's index, the single
remote stream's own indices kept, a source's failure raised to the reader, and every source
closed by ``aclose`` even when one close fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from router.openai.writer.merge import Merged
from tiers.core.output import StepOutput


class _Source:
    def __init__(self, texts: list[str], *, fail: Exception | None = None, close_fails: bool = False) -> None:
        self.texts = texts
        self.fail = fail
        self.close_fails = close_fails
        self.closed = 0
        self._it = self._run()

    async def _run(self) -> AsyncGenerator[StepOutput, None]:
        for t in self.texts:
            await asyncio.sleep(0)
            yield StepOutput(t, [len(t)])
        if self.fail is not None:
            raise self.fail

    def __aiter__(self) -> _Source:
        return self

    async def __anext__(self) -> StepOutput:
        return await anext(self._it)

    async def aclose(self) -> None:
        self.closed += 1
        if self.close_fails:
            raise RuntimeError("close failed")


def _read(merged: Merged) -> list[tuple[int, str]]:
    async def run() -> list[tuple[int, str]]:
        return [(i, out.text) async for i, out in merged]

    return asyncio.run(run())


def test_every_output_of_every_source_comes_once_with_its_sources_index() -> None:
    """Bugs it catches: a finished source ending the whole merge (the other choices cut short),
    an output tagged with the wrong choice, one read twice."""
    got = _read(Merged([_Source(["a", "b", "c"]), _Source(["x"]), _Source([])]))
    assert sorted(got) == [(0, "a"), (0, "b"), (0, "c"), (1, "x")]
    assert [t for i, t in got if i == 0] == ["a", "b", "c"]  # each source's order is kept


def test_a_single_remote_stream_keeps_the_indices_its_outputs_carry() -> None:
    async def remote() -> AsyncGenerator[StepOutput, None]:
        for index, text in ((0, "a"), (1, "b"), (0, "c")):
            yield StepOutput(text, [], index=index)

    assert _read(Merged([remote()])) == [(0, "a"), (1, "b"), (0, "c")]


def test_a_sources_failure_is_raised_to_the_reader() -> None:
    merged = Merged([_Source(["a"]), _Source(["x"], fail=ValueError("tier broke"))])
    with pytest.raises(ValueError, match="tier broke"):
        _read(merged)


def test_aclose_closes_every_source_even_after_one_close_fails() -> None:
    """Bug it catches: the first failing close stopping the loop - the later choices' engine
    requests keep generating for a client that left."""
    sources = [_Source(["a"]), _Source(["b"], close_fails=True), _Source(["c"])]
    merged = Merged(list(sources))

    async def run() -> None:
        await anext(merged)
        await merged.aclose()

    asyncio.run(run())
    assert [s.closed for s in sources] == [1, 1, 1]
