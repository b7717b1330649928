"""Routing quality: RouteLLM's APGR of the shipped score per task family, against prompt length and random.

    python -m benchmarks.routing_quality [--no-cv] [--no-latency] [--draws 200]

Outcome data (read from ../shared/data/routing, never copied here):

* MMLU (Mixtral-8x7B-Instruct vs GPT-4-1106, RouteLLM): the 14 hash-chosen subjects the shipped
  artifact never saw, pooled and per MMLU category (STEM, humanities, social sciences, other);
* difficulty_7b (maths word problems, pre-algebra, Python, JavaScript; pass rates of seven 7-8B
  models) under two pairs: Mistral-7B base vs dolphin-2.9-llama3-8b (the pair training reads)
  and vs dolphin-2.6-mistral-7b (a pair training never reads). The two pairs whose gain is
  positive in every family; MetaMath's gain on code is nil, so its APGR there is undefined.

Routers: ``value`` (the shipped score, 3.2), ``previous`` (the previous configuration, 3.1: the
code override alone and the code-symbols flag on every prompt, refitted here on the same data),
``gated`` (issue 32's candidate, not shipped: 3.2 with the code-symbols flag gated off on
multiple-choice questions too, so an exam question's score is monotone in its length; refitted
here; LOFO too), the Spearman correlation of each router with prompt length inside each family,
prompt length (characters) and random (mean of 50). Every APGR has a 95 % percentile bootstrap interval.

**Leave-one-family-out** (the honest figure for a family the score never saw): each family of
each set is scored by the recipe refitted without any row of that family (MMLU categories,
difficulty_7b families). **Model selection** reads the worst family over all LOFO tables: for
each candidate configuration, ``min over families of min(APGR - length, APGR - random)``. The
largest leads; a candidate whose paired bootstrap interval of the difference (the same resampled
rows for every candidate) reaches 0 ties with it, and ties go to the pooled held-out MMLU APGR
(the larger sample, and the pair of the outcome sets the score is judged on). The shipped
configuration must be the one selected. Plus the subject-grouped 5-fold CV on MMLU (every
candidate; APGR per fold, averaged) and the score's latency on a 200-word prompt. Writes
benchmarks/results/routing_quality.json and routing_quality.png (LOFO APGR per family with
intervals, beside length and random).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.common import plot_path, write_json
from classifier import ComplexityClassifier
from classifier.training.outcome_train import (
    DIFFICULTY_7B,
    DIFFICULTY_PAIR,
    DROPPED_SUBJECTS,
    GATED_CONFIG,
    MMLU_OUTCOMES,
    OUTCOME_CONFIG,
    PREVIOUS_CONFIG,
    PROXY_PATH,
    OutcomeConfig,
    fit_outcomes,
    lofo_fitter,
    outcome_proba,
    training_rows,
)
from classifier.training.selection import LATENCY_PROMPT
from classifier.validation.families import (
    LENGTH,
    ORACLE,
    RANDOM,
    family_table,
    lofo_values,
    mixed_family,
    oracle_prior_length,
    paired_worst_margins,
    prompt_length,
    select_worst_family,
    worst_family,
)
from classifier.validation.outcomes import (
    OutcomeRow,
    heldout_subjects,
    load_outcomes,
    random_apgr,
    routing_metrics,
)

FOLDS = 5
SECOND_PAIR = (DIFFICULTY_PAIR[0], "cognitivecomputations/dolphin-2.6-mistral-7b")
CANDIDATES: dict[str, OutcomeConfig] = {
    "shipped": OUTCOME_CONFIG,
    "previous": PREVIOUS_CONFIG,
    "gated": GATED_CONFIG,
}


# The column of each candidate in the in-sample tables.
ROUTER_OF = {"shipped": "value", "previous": "previous", "gated": "gated"}


def _short(model: str) -> str:
    return model.rsplit("/", maxsplit=1)[-1]


def eval_sets() -> dict[str, list[OutcomeRow]]:
    """The evaluation sets: held-out MMLU subjects and difficulty_7b under the two pairs."""
    mmlu = load_outcomes(MMLU_OUTCOMES)
    held = set(heldout_subjects([r["subject"] for r in mmlu]))
    sets = {"mmlu held-out subjects": [r for r in mmlu if r["subject"] in held]}
    for pair in (DIFFICULTY_PAIR, SECOND_PAIR):
        sets[f"difficulty_7b {_short(pair[0])} vs {_short(pair[1])}"] = load_outcomes(
            DIFFICULTY_7B, pair=pair
        )
    return sets


def _fitted(config: OutcomeConfig) -> Any:
    rows, weights, _, _ = training_rows(MMLU_OUTCOMES, config, (PROXY_PATH,), (), (DIFFICULTY_7B,))
    return fit_outcomes(rows, config, weights)


def lofo_tables(
    config: OutcomeConfig, sets: dict[str, list[OutcomeRow]], draws: int
) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]]:
    """LOFO table and LOFO scores per evaluation set; a family's refit is shared by the sets that hold it."""
    fit_without = lofo_fitter(config)
    cache: dict[str, Any] = {}

    def cached(family: str) -> Any:
        if family not in cache:
            cache[family] = fit_without(family)
        return cache[family]

    values = {name: lofo_values(rows, cached) for name, rows in sets.items()}
    # No pooled row: each family is scored by another refit, so their scores share no scale.
    tables = {
        name: family_table(rows, {"value": values[name]}, draws, pooled=False) for name, rows in sets.items()
    }
    return tables, values


