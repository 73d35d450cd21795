"""Regenerate the evidence on the default suite: every registered method and every named
preset on ``digits-c`` (3 seeds, with per-sample files) and on its realtime track
(``protocol.realtime=true``: ``<name>.realtime.json`` beside them, the leaderboard's
realtime column), zero-shot and TDA over 100 stream orders (``results/digits-c-orders``),
the stateful methods on ``digits-c-continual`` (3 seeds), the reference harness's online
family with zero-shot, TENT and CoTTA on the class-sorted ``digits-c-correlated`` (3 seeds,
``results/digits-c-correlated``), ``digits-c-full`` (seed 0), the
MuRA ablation (seed 0), the open-set suite ``digits-open`` (zeroshot, tent, tda, mura; 3
seeds), the leaderboards and the report ``results/digits-c/REPORT.md``.

    python benchmarks/digits_evidence.py              # run what is missing, then report
    python benchmarks/digits_evidence.py --report-only
    python benchmarks/digits_evidence.py --open-only  # the open-set runs, then report
    python benchmarks/digits_evidence.py --groups digits-c-correlated --methods roid lame

Every run goes through the harness (``tta-bench run``) with a fixed ``--output``, so a rerun
resumes: finished cells are skipped and a finished run does no work. Hyperparameters were
never selected on the evaluation corruptions (see each method's provenance header; the
selection suite is ``digits-c-extra``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "results" / "digits-c"
ABLATION = ROOT / "results" / "digits-c-ablation"
FULL = ROOT / "results" / "digits-c-full"
CONTINUAL = ROOT / "results" / "digits-c-continual"
OPEN = ROOT / "results" / "digits-open"
ORDERS = ROOT / "results" / "digits-c-orders"
#: The realtime twins' file suffix (in ``MAIN``, where the leaderboard finds them).
REALTIME = ".realtime.json"
#: The methods run over many stream orders, and how many.
ORDER_METHODS, N_ORDERS = ("zeroshot", "tda"), 100
SEEDS = "seeds=[0,1,2]"
#: The MuRA ablation and digits-c-full are reported for seed 0 (the run default is 0, 1, 2).
SEED0 = "seeds=[0]"
#: The online TTA family of the reference harness (mariodoebler/test-time-adaptation).
ONLINE_FAMILY = (
    "roid", "rmt", "cmf", "rotta", "lame", "memo", "rpl", "rdumb", "adacontrast", "santa",
    "gtta", "vte",
)  # fmt: skip
#: The methods the continual protocol (never reset) is reported for.
CONTINUAL_METHODS = ("zeroshot", "tent", "eta", "sar", "cotta", "mura", "lora", *ONLINE_FAMILY)
#: The class-sorted stream (the reference harness's ``correlated``) and its methods.
CORRELATED = ROOT / "results" / "digits-c-correlated"
CORRELATED_METHODS = ("zeroshot", "tent", "cotta", "mura", "lora", *ONLINE_FAMILY)
#: The open-set methods (each with its own OOD score) and the 2025 cache successors.
OPEN_SET_FAMILY = ("ostta", "sotta", "unient", "stamp", "cliptta", "zsntta", "rosita")
CACHE_2025 = ("mcp", "oga", "tca", "cosmic")
#: The methods the open-set suite ``digits-open`` is reported for.
OPEN_METHODS = ("zeroshot", "tent", "tda", "mura", "lora", *OPEN_SET_FAMILY, *CACHE_2025)
#: ZS-NTTA's noisy stream on the digits and its methods (their baselines: zero-shot, Tent,
#: TDA; SoTTA is among the open-set family).
NOISY = ROOT / "results" / "digits-noisy"
NOISY_METHODS = ("zeroshot", "tent", "tda", *OPEN_SET_FAMILY, *CACHE_2025)

#: (file stem, method, overrides): MuRA's ablation around its defaults, with single-rank
#: LoRA at matched placement (deepest block), views, loss, optimiser and steps as reference.
ABLATION_RUNS = [
    ("lora-matched", "lora", ["method.blocks=1"]),
    ("mura-default", "mura", []),
    ("mura-ranks-16", "mura", ["method.ranks=[16]"]),
    ("mura-fusion-softmax", "mura", ["method.fusion=softmax"]),
    ("mura-init-zero", "mura", ["method.init=zero"]),
    ("mura-router-fixed", "mura", ["method.router_persist=false"]),
]


def methods() -> list[str]:
    """Every registered method and every named preset (``tta-bench ls configs``)."""
    from tta_bench.config import presets
    from tta_bench.registry import registry

    return [*registry("methods").names(), *sorted(presets())]


def run(method: str, output: Path, *overrides: str, suite: str = "digits-c") -> float:
    """One harness run (resumed if ``output`` already holds part of it); the wall seconds its
    results file records (``wall_time_s``: the computing run's, not this no-op resume's)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        "tta-bench",
        "run",
        "--method",
        method,
        "--suite",
        suite,
        "--quiet",
        "--output",
        str(output.relative_to(ROOT)),
        *overrides,
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return float(json.loads(output.read_text(encoding="utf-8")).get("wall_time_s") or 0.0)


