"""The learning loop end to end: shadow pairs -> exact-match judge -> retrain -> reload -> routing.

The bug this guards against is a loop that does not close: judged shadow lines that never reach
training (wrong shape, unmerged ids), a retrained artifact that needs a restart, or a reload that
swaps a file the router never reads. The outcomes here are chosen to contradict the shipped
score's priors (the strong tier gains on poems, not on maths word problems), so only a score
that learned from this log can route as they say.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml

from classifier.cli import main as classifier_main
from classifier.validation.judge import exact_match, judge_rows, normalize, number_match
from classifier.validation.outcomes import load_outcomes
from router.http.app import admin_listener
from router.http.auth import AdminKeys
from router.pipeline.shadow import ShadowRecorder, shadow_row
from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import Server, free_port, start_server

POEMS = [
    f"Write a short poem about {t} for my {w}."
    for t in ("rain", "cats", "autumn", "the sea")
    for w in ("mother", "friend", "class")
]
SUMS = [
    f"A shop sells {a} pens for ${b}. How much do {c} pens cost in total?"
    for a, b, c in ((3, 2, 12), (4, 5, 20), (5, 3, 15), (6, 4, 18), (2, 7, 10), (8, 6, 24))
] + [
    f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?"
    for a, b in ((3, 4), (5, 9), (7, 2), (10, 6), (12, 1), (8, 8))
]
CHAT = [
    f"hi, how are you today, {n}?"
    for n in ("Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal", "Ivy", "Jo", "Kai", "Lu")
]


def test_scorers() -> None:
    assert normalize("  The Answer:  Paris. ") == "the answer: paris"
    assert exact_match("Paris.", "paris") == 1.0 and exact_match("Paris, France", "paris") == 0.0
    assert number_match("3 pens cost $2, so 12 cost 8.", "#### 8") == 1.0
    assert number_match("1,200 in all", "1200") == 1.0 and number_match("no idea", "8") == 0.0
    rows = [
        {"id": "a", "prompt": "p", "answers": {"small": "x", "large": "y"}, "outcomes": {}},
        {"id": "b", "prompt": "q", "answers": {"small": {"chars": 3}, "large": "y"}, "outcomes": {}},
        {"id": "c", "prompt": "r", "answers": {"small": "x", "large": "y"}, "outcomes": {}},
        {"id": "d", "prompt": "p", "answers": {"small": "y", "large": "y"}, "outcomes": {"small": 0.5}},
    ]
    judged, summary = judge_rows(rows, exact_match, {"a": "y"}, {"p": "x"})
    assert summary == {"lines": 4, "judged": 2, "no_reference": 1, "no_content": 1}
    assert judged[0]["outcomes"] == {"small": 0.0, "large": 1.0}  # by id before by prompt
    assert judged[1]["outcomes"] == {"small": 0.5, "large": 0.0}  # a person's score is kept
    assert "answers" not in judged[0]


async def _shadow_log(path: Path, prompts: list[str], answers: dict[str, tuple[str, str]]) -> None:
    """Shadow lines as the service writes them: shadow_row() + ShadowRecorder on a fake stream.

    (The tiny test model's answers are noise, so the answers here are scripted; the live path
    into this log is tests/router/pipeline/test_shadow.py.)"""
    recorder = ShadowRecorder(registry=None)
    cfg = SimpleNamespace(max_concurrent=4, max_busy_fraction=1.0, log_path=str(path))
    for i, prompt in enumerate(prompts):
        served, shadow = answers[prompt]
        gen = SimpleNamespace(messages=[{"role": "user", "content": prompt}], prompt=None, ctx=None)
        decision = SimpleNamespace(tier="small", rule="score-small")
        row = shadow_row(f"chatcmpl-{i}", gen, decision, None, served, True)  # type: ignore[arg-type]

        def stream(text: str = shadow) -> Any:
            async def gen_() -> Any:
                yield SimpleNamespace(text=text, token_ids=[1, 2], error=None, finish_reason="stop")

            return gen_()

        assert recorder.launch(cfg, "large", None, stream, row, True)  # type: ignore[arg-type]
        while recorder._tasks:  # one at a time: max_concurrent would skip the rest
            await asyncio.gather(*list(recorder._tasks))


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    import uvicorn

    path = tmp_path_factory.mktemp("loop") / "policy.yaml"
    path.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    yaml.safe_load(path.read_text())  # valid YAML
    keys = tmp_path_factory.mktemp("admin-keys") / "admin-keys"
    keys.write_text("sk-admin\n")
    srv, stop = start_server(path, admin_separate=True, admin_keys=AdminKeys(str(keys)))
    port = free_port()
    admin = uvicorn.Server(
        uvicorn.Config(
            admin_listener(srv.app), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
    )
    thread = threading.Thread(target=admin.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not admin.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield srv, url
    admin.should_exit = True
    thread.join(30)
    stop()


ADMIN = {"authorization": "Bearer sk-admin"}


def _route(srv: Server, prompt: str) -> dict[str, Any]:
    r = httpx.post(
        srv.url + "/v1/route",
        json={"model": "auto", "messages": [{"role": "user", "content": prompt}]},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return {k: r.json()[k] for k in ("tier", "score", "rule")}


def test_judged_shadow_pairs_retrain_and_reload_without_restart(
    served: tuple[Server, str], tmp_path: Path
) -> None:
    srv, admin = served
    poem, sums = POEMS[0], SUMS[0]
    before = {p: _route(srv, p) for p in (poem, sums)}
    # The shipped priors: a poem is where the strong tier gains least; it goes to the small tier.
    assert before[poem]["tier"] == "small"

    # 1. Shadow pairs: the small tier served, the large tier answered too. Scripted so that the
    #    large tier is right on poems (the small one wrong) and both are right on sums and chat.
    answers = {p: ("roses are red", "the reference poem") for p in POEMS}
    answers |= {p: ("8", "8") for p in SUMS}
    answers |= {p: ("hello!", "hello!") for p in CHAT}
    log = tmp_path / "shadow.jsonl"
    asyncio.run(_shadow_log(log, POEMS + SUMS + CHAT, answers))
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == len(POEMS + SUMS + CHAT) and all(r["outcomes"] == {} for r in lines)

    # 2. The judge: exact match against references (one per prompt).
    refs = tmp_path / "refs.jsonl"
    refs.write_text(
        "".join(
            json.dumps({"prompt": p, "reference": "The reference poem." if p in POEMS else answers[p][1]})
            + "\n"
            for p in POEMS + SUMS + CHAT
        )
    )
    judged = tmp_path / "judged.jsonl"
    assert (
        classifier_main(["judge", "--shadow", str(log), "--references", str(refs), "--out", str(judged)]) == 0
    )
    rows = {r["prompt"]: r for r in load_outcomes(judged)}
    assert (rows[poem]["weak"], rows[poem]["strong"]) == (0.0, 1.0)
    assert (rows[sums]["weak"], rows[sums]["strong"]) == (1.0, 1.0)

    # 3. Retrain from the log: a small base file plus the judged lines (--extra).
    base = tmp_path / "base.jsonl"
    base.write_text("".join(json.dumps({"prompt": p, "weak": 1, "strong": 1}) + "\n" for p in CHAT))
    out = tmp_path / "model"
    argv = [
        "train",
        "--outcomes",
        str(base),
        "--extra",
        str(judged),
        "--no-proxy",
        "--heldout-fraction",
        "0",
        "--out",
        str(out),
    ]
    assert classifier_main(argv) == 0
    assert (
        json.loads((out / "metadata.json").read_text())["training_data"]["more_outcomes"][0]["path"]
        == "judged.jsonl"
    )

    # 4. Swap it in through the admin port - no restart - and route again.
    bad = httpx.post(
        admin + "/admin/classifier/reload", headers=ADMIN, json={"path": str(tmp_path / "nope")}, timeout=30
    )
    assert bad.status_code == 400 and _route(srv, poem) == before[poem]  # a broken path changes nothing
    assert (
        httpx.post(srv.url + "/admin/classifier/reload", json={"path": str(out)}, timeout=30).status_code
        == 404
    )
    r = httpx.post(admin + "/admin/classifier/reload", headers=ADMIN, json={"path": str(out)}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["path"] == str(out / "model.onnx") and r.json()["previous"]["path"].endswith(
        "artifacts/model.onnx"
    )
    after = {p: _route(srv, p) for p in (poem, sums)}
    # 5. Decisions as the new outcomes say: poems (where the strong tier won) leave the small tier
    #    (the score is now the learned P(gain), over one half); sums (where the small tier was
    #    right) stay on the small tier and score below poems.
    assert after[poem]["tier"] != "small" and after[poem]["score"] > 0.5, after
    assert after[sums]["tier"] == "small" and after[sums]["score"] < after[poem]["score"]

    # 6. No body: back to the policy's classifier (the shipped artifact), as before the swap.
    assert httpx.post(admin + "/admin/classifier/reload", headers=ADMIN, timeout=60).status_code == 200
    assert _route(srv, poem)["tier"] == before[poem]["tier"]