def selection(
    sets: dict[str, list[OutcomeRow]],
    tables: dict[str, dict[str, dict[str, Any]]],
    values: dict[str, dict[str, np.ndarray]],
    pooled_mmlu: dict[str, float],
    draws: int,
    mixed: dict[str, dict[str, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Worst of (mixed-family margin per set, in-sample; worst LOFO family) of each candidate over
    every set; the largest worst margin leads, candidates within its paired bootstrap noise tie with
    it, and the tie goes to pooled held-out MMLU APGR."""
    worst = {}
    for name, per_set in tables.items():
        checks = [dict(worst_family(t, "value"), set=s, check="within (LOFO)") for s, t in per_set.items()]
        checks += [
            dict(m, family="all", set=s, check="mixed")
            for s, m in ((mixed or {}).get(name) or {}).items()
            if m  # a set with one family has no mixed check
        ]
        worst[name] = min(checks, key=lambda w: w["margin"])
    margins = paired_worst_margins(sets, values, tables["shipped"], draws)
    for name, w in worst.items():  # a mixed-family minimum is not resampled: its margin holds fixed
        if w["check"] == "mixed":
            margins[name] = np.minimum(margins[name], w["margin"])
    return select_worst_family(worst, margins, pooled_mmlu)


def grouped_cv(rows: list[dict[str, Any]], config: OutcomeConfig = OUTCOME_CONFIG) -> dict[str, Any]:
    """MMLU, folds of whole subjects: each fold scored by a refit without its subjects. APGR per fold
    (one refit's scores share a scale; pooling folds would rank by each refit's offset first), and
    the mean over folds beside length's and random's."""
    from sklearn.model_selection import GroupKFold

    proxy = load_outcomes(PROXY_PATH)
    rated = load_outcomes(DIFFICULTY_7B, pair=config.difficulty_pair)
    subjects = np.array([r["subject"] for r in rows])
    folds: dict[str, list[float]] = {"value": [], LENGTH: [], RANDOM: []}
    for train_idx, test_idx in GroupKFold(n_splits=FOLDS).split(rows, groups=subjects):
        train = [rows[i] for i in train_idx] + proxy + rated
        weights = [1.0] * len(train_idx) + [config.proxy_weight] * len(proxy)
        weights += [config.difficulty_weight] * len(rated)
        pipeline = fit_outcomes(train, config, weights)
        test = [rows[i] for i in test_idx]
        weak, strong = [r["weak"] for r in test], [r["strong"] for r in test]
        scores = outcome_proba(pipeline, [r["prompt"] for r in test])
        folds["value"].append(routing_metrics(scores, weak, strong)["apgr"])
        folds[LENGTH].append(routing_metrics(prompt_length(test), weak, strong)["apgr"])
        folds[RANDOM].append(random_apgr(weak, strong))
    return {
        "n": len(rows),
        "folds": FOLDS,
        **{name: round(float(np.mean(v)), 4) for name, v in folds.items()},
        "per_fold": {name: [round(x, 4) for x in v] for name, v in folds.items()},
    }


def length_correlation(rows: list[OutcomeRow], routers: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Spearman correlation of each router's scores with prompt length, per family: 1.0 is a score
    that ranks a family's prompts by their length alone (what 3.2's stable families are for)."""
    from scipy.stats import spearmanr

    families = sorted({r["family"] for r in rows})
    out: dict[str, dict[str, float]] = {}
    for family in families:
        idx = [i for i, r in enumerate(rows) if r["family"] == family]
        length = prompt_length([rows[i] for i in idx])
        out[family] = {
            name: round(float(spearmanr(np.asarray(scores)[idx], length)[0]), 3)
            for name, scores in routers.items()
        }
    return out


def latency(clf: ComplexityClassifier, runs: int = 2000) -> dict[str, float]:
    prompt = LATENCY_PROMPT + " Thank you!"
    for _ in range(200):
        clf.score(prompt)
    times = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        clf.score(prompt)
        times.append(time.perf_counter_ns() - start)
    ms = np.asarray(times) / 1e6
    return {
        "words": len(prompt.split()),
        "p50_ms": round(float(np.percentile(ms, 50)), 4),
        "p99_ms": round(float(np.percentile(ms, 99)), 4),
    }


def plot(
    lofo: dict[str, dict[str, Any]],
    shipped: dict[str, dict[str, Any]],
    path: Any,
    candidate: dict[str, dict[str, Any]] | None = None,
) -> None:
    """One panel per set: LOFO APGR (and shipped, in-sample) per family, with intervals; with
    ``candidate`` (LOFO tables of another configuration) its bars too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lofo), figsize=(6.0 * len(lofo), 4.6), dpi=100)
    for ax, (name, table) in zip(np.atleast_1d(axes), lofo.items(), strict=True):
        families = [f for f, e in table.items() if e.get("judged")]
        x = np.arange(len(families))
        bars = [
            ("value, leave-one-family-out", [table[f]["value"] for f in families]),
            ("value (shipped)", [shipped[name][f]["value"] for f in families]),
            (LENGTH, [table[f][LENGTH] for f in families]),
        ]
        if candidate is not None:
            bars.insert(1, ("gated (candidate), LOFO", [candidate[name][f]["value"] for f in families]))
        width = 0.8 / len(bars)
        for i, (label, blocks) in enumerate(bars):
            mid = np.array([b["apgr"] for b in blocks])
            lo = mid - np.array([b["ci95"][0] for b in blocks])
            hi = np.array([b["ci95"][1] for b in blocks]) - mid
            offset = (i - (len(bars) - 1) / 2) * width
            ax.bar(x + offset, mid, width=width, yerr=[lo, hi], capsize=2, label=label)
        ax.scatter(
            x, [table[f][RANDOM]["apgr"] for f in families], color="k", marker="_", s=300, label=RANDOM
        )
        ax.axhline(0.5, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(x, [f.replace("mmlu_", "") for f in families], rotation=20, fontsize=8)
        ax.set_ylim(0.2, 1.0)
        ax.set_ylabel("APGR (95 % bootstrap)")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing_quality", description=__doc__)
    parser.add_argument("--no-cv", action="store_true", help="skip the MMLU subject-grouped CV")
    parser.add_argument("--no-latency", action="store_true", help="skip the latency run")
    parser.add_argument("--draws", type=int, default=200, help="bootstrap draws per interval")
    args = parser.parse_args(argv)

    sets = eval_sets()
    clf = ComplexityClassifier.load()
    previous = _fitted(PREVIOUS_CONFIG)
    gated = _fitted(GATED_CONFIG)
    shipped: dict[str, Any] = {}
    correlation: dict[str, Any] = {}
    for name, rows in sets.items():
        prompts = [r["prompt"] for r in rows]
        routers: dict[str, Any] = {
            "value": [s.value for s in clf.score_batch(prompts)],
            "previous": outcome_proba(previous, prompts),
            "gated": outcome_proba(gated, prompts),
        }
        correlation[name] = length_correlation(rows, routers)
        shipped[name] = family_table(rows, {**routers, ORACLE: oracle_prior_length(rows)}, args.draws)
    runs = {name: lofo_tables(config, sets, args.draws) for name, config in CANDIDATES.items()}
    lofo = {name: tables for name, (tables, _) in runs.items()}
    held = shipped["mmlu held-out subjects"]["all"]
    pooled_mmlu = {name: held[ROUTER_OF[name]]["apgr"] for name in CANDIDATES}
    mixed = {name: {s: mixed_family(t, ROUTER_OF[name]) for s, t in shipped.items()} for name in CANDIDATES}
    result: dict[str, Any] = {
        "data": {"mmlu": MMLU_OUTCOMES.name, "difficulty": DIFFICULTY_7B.name},
        "pairs": {"trained on": list(DIFFICULTY_PAIR), "second": list(SECOND_PAIR)},
        "shipped": shipped,
        "lofo": lofo["shipped"],
        "lofo_previous": lofo["previous"],
        "lofo_gated": lofo["gated"],
        "mixed_family": mixed,
        "selection": selection(
            sets, lofo, {n: v for n, (_, v) in runs.items()}, pooled_mmlu, args.draws, mixed
        ),
        "length_spearman": correlation,
    }
    if not args.no_latency:
        result["latency_200_words"] = latency(clf)
    if not args.no_cv:
        mmlu = [r for r in load_outcomes(MMLU_OUTCOMES) if r["subject"] not in DROPPED_SUBJECTS]
        result["grouped_cv"] = {name: grouped_cv(mmlu, config) for name, config in CANDIDATES.items()}
    plot(lofo["shipped"], shipped, plot_path("routing_quality"), candidate=lofo["gated"])
    path = write_json("routing_quality", result)
    print("| set | family | n | gap | value (shipped) | value LOFO | gated | gated LOFO | length | random |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, table in shipped.items():
        for family, e in table.items():
            if not e.get("judged"):
                continue
            lo = lofo["shipped"][name].get(family, e)["value"]
            glo = lofo["gated"][name].get(family, {"value": e["gated"]})["value"]

            def cell(b: dict[str, Any]) -> str:
                return f"{b['apgr']:.3f} [{b['ci95'][0]:.2f}, {b['ci95'][1]:.2f}]"

            print(
                f"| {name} | {family} | {e['n']} | {e['gap']:+.3f} | {cell(e['value'])} | {cell(lo)} | "
                f"{cell(e['gated'])} | {cell(glo)} | {cell(e[LENGTH])} | {e[RANDOM]['apgr']:.3f} |"
            )
    print(f"mixed families (pooled, in-sample): {mixed}")
    print(f"selection (worst of mixed and LOFO within-family): {result['selection']}")
    print(f"Spearman with length per family: {correlation}")
    if "grouped_cv" in result:
        print(f"MMLU grouped CV: {result['grouped_cv']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