def tables(paths: list[Path], baseline: str, by_file: bool = False) -> str:
    from tta_bench.report.leaderboard import render_tables

    labels = [p.stem for p in paths] if by_file else None
    return render_tables(paths, fmt="github", baseline=baseline, labels=labels)


def mura_vs_lora(mura: Path, lora: Path) -> str:
    from tta_bench.report import paired, stats
    from tta_bench.run.results import load_results
    from tta_bench.run.samples import samples_dir

    a, b = load_results(mura), load_results(lora)
    cmp = stats.paired_comparison(a, b)
    by_cell = stats.paired_comparison(a, b, unit="cell")

    def fmt(c) -> str:
        return (
            f"{100 * c.mean_difference:+.2f} points, 95% CI [{100 * c.ci_low:+.2f}, "
            f"{100 * c.ci_high:+.2f}], p = {c.p_value:.3g}"
        )

    text = (
        f"MuRA minus single-rank LoRA (TTL setting), paired over {cmp.n_pairs} seeds: "
        f"{fmt(cmp)}; paired over the {by_cell.n_pairs} (corruption, seed) cells: "
        f"{fmt(by_cell)}."
    )
    if not (samples_dir(mura).is_dir() and samples_dir(lora).is_dir()):
        return text
    got = paired.compare(a, mura, b, lora)
    block, test = got["bootstrap_batch"], got["mcnemar"]
    return (
        f"{text} Per sample (`tta-bench compare results/digits-c/mura.json "
        f"results/digits-c/lora.json`), over {got['n']:,} samples: block bootstrap over "
        f"stream batches {100 * block['difference']:+.2f} points, 95% CI "
        f"[{100 * block['ci_low']:+.2f}, {100 * block['ci_high']:+.2f}]; McNemar "
        f"{test['a_only']} vs {test['b_only']} discordant samples, p = {test['p_value']:.3g}; "
        f"minimum detectable effect {100 * got['mde']['sample']:.2f} points."
    )


def ablation_deltas(paths: list[Path], reference: Path) -> list[str]:
    """Each ablation row minus the matched LoRA row, paired over (corruption, seed) cells."""
    from tta_bench.report import stats
    from tta_bench.run.results import load_results

    if not reference.exists():
        return []
    ref = load_results(reference)
    out = ["", f"Difference to `{reference.stem}`, paired over corruption cells (95% t CI):", ""]
    for path in paths:
        if path == reference:
            continue
        cmp = stats.paired_comparison(load_results(path), ref, unit="cell")
        low = "-" if cmp.ci_low is None else f"{100 * cmp.ci_low:+.2f}"
        high = "-" if cmp.ci_high is None else f"{100 * cmp.ci_high:+.2f}"
        p = "-" if cmp.p_value is None else f"{cmp.p_value:.3g}"
        out.append(
            f"- `{path.stem}`: {100 * cmp.mean_difference:+.2f} points [{low}, {high}], p = {p}"
        )
    return [*out, ""]


def weights_sha() -> str:
    from mura_plugin.models.tiny_clip import SHIPPED_WEIGHTS, file_sha256

    return file_sha256(SHIPPED_WEIGHTS)


