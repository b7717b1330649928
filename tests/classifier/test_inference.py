"""Serving: ComplexityClassifier over the shipped artifact (classifier/inference.py)."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from classifier import ComplexityClassifier, ComplexityScore
from classifier.inference import ARTIFACT_DIR, COMPLEXITY_DIR, message_text

LABELS = {"small", "medium", "large"}


def _check(score: ComplexityScore) -> None:
    assert score.tier in LABELS
    assert set(score.probabilities) == LABELS
    assert abs(sum(score.probabilities.values()) - 1.0) < 1e-6
    assert all(0.0 <= p <= 1.0 for p in score.probabilities.values())
    assert 0.0 <= score.value <= 1.0
    assert score.tier == max(score.probabilities, key=score.probabilities.__getitem__)
    expected = 0.5 * score.probabilities["medium"] + score.probabilities["large"]
    assert score.value == pytest.approx(expected, abs=1e-9)


def test_shipped_artifact_is_small_and_one_graph() -> None:
    model = ARTIFACT_DIR / "model.onnx"
    assert model.stat().st_size < 10 * 2**20
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["text"]
    assert "probabilities" in [o.name for o in session.get_outputs()]


def test_metadata_describes_the_artifacts() -> None:
    meta = json.loads((ARTIFACT_DIR / "metadata.json").read_text())
    assert meta["score"] == "outcome" and meta["labels"] == ["small", "medium", "large"]
    for key in ("version", "created_at", "config", "features", "weights", "metrics"):
        assert key in meta
    assert len(meta["training_data"]["outcomes"]["sha256"]) == 64
    assert meta["metrics"]["n"] > 1000 and meta["metrics"]["heldout_subjects"]
    old = json.loads((COMPLEXITY_DIR / "metadata.json").read_text())
    assert sorted(old["labels"]) == sorted(LABELS)
    assert len(old["training_data"]["sha256"]) == 64
    assert old["metrics"]["heldout"]["n"] > 500


def test_load_defaults(shipped: ComplexityClassifier) -> None:
    assert shipped.path == ARTIFACT_DIR / "model.onnx"
    assert "CPUExecutionProvider" in shipped.providers
    assert shipped.version


def test_load_accepts_model_file_and_explicit_providers() -> None:
    clf = ComplexityClassifier.load(ARTIFACT_DIR / "model.onnx", providers=["CPUExecutionProvider"])
    assert clf.providers == ["CPUExecutionProvider"]
    assert clf.score("hi").tier == "small"


def test_load_missing_path_fails(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ComplexityClassifier.load(tmp_path)


@pytest.mark.parametrize(
    ("prompt", "tier"),
    [
        ("hi there!", "small"),
        ("What is the capital of France?", "small"),
        ("Write a Python function that checks whether a string is a palindrome.", "medium"),
        ("Explain how vaccines train the immune system, in a couple of paragraphs.", "medium"),
        (
            "Design a multi-region, strongly consistent payments ledger: data model, failure modes, "
            "reconciliation, and a phased migration plan from our current single Postgres instance.",
            "large",
        ),
    ],
)
def test_clear_cases_of_the_complexity_taxonomy(prompt: str, tier: str) -> None:
    score = ComplexityClassifier.load(COMPLEXITY_DIR).score(prompt)
    _check(score)
    assert score.tier == tier
    assert not score.truncated


def test_value_orders_where_the_strong_tier_helps(shipped: ComplexityClassifier) -> None:
    # The outcome score: chat and writing (weak model suffices) below a multi-step word problem
    # and a proof (where the strong model gains most). The complexity taxonomy put the poem above
    # the arithmetic; this order is what routing needs. (Between chat and a poem the family
    # priors decide: writing has the smallest measured gain, so a poem may score below "thanks!".)
    chat = shipped.score("thanks!").value
    poem = shipped.score("Write a short poem about my cat for her birthday card.").value
    word_problem = shipped.score(
        "Janet has 3 times as many apples as Tom. Tom has 4 more than Sue, who has 6. Janet gives "
        "away half of hers and then buys 7 more. How many apples does Janet have now?"
    ).value
    proof = shipped.score("Prove that every planar graph is 5-colorable, with all the lemmas.").value
    assert max(chat, poem) < min(word_problem, proof)


def test_score_batch_matches_score(shipped: ComplexityClassifier) -> None:
    prompts = ["hi", "", "Explain TCP slow start.", "日本の首都は？", "x" * 10_000]
    batch = shipped.score_batch(prompts)
    assert shipped.score_batch([]) == []
    for prompt, got in zip(prompts, batch, strict=True):
        one = shipped.score(prompt)
        assert got.tier == one.tier
        assert got.truncated == one.truncated
        for label in LABELS:
            assert got.probabilities[label] == pytest.approx(one.probabilities[label], abs=1e-5)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   \n\t  ",
        "Ünïcödé — 東京で一番高いビルは？ 😀🚀 مرحبا",
        "\x00\x01\x02 binary \xff\xfe\x7f garbage \x1b[31m",
        "\ud800 lone surrogate \udfff",
        "".join(chr(i) for i in range(0, 0x3000, 7)),
    ],
)
def test_awkward_inputs_score(shipped: ComplexityClassifier, text: str) -> None:
    _check(shipped.score(text))


def test_bytes_input(shipped: ComplexityClassifier) -> None:
    _check(shipped.score(os.urandom(4096)))


def test_huge_input_is_scored_from_its_ends_only(shipped: ComplexityClassifier) -> None:
    # Bounded work for any input: a 1 MB text scores exactly as its first 3,000 and last 1,000
    # characters joined by a newline do (the documented cut): the model never sees more. Catches a cut
    # that keeps the whole text (its time grows with the input) or the wrong ends. How fast it is
    # is benchmarks/classifier.py's figure, not a timed assertion.
    huge = ("All work and no play makes Jack a dull boy. " * 25_000)[: 2**20]
    huge = "Start: prove the theorem. " + huge + " End: thanks!"
    score = shipped.score(huge)
    _check(score)
    assert score.truncated
    cut = shipped.score(huge[:3000] + "\n" + huge[-1000:])
    assert (score.value, score.tier) == (cut.value, cut.tier)
    assert score.value != shipped.score(huge[1000:5000]).value  # the middle would score otherwise


def test_nul_characters_are_stripped(shipped: ComplexityClassifier) -> None:
    assert shipped.score("hel\x00lo wor\x00ld") == shipped.score("hello world")


def test_single_prompt_latency_is_sub_millisecond_ballpark(shipped: ComplexityClassifier) -> None:
    # The real budget (p50 <= 0.5 ms, p99 <= 1 ms) is measured by the benchmark; this only
    # catches gross regressions (a huge vocabulary, a slow operator) on a busy CI machine.
    prompt = " ".join(["please review the attached contract clause for risks"] * 25)
    for _ in range(20):
        shipped.score(prompt)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        shipped.score(prompt)
        times.append(time.perf_counter() - start)
    assert sorted(times)[len(times) // 2] < 0.003


def test_thread_safe(shipped: ComplexityClassifier) -> None:
    prompts = [f"Question {i}: explain topic number {i} in detail" * (i % 5 + 1) for i in range(64)]
    expected = [shipped.score(p) for p in prompts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(shipped.score, prompts * 4))
    assert got == expected * 4


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=3000))
def test_any_text_gives_a_distribution(shipped: ComplexityClassifier, text: str) -> None:
    _check(shipped.score(text))


# -- chat messages --------------------------------------------------------------------------------

QUESTION = "What is the capital of France?"


def test_messages_ignore_system_and_developer(shipped: ComplexityClassifier) -> None:
    system = "You are a meticulous expert. Write long, rigorous, multi-section answers with proofs. " * 40
    plain = shipped.score_messages([{"role": "user", "content": QUESTION}])
    with_system = shipped.score_messages(
        [
            {"role": "system", "content": system},
            {"role": "developer", "content": system},
            {"role": "user", "content": QUESTION},
        ]
    )
    assert with_system == plain == shipped.score(QUESTION)
    assert plain.tier == "small"


def test_messages_score_the_last_user_turn(shipped: ComplexityClassifier) -> None:
    hard = (
        "Design a complete zero-downtime migration plan for our 40 TB sharded database, with rollback steps."
    )
    messages = [
        {"role": "user", "content": hard},
        {"role": "assistant", "content": "Here is a plan..."},
        {"role": "user", "content": "thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    assert shipped.score_messages(messages, context_chars=0) == shipped.score("thanks!")
    assert message_text(messages, context_chars=0) == ("thanks!", False)


def test_messages_context_is_bounded_most_recent_first() -> None:
    messages = [
        {"role": "user", "content": "A" * 500},
        {"role": "assistant", "content": "B" * 500},
        {"role": "tool", "content": "T" * 500},
        {"role": "user", "content": "go on"},
    ]
    text, truncated = message_text(messages, context_chars=600)
    assert not truncated
    assert text == "A" * 100 + "\n\n" + "B" * 500 + "\n\ngo on"
    assert "T" not in text


def test_messages_content_parts(shipped: ComplexityClassifier) -> None:
    parts = [
        {"type": "text", "text": "What is the capital"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "of France?"},
    ]
    text, _ = message_text([{"role": "user", "content": parts}])
    assert text == "What is the capital\nof France?"
    _check(shipped.score_messages([{"role": "user", "content": parts}]))


def test_messages_without_user_turn_or_with_junk(shipped: ComplexityClassifier) -> None:
    assert message_text([{"role": "system", "content": "be nice"}]) == ("", False)
    _check(shipped.score_messages([]))
    _check(shipped.score_messages([{"role": "user", "content": None}, {"role": "user"}]))


def test_messages_huge_turn_keeps_the_turn(shipped: ComplexityClassifier) -> None:
    huge = "word " * 300_000
    score = shipped.score_messages(
        [{"role": "assistant", "content": "ctx " * 1000}, {"role": "user", "content": huge}]
    )
    _check(score)
    assert score.truncated
    text, _ = message_text(
        [{"role": "assistant", "content": "ctx " * 1000}, {"role": "user", "content": huge}]
    )
    assert "ctx" not in text


def test_cuda_failure_falls_back_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from classifier import inference

    real = ort.InferenceSession

    def fussy(path: str, sess_options: object = None, providers: list[str] | None = None) -> object:
        if providers and "CUDAExecutionProvider" in providers:
            raise RuntimeError("libcublasLt.so: cannot open shared object file")
        return real(path, sess_options=sess_options, providers=providers)

    monkeypatch.setattr(inference.ort, "InferenceSession", fussy)
    clf = ComplexityClassifier.load(device="cuda")
    assert clf.providers == ["CPUExecutionProvider"]
    with pytest.raises(RuntimeError, match="libcublas"):
        ComplexityClassifier.load(providers=["CUDAExecutionProvider"])


def test_classifier_stays_on_the_cpu_provider_on_a_gpu_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches the classifier opening onnxruntime's CUDA provider by default on a GPU node (a second
    CUDA context and arena beside the tiers' for a 0.1 ms graph): only ``auto``/``cuda`` ask for it."""
    from classifier import inference

    monkeypatch.setattr(
        inference.ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    monkeypatch.setattr(inference, "_gpu_visible", lambda: True)
    asked: list[list[str]] = []
    real = ort.InferenceSession

    def recording(path: str, sess_options: object = None, providers: list[str] | None = None) -> object:
        asked.append(list(providers or []))
        return real(path, sess_options=sess_options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(inference.ort, "InferenceSession", recording)
    ComplexityClassifier.load()
    ComplexityClassifier.load(device="auto")
    monkeypatch.setattr(inference, "_gpu_visible", lambda: False)
    ComplexityClassifier.load(device="auto")
    ComplexityClassifier.load(device="cuda")
    cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert asked == [["CPUExecutionProvider"], cuda, ["CPUExecutionProvider"], cuda]
    with pytest.raises(ValueError, match="classifier device must be one of cpu, auto, cuda"):
        ComplexityClassifier.load(device="gpu")
