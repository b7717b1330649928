"""Sampled mutation testing over every module with logic in ``router/``, ``tiers/`` and
``classifier/`` (``make mutation-sample``; not part of ``make test``).

``make mutation`` (``benchmarks/mutation.py``) runs every mutant of eight modules, minutes each; a
run over the whole tree that way would take days on two cores. This one draws, per module, a
seeded stratified sample of mutmut's mutants - round robin over the mutation operators (string,
number, comparison, ...), and within an operator over the functions - and runs only those
(``mutmut run <names>``), against the module's own tests: its mirrored tests
(``tests/<same path>/test_<name>*.py``) plus the test files that import it (by the dotted name),
without the ``slow`` ones. The copy of the committed tree is ``benchmarks/mutation.py``'s, under
a temporary directory, under ``nice -n 19``; one package runs at a time, in one copy: mutmut
collects which tests reach which function once over the union of the package's module tests,
the map is then narrowed to each module's own test files, and the sampled mutants run.

Results go to ``benchmarks/results/mutation_sample.json`` (merged: a run over some modules keeps
the others): per module the mutants sampled, killed, equivalent (a survivor matching an entry of
``EQUIVALENT`` here or in ``benchmarks/mutation.py``, each with the reason no test can tell it from
the original) and the survivors (file:line, operator, diff); per package the totals and the score
killed / (sampled - equivalent).

    python -m benchmarks.mutation_sample                               # everything
    python -m benchmarks.mutation_sample --packages router/openai --per-module 20
    python -m benchmarks.mutation_sample --modules router/openai/bounds.py --seed 7
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks import mutation
from benchmarks.mutation import ROOT, STATUS, _changed_line, _config, _copy_repo, _head

RESULTS = ROOT / "benchmarks" / "results" / "mutation_sample.json"
TREES = ("router", "tiers", "classifier")

# The packages the acceptance names, in the order a run with a budget spends it.
PRIORITY = (
    "router/http",
    "router/openai",
    "router/pipeline",
    "router/policy",
    "router/backends",
    "tiers/core",
    "tiers/engine",
    "tiers/sample",
    "tiers/spec_decode",
    "tiers/worker",
    "tiers/attention",
    "tiers/layers",
    "tiers/models",
    "tiers/kernels",
    "classifier",
    "router",
)

# Modules with code that are not sampled, and why. (``__init__`` modules that only re-export are
# found by ``_only_reexports`` and listed in the results too.)
SKIPPED: dict[str, str] = {
    "router/__main__.py": "calls router.cli.main: no logic of its own",
    "classifier/data/__main__.py": "calls the data module's main: no logic of its own",
    "router/openai/api_types.py": "TypedDicts and Literal aliases for the wire types: no runtime logic",
    "tiers/kernels/cpu.py": "builds and loads the C++ kernels (torch.utils.cpp_extension): mutants of "
    "the build flags and the loader recompile for minutes each, past this run's budget",
}

# Survivors no test can tell from the original: (module, the changed source line as mutated, why).
# Matched on the mutated line, as in benchmarks/mutation.py (whose entries apply here too).
_HELD = (
    "a longest prefix of n >= len(s) characters is s itself, and a text that ends with a whole stop "
    "sequence is held back by the clause before (``text.endswith(s)``): the longer range finds "
    "nothing the shorter one does not"
)
EQUIVALENT: list[tuple[str, str, str]] = [
    ("router/http/bridge/messages.py", "for n in range(min(len(s) + 1, len(text)), best, -1):", _HELD),
    (
        "router/http/bridge/chat.py",
        'event, buffer = buffer.rsplit(b"\\n\\n", 1)',
        "the event is read line by line: taking every complete event in the buffer at once gives the "
        "same data lines in the same order as taking them one at a time, and the same remainder",
    ),
    (
        "router/http/bridge/responses_request.py",
        'rest = rest.removeprefix("json_schema.").removesuffix("json_schema")',
        "the chat paths that reach it name json_schema only as their first segment, followed by '.' "
        "or nothing: both forms strip the same text from every one",
    ),
    (
        "router/http/dashboard.py",
        "d = drafted.get(name, )",
        "``d`` is only tested for truth (``... if d else None``): a missing tier's None and 0.0 "
        "are both false",
    ),
    (
        "router/http/app.py",
        "body_timeout_s: float = 31.0,",
        "a served app always gets the CLI's --body-timeout (router.cli passes it); the default reaches "
        "only in-process test apps, whose bodies arrive at once",
    ),
    (
        "router/http/reload.py",
        "await asyncio.sleep(1.2)",
        "the poll interval of a retired engine's drain: how soon it is dropped, not whether (no "
        "request sees it)",
    ),
]

_OPERATOR_TOKENS = {
    "comparison": {"<", "<=", ">", ">=", "==", "!=", "is", "in"},
    "arithmetic": {"+", "-", "*", "/", "//", "%", "**", "<<", ">>", "&", "|", "^", "~", "@"},
    "boolean": {"and", "or"},
    "negation": {"not"},
    "constant": {"True", "False", "None"},
    "keyword": {"break", "continue", "return", "pass", "yield", "raise"},
}


def package_of(module: str) -> str:
    """``router/http/bridge/chat.py`` -> ``router/http``; ``router/errors.py`` -> ``router``;
    ``classifier/...`` -> ``classifier`` (the packages the issue's acceptance scores)."""
    parts = module.split("/")
    if parts[0] == "classifier" or len(parts) == 2:
        return parts[0]
    return "/".join(parts[:2])


def _only_reexports(source: str) -> bool:
    """A module of imports, a docstring and ``__all__``: nothing a mutant could change."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                continue
        return False
    return True


def discover() -> tuple[list[str], dict[str, str]]:
    """Every module to sample, in ``PRIORITY`` order, and the ones skipped with their reason."""
    modules, skipped = [], {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in SKIPPED:
                skipped[rel] = SKIPPED[rel]
            elif _only_reexports(path.read_text()):
                skipped[rel] = "imports, a docstring and __all__ only (a re-export module)"
            else:
                modules.append(rel)
    rank = {p: i for i, p in enumerate(PRIORITY)}
    modules.sort(key=lambda m: (rank.get(package_of(m), len(rank)), m))
    return modules, skipped


@functools.cache
def _imported_names(path: Path) -> frozenset[str]:
    """Dotted modules a test file imports (``from a.b import c`` names ``a.b`` and ``a.b.c``)
    or names in a string (``monkeypatch.setattr("a.b.f", ...)``)."""
    names: set[str] = set()
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return frozenset()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(re.findall(r"\b(?:router|tiers|classifier)(?:\.\w+)+", node.value))
    return frozenset(names)


def _dotted(module: str) -> str:
    return ".".join(Path(module).with_suffix("").parts).removesuffix(".__init__")


@functools.cache
def _importers_in_tree() -> dict[str, frozenset[str]]:
    """Dotted source module -> the source modules (dotted) that import it."""
    out: dict[str, set[str]] = defaultdict(set)
    for tree in TREES:
        for path in (ROOT / tree).rglob("*.py"):
            me = _dotted(path.relative_to(ROOT).as_posix())
            for name in _imported_names(path):
                out[name].add(me)
    return {k: frozenset(v) for k, v in out.items()}


def _reexporters(dotted: str) -> set[str]:
    """``dotted`` and the packages whose ``__init__`` imports it (re-exports its names)."""
    found = {dotted}
    parts = dotted.split(".")
    for i in range(1, len(parts)):
        package = ".".join(parts[:i])
        if package in _importers_in_tree().get(dotted, frozenset()):
            found.add(package)
    return found


def tests_for(module: str, *, max_files: int) -> list[str]:
    """The module's mirrored tests, then the test files that import it - nearest the mirrored
    folder first, then the smallest - ``max_files`` in all."""
    mod = Path(module)
    dotted = _dotted(module)
    mirror = ROOT / "tests" / mod.parent
    mirrored = sorted(mirror.glob(f"test_{mod.stem}*.py")) if mirror.is_dir() else []
    every = sorted((ROOT / "tests").rglob("test_*.py"))

    def importing(targets: set[str]) -> list[Path]:
        return [
            path
            for path in every
            if path not in mirrored
            and any(n in targets or n.rpartition(".")[0] in targets for n in _imported_names(path))
        ]

    importers = importing(_reexporters(dotted))
    if not mirrored and not importers:
        # Reached only through another module (a route through the app, a part through its
        # whole): the tests named after it anywhere, then those of the modules importing it.
        mirrored = sorted(p for p in every if p.name.startswith(f"test_{mod.stem}"))
        users = set().union(*(_reexporters(u) for u in _importers_in_tree().get(dotted, frozenset())))
        importers = importing(users)

    def nearness(path: Path) -> tuple[int, int]:
        rel = path.relative_to(ROOT / "tests").parent.parts
        common = 0
        for a, b in zip(rel, mod.parent.parts, strict=False):
            if a != b:
                break
            common += 1
        return (-common, path.stat().st_size)

    chosen = [*mirrored, *sorted(importers, key=nearness)][:max_files]
    return [p.relative_to(ROOT).as_posix() for p in chosen]


def operator_of(diff: str) -> str:
    """The kind of change a mutant makes, from the tokens its diff swaps."""
    minus = [ln[1:] for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:] for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    if not minus or not plus:
        return "statement"

    def tokens(text: str) -> list[tuple[int, str]]:
        try:
            return [
                (t.type, t.string)
                for t in tokenize.generate_tokens(io.StringIO(text.strip() + "\n").readline)
                if t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.COMMENT)
            ]
        except (tokenize.TokenError, IndentationError, SyntaxError):
            return []

    old, new = tokens(minus[0]), tokens(plus[0])
    changed: list[tuple[int, str]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if tag != "equal":
            changed += old[i1:i2] + new[j1:j2]
    if not changed:
        return "other"
    if any(kind == tokenize.STRING for kind, _ in changed):
        return "string"
    if any(kind == tokenize.NUMBER for kind, _ in changed):
        return "number"
    texts = {text for _, text in changed}
    for name, marks in _OPERATOR_TOKENS.items():
        if texts & marks:
            return name
    if len(new) < len(old):
        return "argument"
    if all(kind == tokenize.NAME for kind, _ in changed):
        return "name"
    return "other"


def sample(mutants: dict[str, str], n: int, rng: random.Random) -> list[str]:
    """``n`` of ``mutants`` (name -> diff), stratified: round robin over the operators (in a
    seeded order), each operator's mutants interleaved over their functions."""
    by_op: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for name in sorted(mutants):
        function = name.rpartition("__mutmut_")[0]
        by_op[operator_of(mutants[name])][function].append(name)
    queues: list[list[str]] = []
    for op in sorted(by_op):
        functions = [sorted(v) for _, v in sorted(by_op[op].items())]
        for names in functions:
            rng.shuffle(names)
        rng.shuffle(functions)
        queue = []
        while any(functions):
            for names in functions:
                if names:
                    queue.append(names.pop())
        queues.append(queue)
    rng.shuffle(queues)
    picked: list[str] = []
    while len(picked) < n and any(queues):
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return sorted(picked)


_LIST_MUTANTS = """
import json, sys
from difflib import unified_diff
from pathlib import Path
import libcst as cst
from mutmut.mutation.file_mutation import mutate_file_contents
from mutmut.mutation.diff_apply import read_mutant_function, read_original_function
from mutmut.utils.format_utils import get_mutant_name
path = sys.argv[1]
mutated = mutate_file_contents(path, Path(path).read_text())
module = cst.parse_module(mutated.code)
out = {}
for name in mutated.mutant_names:
    key = get_mutant_name(Path(path), name)
    old, new = (
        cst.Module([f]).code.strip().split("\\n")
        for f in (read_original_function(module, key), read_mutant_function(module, key))
    )
    out[key] = "\\n".join(unified_diff(old, new, fromfile=path, tofile=path, lineterm=""))
json.dump(out, sys.stdout)
"""


def list_mutants(work: Path, module: str) -> dict[str, str]:
    """Every mutant mutmut makes of ``module`` (in the copy ``work``, whose configuration mutmut
    reads), name -> diff."""
    proc = subprocess.run(
        [sys.executable, "-c", _LIST_MUTANTS, module], cwd=work, capture_output=True, text=True, check=True
    )
    found: dict[str, str] = json.loads(proc.stdout)
    return found


def line_of(module: str, source: str, diff: str) -> int | None:
    """The line of ``module`` a mutant changes: where the diff's first removed line stands in the
    function it mutates (found by the mutant's name in the diff's header-less body)."""
    minus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    if not minus:
        return None
    first_def = next(
        (ln[1:].strip() for ln in diff.splitlines() if ln[1:].lstrip().startswith(("def ", "async def "))), ""
    )
    lines = source.splitlines()
    start = 0
    if first_def:
        start = next((i for i, ln in enumerate(lines) if ln.strip() == first_def), 0)
    for i in range(start, len(lines)):
        if lines[i].strip() == minus[0]:
            return i + 1
    return next((i + 1 for i, ln in enumerate(lines) if ln.strip() == minus[0]), None)


def equivalent_reason(module: str, line: str) -> str | None:
    for mod, mutated, why in [*EQUIVALENT, *mutation.EQUIVALENT]:
        if mod == module and mutated == line:
            return why
    return None


def _score(killed: int, sampled: int, equivalent: int) -> float | None:
    scored = sampled - equivalent
    return round(killed / scored, 4) if scored else None


_RUN_NARROWED = """
import json, sys
import mutmut.__main__ as mm
from mutmut.state import state
from mutmut.workers import isolation

own = json.load(open(sys.argv[1]))  # dotted module -> its test files
by_dotted = sorted(own.items(), key=lambda kv: -len(kv[0]))
collect = mm.collect_or_load_stats

def narrowed(runner, **kwargs):
    collect(runner, **kwargs)
    mapping = state().tests_by_mangled_function_name
    for function in list(mapping):
        files = next((f for d, f in by_dotted if function.startswith(d + ".")), [])
        mapping[function] = {t for t in mapping[function] if t.split("::")[0] in files}

def clean(self, tests):
    return 0  # the stats run has just run every one of them unmutated, and it passed

mm.collect_or_load_stats = narrowed
isolation.ForkServerRunner.run_clean_tests = clean
isolation.ForkRunner.run_clean_tests = clean
sys.argv = ["mutmut", *sys.argv[2:]]
mm.cli()
"""
"""``mutmut <args>``, with the map of which tests reach which function narrowed, once
collected, to each module's own test files (one stats run serves the whole package; each mutant
still runs only its module's tests), and without mutmut's second clean run of them."""


def _mutmut(work: Path, args: list[str], env: dict[str, str], timeout_s: float) -> tuple[str, bool]:
    """``mutmut <args>`` (``_RUN_NARROWED``) under ``nice -n 19`` in ``work``; on the timeout its
    whole process group is killed (what it saved so far stays)."""
    proc = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-c", _RUN_NARROWED, str(work / "own_tests.json"), *args],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        return proc.communicate(timeout=max(1.0, timeout_s))[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0], True


def run_group(
    modules: list[str],
    *,
    per_module: int,
    seed: int,
    max_test_files: int,
    examples: int,
    children: int,
    timeout_s: float,
) -> dict[str, dict[str, Any]]:
    """The sampled mutants of ``modules`` (one top-level tree) in one copy: one mutmut stats
    collection over the union of their tests, then each mutant against its module's tests."""
    tests = {m: tests_for(m, max_files=max_test_files) for m in modules}
    out: dict[str, dict[str, Any]] = {}
    for m in modules:
        if not tests[m]:
            out[m] = {"tests": [], "sampled": 0, "note": "no test file mirrors or imports the module"}
    union = list(dict.fromkeys(t for m in modules for t in tests[m]))
    todo = [m for m in modules if tests[m]]
    if not todo:
        return out
    with tempfile.TemporaryDirectory(prefix="tiered-router-mutation-sample-") as tmp:
        work = Path(tmp)
        _copy_repo(work)
        # Test files the working tree has and the committed tree lacks are not run.
        tests = {m: [t for t in found if (work / t).is_file()] for m, found in tests.items()}
        union = [t for t in union if (work / t).is_file()]
        config = _config(todo[0], [*union, "-m", "not slow"])
        config = config.replace(f"only_mutate = [{json.dumps(todo[0])}]", f"only_mutate = {json.dumps(todo)}")
        with (work / "pyproject.toml").open("a") as fh:
            fh.write(config)
        everything: dict[str, dict[str, str]] = {}
        picked: dict[str, list[str]] = {}
        for m in todo:
            everything[m] = list_mutants(work, m)
            picked[m] = sample(everything[m], per_module, random.Random(f"{seed}:{m}"))
        names = [n for m in todo for n in picked[m]]
        if not names:
            return {**out, **{m: {"tests": tests[m], "sampled": 0, "note": "no mutant"} for m in todo}}
        env = {**os.environ, "TIERED_ROUTER_PROPERTY_EXAMPLES": str(examples), "PYTHONDONTWRITEBYTECODE": "1"}
        started = time.monotonic()
        own = {_dotted(m): tests[m] for m in todo}
        (work / "own_tests.json").write_text(json.dumps(own))
        output, timed_out = _mutmut(work, ["run", "--max-children", str(children), *names], env, timeout_s)
        if not (work / "mutants" / "mutmut-stats.json").is_file():
            raise RuntimeError(f"mutmut collected no stats for {todo}:\n{output[-3000:]}")
        seconds = time.monotonic() - started
        codes: dict[str, int | None] = {}
        for m in todo:
            meta = work / "mutants" / (m + ".meta")
            if meta.is_file():
                codes.update(json.loads(meta.read_text())["exit_code_by_key"])
        sources = {m: (work / m).read_text() for m in todo}
    for m in todo:
        out[m] = {
            "tests": tests[m],
            "mutants_in_module": len(everything[m]),
            **_classify(m, sources[m], picked[m], everything[m], codes),
            "seconds_group": round(seconds, 1),
            **({"timed_out": True} if timed_out else {}),
        }
    return out


def _classify(
    module: str, source: str, picked: list[str], diffs: dict[str, str], codes: dict[str, int | None]
) -> dict[str, Any]:
    killed, survivors, equivalents, not_run = 0, [], [], []
    for key in picked:
        code = codes.get(key)
        if code is None:
            not_run.append(key)
            continue
        if code in STATUS:
            killed += 1
            continue
        diff = diffs[key].strip()
        changed = _changed_line(diff)
        entry = {
            "mutant": key,
            "location": f"{module}:{line_of(module, source, diff)}",
            "operator": operator_of(diff),
            "exit_code": code,
            "mutated_line": changed,
            "diff": diff,
        }
        reason = equivalent_reason(module, changed)
        if reason is None:
            survivors.append(entry)
        else:
            equivalents.append({**entry, "reason": reason})
    sampled = len(picked) - len(not_run)
    return {
        "sampled": sampled,
        "killed": killed,
        "survived": len(survivors),
        "equivalent": len(equivalents),
        "score": _score(killed, sampled, len(equivalents)),
        **({"not_run": not_run} if not_run else {}),
        "survivors": survivors,
        "equivalents": equivalents,
    }


def reclassify(res: dict[str, Any], module: str) -> dict[str, Any]:
    """Today's equivalent lists applied to a module's recorded survivors (no mutmut run)."""
    if not res.get("sampled"):
        return res
    survivors, equivalents = [], []
    for entry in [*res["survivors"], *res["equivalents"]]:
        plain = {k: v for k, v in entry.items() if k != "reason"}
        reason = equivalent_reason(module, plain["mutated_line"])
        if reason is None:
            survivors.append(plain)
        else:
            equivalents.append({**plain, "reason": reason})
    return {
        **res,
        "survived": len(survivors),
        "equivalent": len(equivalents),
        "score": _score(res["killed"], res["sampled"], len(equivalents)),
        "survivors": survivors,
        "equivalents": equivalents,
    }


def totals(modules: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per package: the modules measured, mutants sampled, killed, equivalent, survived, score."""
    out: dict[str, dict[str, Any]] = {}
    for module, res in sorted(modules.items()):
        t = out.setdefault(
            package_of(module), {"modules": 0, "sampled": 0, "killed": 0, "equivalent": 0, "survived": 0}
        )
        t["modules"] += 1
        for k in ("sampled", "killed", "equivalent", "survived"):
            t[k] += res.get(k, 0)
    for t in out.values():
        t["score"] = _score(t["killed"], t["sampled"], t["equivalent"])
    return out


def _write(out: Path, results: dict[str, Any]) -> None:
    results["packages"] = totals(results["modules"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modules", nargs="*", default=[], help="modules to run (paths)")
    parser.add_argument(
        "--packages", nargs="*", default=[], help="packages to run (router/openai, tiers/core, ...)"
    )
    parser.add_argument("--per-module", type=int, default=40, help="mutants sampled per module")
    parser.add_argument("--seed", type=int, default=58)
    parser.add_argument("--max-test-files", type=int, default=8, help="test files run per module")
    parser.add_argument("--examples", type=int, default=10, help="Hypothesis examples per property test")
    parser.add_argument("--children", type=int, default=2, help="mutants run at once")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="bound on one package's run")
    parser.add_argument("--budget-s", type=float, help="start no module after this many seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--list", action="store_true", help="print the modules and their tests, run nothing")
    parser.add_argument(
        "--reclassify", action="store_true", help="re-apply the equivalent lists to --out (no mutmut run)"
    )
    args = parser.parse_args(argv)
    everything, skipped = discover()
    modules = [m for m in everything if m in args.modules or package_of(m) in args.packages]
    if not args.modules and not args.packages:
        modules = everything
    if args.list:
        for m in modules:
            print(m, " ".join(tests_for(m, max_files=args.max_test_files)))
        return 0
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results.setdefault("modules", {})
    if args.reclassify:
        for m in list(results["modules"]):
            results["modules"][m] = reclassify(results["modules"][m], m)
        _write(args.out, results)
        return 0
    version = subprocess.run(
        [str(Path(sys.executable).with_name("mutmut")), "--version"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    results.update(
        tool=f"mutmut 3 ({version}), sampled",
        seed=args.seed,
        per_module=args.per_module,
        max_test_files=args.max_test_files,
        target=">= 0.85 of non-equivalent sampled mutants killed in each package",
        skipped=skipped,
    )
    started = time.monotonic()
    groups: dict[str, list[str]] = defaultdict(list)
    for module in modules:
        groups[package_of(module)].append(module)
    for package, group in groups.items():
        if args.budget_s is not None and time.monotonic() - started > args.budget_s:
            print(f"budget spent: {package} and the rest not run", flush=True)
            break
        print(f"{package}: {len(group)} modules...", flush=True)
        found = run_group(
            group,
            per_module=args.per_module,
            seed=args.seed,
            max_test_files=args.max_test_files,
            examples=args.examples,
            children=args.children,
            timeout_s=args.timeout_s,
        )
        for module, res in found.items():
            results["modules"][module] = {"commit": _head(), "per_module": args.per_module, **res}
            print(
                f"  {module}: {res.get('sampled', 0)} sampled, {res.get('killed', 0)} killed, "
                f"{res.get('equivalent', 0)} equivalent: score {res.get('score')}",
                flush=True,
            )
        _write(args.out, results)
    for package, t in totals(results["modules"]).items():
        print(f"{package}: {t['killed']}/{t['sampled'] - t['equivalent']} = {t['score']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