def clean_accuracy() -> float:
    """Zero-shot accuracy (%) of the default model on the clean digits test split, with
    the default suite's text head."""
    import torch

    from mura_plugin.datasets.digits import digits_arrays
    from tta_bench.model import ZeroShotClassifier
    from tta_bench.registry import registry
    from tta_bench.run.protocol import load_protocol

    bundle = registry("models").get("tiny-clip-digits")()
    stream = registry("datasets").get("digits")(split="test")
    clf = ZeroShotClassifier(bundle, stream.classnames, list(load_protocol("digits-c").templates))
    x, y = digits_arrays("test")
    with torch.no_grad():
        pred = clf(torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255.0).argmax(dim=1)
    return 100 * float((pred == torch.from_numpy(y)).float().mean())


def report(wall: dict[str, float]) -> str:
    from tta_bench import catalog

    main_files = [p for p in sorted(MAIN.glob("*.json")) if not p.name.endswith(REALTIME)]
    lines = [
        "# Evidence on the default suite `digits-c`",
        "",
        "Generated by the harness; regenerate with `python benchmarks/digits_evidence.py` "
        "(runs resume, so only missing cells are computed) and the leaderboard with "
        "`tta-bench leaderboard results/digits-c --suite digits-c`.",
        "",
        f"Suite: {catalog.description('suites', 'digits-c')} Model `tiny-clip-digits` "
        f"(shipped weights, SHA-256 `{weights_sha()[:16]}...`; {clean_accuracy():.1f}% clean "
        "zero-shot accuracy on the digits test split). Accuracy in %, mean over 3 seeds "
        "(0, 1, 2) with a 95% Student-t interval; each seed changes the data order, the "
        "corruption noise and the view augmentation. Every method starts from the protocol's "
        "text head (the digits templates).",
        "",
        "Hyperparameter selection: none was done on the 15 evaluation corruptions. Every "
        "method runs its official setting (each method file's provenance header). Named "
        "presets (`tta-bench ls configs`) are rows of their own: `tent-digits` (info-max, "
        "Adam 2e-2, 5 steps) was selected on `digits-c-extra`; `mura-seed` is the seed "
        "article's sketch. MuRA's learning rate and component scale were studied on "
        "`digits-c-extra` only (`benchmarks/mura_study.py`, `results/mura-study`).",
        "",
        "## All methods",
        "",
        tables(main_files, baseline="zeroshot"),
    ]
    mura, lora = MAIN / "mura.json", MAIN / "lora.json"
    if mura.exists() and lora.exists():
        lines += ["## MuRA vs single-rank LoRA", "", mura_vs_lora(mura, lora), ""]
    lines += mura_variants_section()
    lines += realtime_and_orders()
    lines += online_family()
    ablation = sorted(ABLATION.glob("*.json"))
    if ablation:
        lines += [
            "## MuRA ablation",
            "",
            "Reference row: single-rank LoRA (r = 16, q and v) at MuRA's placement (deepest "
            "block), views, loss, optimiser and steps (`lora-matched`). Seed 0 only.",
            "",
            "Runs (file -> overrides): "
            + "; ".join(f"`{s}`: `--method {m} {' '.join(o)}`" for s, m, o in ABLATION_RUNS),
            "",
            tables(ablation, baseline=None, by_file=True),
            *ablation_deltas(ablation, ABLATION / "lora-matched.json"),
        ]
    continual = sorted(CONTINUAL.glob("*.json"))
    if continual:
        lines += [
            "## Continual (`digits-c-continual`: the 15 corruptions in one stream, never reset)",
            "",
            tables(continual, "zeroshot"),
        ]
    lines += open_sections()
    full = sorted(FULL.glob("*.json"))
    if full:
        lines += ["## All severities (`digits-c-full`, seed 0)", "", tables(full, "zeroshot")]
    if wall:
        lines += ["## Wall time of each run (as its results file records it)", ""]
        lines += [f"- `{k}`: {v:.0f} s" for k, v in wall.items()]
    return "\n".join(lines).rstrip() + "\n"


