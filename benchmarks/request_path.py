"""How often a request's path changes module: "stays" and "returns", before and after generation.

A few requests run in-process (the app over the tiny test tiers, drafting off, greedy, a fixed
answer length) under ``sys.setprofile``. Every call and return event names the module that runs
next (the called frame's, or on a return its caller's; a coroutine's suspension at an ``await``
and its resumption are not moves: the event loop only passes through the frames waiting on it);
the sequence, kept to project modules (``router``, ``tiers``, ``classifier``), is cut into

- **stays**: maximal runs of consecutive events in one module;
- **returns**: stays in a module the path had already left once before;
- **files**: distinct modules.

Two views: *all* counts every project module; *layers* keeps the request's own layers
(``router.http``, ``router.pipeline``, ``router.backends``, ``router.openai``) and folds each call
out of them (classifier, policy, telemetry, errors, the engine) into its caller's stay.

Two phases per request: *before generation* runs from the route handler's first frame in
``router.http.routes`` to the backend's call into the engine (``Engine.submit``/``submit_n``,
whose own frames are left out); *after* runs from that call's return to the client's last byte.
The event loop thread and the default executor's threads (tokenization off the loop) are traced;
the engine's device thread is not (it steps the model, outside any one request's path), nor are
tasks that were running before the request (the app's watchers).

    python -m benchmarks.request_path --as before   # records under "before"
    python -m benchmarks.request_path --as after    # and under "after", in results/request_path.json
"""

from __future__ import annotations

import argparse
import asyncio
import dis
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "request_path.json"
PROJECT = ("router", "tiers", "classifier")
LAYERS = ("router.http.", "router.pipeline.", "router.backends.", "router.openai.")
"""The modules a request's data passes through; calls out of them (classifier, policy, telemetry,
errors, the engine) are folded into the stay of their caller in the "layers" view."""
MAX_TOKENS = 4
REPEATS = 5

REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {"model": "medium", "messages": [{"role": "user", "content": "Hello there!"}], "temperature": 0},
    ),
    "chat_stream": (
        "/v1/chat/completions",
        {
            "model": "medium",
            "messages": [{"role": "user", "content": "Hello there!"}],
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "completion": ("/v1/completions", {"model": "medium", "prompt": "The quick brown", "temperature": 0}),
    "completion_stream": (
        "/v1/completions",
        {"model": "medium", "prompt": "The quick brown", "temperature": 0, "stream": True},
    ),
}


_YIELD, _SEND, _RESUME = dis.opmap["YIELD_VALUE"], dis.opmap["SEND"], dis.opmap["RESUME"]


def _awaiting(frame: FrameType, event: str) -> bool:
    """A coroutine suspended by an ``await`` (its return event sits on the ``YIELD_VALUE`` after a
    ``SEND``), or resumed after one (``RESUME`` with an oparg of 2 or 3; CPython 3.11's
    bytecode): frames the loop passes through, where no code of the module runs. A generator's
    own ``yield`` and its resumption stay counted: they hand data over."""
    code, i = frame.f_code.co_code, frame.f_lasti
    if i < 0:
        return False
    if event == "call":
        return code[i] == _RESUME and code[i + 1] >= 2
    return code[i] == _YIELD and i >= 2 and code[i - 2] == _SEND


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # an executor thread: no loop of its own
        return None


def _project_module(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    name = frame.f_globals.get("__name__", "")
    return name if isinstance(name, str) and name.split(".", 1)[0] in PROJECT else None


@dataclass
class PathTracer:
    """Collects the project modules a request runs in, in order, split at the engine call."""

    phases: dict[str, list[str]] = field(default_factory=lambda: {"before": [], "after": []})
    phase: str | None = None
    """None until the route handler runs; "engine" while the engine's submit runs."""
    _engine_frame: FrameType | None = None
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    """Tasks that ran before the request (the policy and key watchers): left out."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return") or _awaiting(frame, event):
            return
        if self.background and _current_task() in self.background:
            return
        with self._lock:
            if self.phase is None:
                if event == "call" and frame.f_globals.get("__name__") == "router.http.routes":
                    self.phase = "before"
                else:
                    return
            if self.phase == "engine":
                if event == "return" and frame is self._engine_frame:
                    self.phase, self._engine_frame = "after", None
                    self._note(_project_module(frame.f_back))
                return
            if (
                event == "call"
                and frame.f_code.co_name in ("submit", "submit_n")
                and frame.f_globals.get("__name__") == "tiers.engine.llm_engine"
            ):
                self.phase, self._engine_frame = "engine", frame
                return
            self._note(_project_module(frame if event == "call" else frame.f_back))

    def _note(self, module: str | None) -> None:
        if module is None or self.phase not in self.phases:
            return
        path = self.phases[self.phase]
        if not path or path[-1] != module:
            path.append(module)


def summarise(stays: list[str]) -> dict[str, Any]:
    """Both views of one phase: every project module, and the request layers alone."""
    layers = [m for m in stays if m.startswith(LAYERS)]
    layers = [m for i, m in enumerate(layers) if i == 0 or layers[i - 1] != m]
    return {"all": _counts(stays), "layers": {**_counts(layers), "path": layers}}


def _counts(stays: list[str]) -> dict[str, int]:
    """Stays, files and returns of a path whose consecutive duplicates are merged."""
    seen: set[str] = set()
    returns = 0
    for module in stays:
        returns += module in seen
        seen.add(module)
    return {"stays": len(stays), "files": len(seen), "returns": returns}


def install(tracer: PathTracer) -> Callable[[], None]:
    """Trace this thread and the default executor's (a fresh pool whose threads trace themselves)."""
    loop = asyncio.get_running_loop()
    tracer.background = asyncio.all_tasks() - {asyncio.current_task()}
    pool = ThreadPoolExecutor(max_workers=4, initializer=sys.setprofile, initargs=(tracer.profile,))
    loop.set_default_executor(pool)
    sys.setprofile(tracer.profile)

    def remove() -> None:
        sys.setprofile(None)
        pool.shutdown(wait=True)
        loop.set_default_executor(ThreadPoolExecutor())

    return remove


async def measure(policy_path: Path) -> dict[str, Any]:
    import httpx

    from router.http.app import create_app

    app = create_app(policy_path, watch_policy=False)
    out: dict[str, Any] = {}
    # The app runs on this thread's loop (litestar's test clients run it on a portal thread).
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]  # litestar types ASGI narrower
    async with (
        app.lifespan(),
        httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client,
    ):
        for _ in range(1200):
            if (await client.get("/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("the app never became ready")
        for name, (path, fields) in REQUESTS.items():
            body = {**fields, "max_tokens": MAX_TOKENS}
            first = await client.post(path, json=body)  # warm: lazy imports, compiled templates
            first.raise_for_status()
            runs = []
            for _ in range(REPEATS):
                tracer = PathTracer()
                remove = install(tracer)
                try:
                    response = await client.post(path, json=body)
                finally:
                    remove()
                response.raise_for_status()
                runs.append({phase: summarise(stays) for phase, stays in tracer.phases.items()})
            # How the engine's outputs meet the loop's turns varies a little: the median run.
            runs.sort(key=lambda r: r["before"]["all"]["stays"] + r["after"]["all"]["stays"])
            out[name] = runs[len(runs) // 2]
            print(
                name,
                {
                    p: (s["all"], {k: v for k, v in s["layers"].items() if k != "path"})
                    for p, s in out[name].items()
                },
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--as", dest="label", default="after", help="the key the counts are stored under")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.fixtures import build_tiny_model, tiny_policy_yaml

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = build_tiny_model(tmp / "tiny")
        text = tiny_policy_yaml(model, cache_enabled=False)
        text = text.replace("draft: small", "draft: null").replace("draft: medium", "draft: null")
        (tmp / "policy.yaml").write_text(text)
        counts = asyncio.run(measure(tmp / "policy.yaml"))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data["method"] = __doc__.split("\n\n", 1)[1].split("\n\n    python", 1)[0].replace("\n", " ")
    data["max_tokens"] = MAX_TOKENS
    data["repeats"] = f"median of {REPEATS} runs per request (by all stays)"
    data[args.label] = {"commit": commit, "requests": counts}
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    print("wrote", RESULTS)


if __name__ == "__main__":
    main()