def open_sections() -> list[str]:
    """The REPORT's open-set sections: ``digits-open`` and the noisy ``digits-noisy``."""
    from tta_bench import catalog

    lines: list[str] = []
    open_set = sorted(OPEN.glob("*.json"))
    if open_set:
        lines += [
            "## Open set (`digits-open`: digits 0-4 known, 5-9 unknown, half the stream)",
            "",
            catalog.description("suites", "digits-open"),
            "",
            tables(open_set, "zeroshot"),
            "Accuracy and calibration on the known digits only; AUROC / AUPR (in-distribution "
            "positive) / FPR95 of the maximum softmax probability telling known from unknown "
            "digits. Per-shift tables: `results/digits-open/leaderboard.md`.",
            "",
            *own_score_section(OPEN),
        ]
    noisy = sorted(NOISY.glob("*.json"))
    if noisy:
        lines += [
            "## Noisy stream (`digits-noisy`: ZS-NTTA's protocol on the digits)",
            "",
            catalog.description("suites", "digits-noisy"),
            "",
            tables(noisy, "zeroshot"),
            *own_score_section(NOISY),
        ]
    return lines


def own_score_section(folder: Path) -> list[str]:
    """The open-set methods' own OOD scores beside the protocol's maximum softmax: per
    method the mean over its cells of AUROC and FPR95 from either score, the own-minus-msp
    AUROC difference with its Bonferroni-adjusted interval over the 7 methods (paired t over
    the 3 seeds' suite means; an interval excluding 0 is marked), and ZS-NTTA's accuracies
    where the method decides."""
    from tta_bench.report import stats
    from tta_bench.run.samples import method_label

    rows = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        cells = [c for c in record["cells"] if c.get("auroc_own") is not None]
        if not cells:
            continue
        per_seed: dict[int, list[float]] = {}
        for c in cells:
            per_seed.setdefault(c["seed"], []).append(c["auroc_own"] - c["auroc"])
        diffs = [sum(v) / len(v) for _, v in sorted(per_seed.items())]
        est = stats.describe(diffs, confidence=1 - 0.05 / len(OPEN_SET_FAMILY))
        interval = f"{100 * est.mean:+.1f}"
        if max(abs(d) for d in diffs) < 1e-4:  # the msp itself (float rounding apart)
            interval = "0 (the same score)"
        elif est.ci_low is not None and est.ci_high is not None:
            interval += f" [{100 * est.ci_low:+.1f}, {100 * est.ci_high:+.1f}]"
            interval += " *" if est.ci_low > 0 or est.ci_high < 0 else ""

        def mean(key: str, cells: list[dict] = cells) -> str:
            values = [c[key] for c in cells if c.get(key) is not None]
            return f"{100 * sum(values) / len(values):.1f}" if values else "-"

        rows.append(
            f"| {method_label(record)} | {mean('auroc')} | {mean('auroc_own')} | {interval} "
            f"| {mean('fpr95')} | {mean('fpr95_own')} | {mean('acc_id')} | {mean('acc_ood')} "
            f"| {mean('acc_h')} |"
        )
    if not rows:
        return []
    return [
        "Each open-set method's own OOD score (`Method.own_ood_score`) beside the maximum "
        "softmax probability (msp), over all its cells (%); own - msp: the AUROC difference "
        "with its Bonferroni-adjusted interval over the family of 7 (99.3%; a paired t over "
        "the 3 seeds' means; * the interval excludes 0); ACC-ID / ACC-OOD / ACC-H: ZS-NTTA's "
        "accuracies, for the methods that decide in or out themselves.",
        "",
        "| method | AUROC msp | AUROC own | own - msp | FPR95 msp | FPR95 own | ACC-ID "
        "| ACC-OOD | ACC-H |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def mura_variants_section() -> list[str]:
    """ "When does MuRA help?": the held-out-tuned variants (``benchmarks/mura_variants.py``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mura_variants

    return mura_variants.report_section()


def paired_interval(a: Path, b: Path, confidence: float = 0.95) -> tuple[float, float, float, str]:
    """``A - B`` (fractions) with its interval at ``confidence`` and the unit resampled: the
    batch block bootstrap over the paired samples when both runs have per-sample files,
    else the paired t over the seeds."""
    from tta_bench.report import paired, stats

    ra, rb = (json.loads(p.read_text(encoding="utf-8")) for p in (a, b))
    try:
        boot = paired.compare(ra, a, rb, b, confidence=confidence)["bootstrap_batch"]
        return boot["difference"], boot["ci_low"], boot["ci_high"], "batches"
    except (ValueError, FileNotFoundError):
        seed = stats.paired_comparison(ra, rb, "accuracy", "seed", "t", confidence)
        return seed.mean_difference, seed.ci_low, seed.ci_high, "seeds"


def paired_delta(a: Path, b: Path) -> str:
    """``A - B`` in points with its 95% interval (``paired_interval``)."""
    d, lo, hi, unit = paired_interval(a, b)
    return f"{100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] ({unit})"


def online_family() -> list[str]:
    """Where each method of the reference harness's online family lands against TENT and
    MuRA on each suite it ran on, with paired intervals."""
    lines: list[str] = []
    for folder, suite in ((MAIN, "digits-c"), (CONTINUAL, "digits-c-continual"),
                          (CORRELATED, "digits-c-correlated")):  # fmt: skip
        runs = [m for m in ONLINE_FAMILY if (folder / f"{m}.json").exists()]
        if not runs:
            continue
        anchors = [m for m in ("zeroshot", "tent", "mura") if (folder / f"{m}.json").exists()]
        head = ["method", "accuracy %"] + [f"Δ vs {m} [95% CI]" for m in anchors]
        rows = []
        for m in runs:
            rec = json.loads((folder / f"{m}.json").read_text(encoding="utf-8"))
            row = [f"`{m}`", f"{100 * rec['summary']['mean_accuracy']:.1f}"]
            row += [paired_delta(folder / f"{m}.json", folder / f"{a}.json") for a in anchors]
            rows.append(row)
        lines += [f"### `{suite}`", "", "| " + " | ".join(head) + " |"]
        lines += ["|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows] + [""]
    if lines:
        lines = [
            "## The reference harness's online family",
            "",
            "Each method against zero-shot, TENT and MuRA on the same streams (3 seeds): the "
            "difference in points with its 95% interval, from the batch block bootstrap over "
            "the paired samples (stream batches resampled whole, as online samples are not "
            "independent) where both runs have per-sample files, else the paired t over the "
            "3 seeds. No multiplicity correction here: the leaderboards give the q-values.",
            "",
            *lines,
        ]
    return lines


def realtime_and_orders() -> list[str]:
    """The report's sections on the realtime track and on many stream orders."""
    lines = []
    twins = sorted(MAIN.glob("*" + REALTIME))
    if twins:
        lines += [
            "## When the stream does not wait (`protocol.realtime=true`)",
            "",
            "The compute-matched track: one batch per unit of the reference's cost (an "
            "image-tower forward per image; a backward counts two); a method whose step costs "
            "k units adapts on one batch in k and predicts the others with its current state "
            "(Alfarra et al., ICML 2024). Files `<name>.realtime.json`; the leaderboard's "
            "`realtime acc %` and `adapted %` columns.",
            "",
            tables(twins, "zeroshot", by_file=True),
        ]
    orders = sorted(ORDERS.glob("*.json"))
    if orders:
        from tta_bench.report.stats import order_spread
        from tta_bench.run.results import load_results

        lines += [f"## {N_ORDERS} stream orders (`protocol.orders={N_ORDERS}`)", ""]
        for path in orders:
            spread = order_spread(load_results(path))
            if spread is not None:
                est = spread.estimate
                lines.append(
                    f"- `{path.stem}`: {100 * est.mean:.2f}% over {est.n} orders (95% CI "
                    f"[{100 * est.ci_low:.2f}, {100 * est.ci_high:.2f}]), central 95% of "
                    f"orders {100 * spread.low:.2f} to {100 * spread.high:.2f}%, Expected "
                    f"Tail Accuracy (worst {spread.tail_n}) {100 * spread.tail:.2f}%"
                )
        lines += ["", "Leaderboard: `results/digits-c-orders/leaderboard.md`.", ""]
    return lines


def plan(full: list[str]) -> list[tuple[str, str, Path, list[str], str]]:
    """Every run of the evidence, in report order: ``(key, method, output, overrides,
    suite)``."""
    out = [(f"digits-c/{m}", m, MAIN / f"{m}.json", [SEEDS], "digits-c") for m in methods()]
    rt = [SEEDS, "protocol.realtime=true", "log_samples=false"]
    out += [(f"realtime/{m}", m, MAIN / f"{m}{REALTIME}", rt, "digits-c") for m in methods()]
    out += [
        (f"orders/{m}", m, ORDERS / f"{m}.json", [f"protocol.orders={N_ORDERS}"], "digits-c")
        for m in ORDER_METHODS
    ]
    out += [
        (f"digits-c-continual/{m}", m, CONTINUAL / f"{m}.json", [SEEDS], "digits-c-continual")
        for m in CONTINUAL_METHODS
    ]
    out += [
        (f"digits-c-correlated/{m}", m, CORRELATED / f"{m}.json", [SEEDS], "digits-c-correlated")
        for m in CORRELATED_METHODS
    ]
    out += [
        (f"ablation/{stem}", m, ABLATION / f"{stem}.json", [*o, SEED0], "digits-c")
        for stem, m, o in ABLATION_RUNS
    ]
    out += [(f"digits-c-full/{m}", m, FULL / f"{m}.json", [SEED0], "digits-c-full") for m in full]
    out += [
        (f"digits-open/{m}", m, OPEN / f"{m}.json", [SEEDS], "digits-open") for m in OPEN_METHODS
    ]
    out += [
        (f"digits-noisy/{m}", m, NOISY / f"{m}.json", [SEEDS], "digits-noisy")
        for m in NOISY_METHODS
    ]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--skip-ablation", action="store_true")
    p.add_argument(
        "--full",
        nargs="*",
        default=["zeroshot", "tent-digits"],
        help="methods also run on digits-c-full",
    )
    p.add_argument("--skip-continual", action="store_true")
    p.add_argument("--skip-realtime", action="store_true")
    p.add_argument("--skip-orders", action="store_true")
    p.add_argument("--skip-open", action="store_true")
    p.add_argument("--open-only", action="store_true", help="only the open-set runs")
    p.add_argument("--groups", nargs="*", help="run only these groups (e.g. digits-c realtime)")
    p.add_argument("--methods", nargs="*", help="run only these methods")
    args = p.parse_args()
    wall: dict[str, float] = {}
    for key, method, output, overrides, suite in plan(args.full):
        group = key.split("/")[0]
        skip = (
            args.report_only
            or (args.groups is not None and group not in args.groups)
            or (args.methods is not None and method not in args.methods)
            or (args.open_only and group != "digits-open")
            or (args.skip_open and group == "digits-open")
            or (args.skip_continual and group == "digits-c-continual")
            or (args.skip_ablation and group == "ablation")
            or (args.skip_realtime and group == "realtime")
            or (args.skip_orders and group == "orders")
        )
        if not skip:
            wall[key] = run(method, output, *overrides, suite=suite)
        elif output.exists():  # reported as its file records it
            wall[key] = float(
                json.loads(output.read_text(encoding="utf-8")).get("wall_time_s") or 0
            )
    text = report(wall)
    (MAIN / "REPORT.md").write_text(text, encoding="utf-8")
    for folder, suite in (
        (MAIN, "digits-c"),
        (CONTINUAL, "digits-c-continual"),
        (CORRELATED, "digits-c-correlated"),
        (OPEN, "digits-open"),
        (NOISY, "digits-noisy"),
    ):
        if any(folder.glob("*.json")):
            subprocess.run(
                ["tta-bench", "leaderboard", str(folder.relative_to(ROOT)), "--suite", suite],
                cwd=ROOT,
                check=True,
            )
    if any(ORDERS.glob("*.json")):  # a board of its own protocol (the orders are in its id)
        first = json.loads(next(iter(sorted(ORDERS.glob("*.json")))).read_text(encoding="utf-8"))
        subprocess.run(
            ["tta-bench", "leaderboard", str(ORDERS.relative_to(ROOT)), "--suite", "digits-c",
             "--protocol", first["protocol"]["id"]],
            cwd=ROOT,
            check=True,
        )  # fmt: skip
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
