"""When does MuRA help? Its variants, tuned on the held-out shifts, then evaluated.

Every variant is an option of the one method (``tta-bench run --method mura
method.<option>=...``); the study never looks at the evaluation corruptions to choose.

* ``--part grid``: a grid on ``digits-c-extra`` (speckle noise, Gaussian blur, spatter,
  saturate at severity 5; 3 seeds) in three settings, each the harness's reset policy:

  - ``episodic``: one episode per image (``method.episodic=sample``, MuRA's default): 63
    views + the original, one AdamW step at MuRA's 5e-4, reset after every image (the router
    persists);
  - ``per_shift``: online within a shift (``method.episodic=online``; the suite resets at
    each shift): the components persist from batch to batch, 15 views + the original per
    image, one step per batch;
  - ``continual``: online and never reset (``protocol.reset=continual``): the four shifts
    in one stream. Its grid is the per-shift grid's best ``CONTINUAL_TOP`` points (the
    online options, rerun under the continual protocol), not a grid of its own.

  Options: the towers carrying the components (vision, text, both) x the adaptation signal
  (``SIGNALS``) x, online, the learning rate (5e-4, 5e-3). Then, at each setting's chosen
  point, the matched single rank (``ranks=[28]``: the adapter parameters of ranks 4, 8,
  16) and, online, the update period (``adapt_every`` 2 and 4).
* ``--part eval``: each setting's chosen variant and its matched single rank, 3 seeds, on
  the evaluation suites (``EVAL``), beside the committed TTL (``lora``), TENT and
  zero-shot runs; a chosen variant equal to MuRA's defaults reads the committed
  ``results/<suite>/mura.json`` instead of running it again.
* ``--part report``: ``results/mura-variants/README.md`` (the grid, the choices, the
  evaluation and the cost); ``benchmarks/digits_evidence.py`` puts the evaluation in
  ``results/digits-c/REPORT.md`` ("When does MuRA help?") through ``report_section``.

Choice rule, per setting: the highest mean held-out accuracy over the 3 seeds; an option
within 0.1 point of it that costs less (fewer towers) wins the tie. Runs resume: a rerun
computes only the missing cells and files.

Usage::

    python benchmarks/mura_variants.py [--part grid|eval|report|all] [--dir results/mura-variants]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIR = ROOT / "results" / "mura-variants"
SEEDS = "seeds=[0,1,2]"
HELD_OUT = "digits-c-extra"
TOWERS = ("vision", "text", "both")
#: The adaptation signals: name -> overrides. ``entropy``: TTL's confidence-weighted
#: entropy over every view (MuRA's default); ``confident``: TPT's entropy of the mean of the
#: 10% most confident views; ``consistency``: the seed article's two-view consistency (two
#: crops of 0.7-1.0 of the area rotated within +-10 degrees, no flip, no original; the
#: negative cosine of their features); ``augmix``: the default loss on AugMix'd crops;
#: ``infomax``: per-sample entropy minus the entropy of the batch mean (what makes online
#: entropy minimisation work on these small domains: the ``tent-digits`` preset's loss).
SIGNALS = {
    "entropy": [],
    "confident": ["method.loss=marginal_entropy"],
    "consistency": [
        "method.loss=consistency",
        "method.views=2",
        "method.include_original=false",
        "method.crop_scale_min=0.7",
        "method.rotate_degrees=10",
        "method.flip=false",
    ],
    "augmix": ["method.augmix=true"],
    "infomax": ["method.loss=info_max"],
}
#: Per setting: (signals, learning rates, overrides every point of it shares).
SETTINGS = {
    "episodic": (("entropy", "confident", "consistency", "augmix"), (5e-4,), []),
    "per_shift": (
        ("entropy", "confident", "consistency", "infomax"),
        (5e-4, 5e-3),
        ["method.episodic=online", "method.views=15"],
    ),
}
CONTINUAL = ["protocol.reset=continual"]
#: The preset a setting's chosen variant became (it beat zero-shot and TTL, ``verdict``).
PRESETS = {"per_shift": "mura-online", "continual": "mura-online-text"}
CONTINUAL_TOP = 4
MATCHED_SINGLE = "method.ranks=[28]"
PERIODS = (2, 4)
TIE = 0.1  # points
#: The evaluation suites every setting's chosen variant runs on (the suite's own reset
#: policy applies: an online variant is per shift on digits-c, continual on
#: digits-c-continual, whichever setting chose it).
SUITES = ("digits-c", "digits-c-continual", "digits-c-correlated", "digits-open")
EVAL = {"episodic": SUITES, "per_shift": SUITES, "continual": SUITES}
#: Setting -> the suite its multi-rank vs matched single-rank pair is evaluated on.
HOME = {"episodic": "digits-c", "per_shift": "digits-c", "continual": "digits-c-continual"}


@dataclass(frozen=True)
class Point:
    """One point of the grid: a file stem and the overrides of ``tta-bench run``."""

    setting: str
    towers: str
    signal: str
    lr: float
    extra: tuple[str, ...] = ()

    @property
    def stem(self) -> str:
        tail = "".join(
            "_" + o.split(".", 1)[1].replace("=", "").replace("[", "").replace("]", "")
            for o in self.extra
        )
        return f"{self.setting}_{self.towers}_{self.signal}_lr{self.lr:g}{tail}"

    def overrides(self) -> list[str]:
        shared = SETTINGS["per_shift" if self.setting == "continual" else self.setting][2]
        out = list(shared) + list(SIGNALS[self.signal])
        if self.towers != "vision":
            out.append(f"method.towers={self.towers}")
        if self.lr != 5e-4:
            out.append(f"method.lr={self.lr:g}")
        if self.setting == "continual":
            out += CONTINUAL
        by_key = {o.split("=", 1)[0]: o for o in out + list(self.extra)}  # the later wins
        return list(by_key.values())

    def method_overrides(self) -> list[str]:
        """The overrides that configure the method (not the protocol)."""
        return [o for o in self.overrides() if o.startswith("method.")]


def run(output: Path, overrides: list[str], suite: str, method: str = "mura") -> dict:
    """One ``tta-bench run`` of ``method`` (resumed where ``output`` holds part of it)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tta_bench.cli", "run", "--method", method, "--quiet"]
    cmd += ["--suite", suite, "--output", str(output), SEEDS, *overrides]
    print("$", " ".join(cmd[2:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{output.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(output.read_text(encoding="utf-8"))


def accuracy(record: dict) -> float:
    return 100 * record["summary"]["mean_accuracy"]


def grid_points(setting: str) -> list[Point]:
    """The setting's grid; the consistency signal reads image features only, so it has no
    text-only point (mura refuses it)."""
    signals, lrs, _ = SETTINGS[setting]
    return [
        Point(setting, t, s, lr)
        for s in signals
        for t in TOWERS
        for lr in lrs
        if not (t == "text" and s == "consistency")
    ]


def choose(scored: dict[Point, float]) -> Point:
    """The best point; within ``TIE`` of it, the one with the fewest towers (vision, then
    text, then both), then the earlier signal of the grid."""
    best = max(scored.values())
    near = [p for p, acc in scored.items() if acc >= best - TIE]
    return min(near, key=lambda p: (TOWERS.index(p.towers), -scored[p]))


def run_grid(out: Path) -> dict[str, dict[Point, float]]:
    """Every grid point on the held-out suite; returns setting -> point -> accuracy."""
    extra = out / HELD_OUT
    scored: dict[str, dict[Point, float]] = {}
    for setting in SETTINGS:
        scored[setting] = {
            p: accuracy(run(extra / f"{p.stem}.json", p.overrides(), HELD_OUT))
            for p in grid_points(setting)
        }
    top = sorted(scored["per_shift"], key=lambda p: -scored["per_shift"][p])[:CONTINUAL_TOP]
    scored["continual"] = {}
    for p in top:
        q = Point("continual", p.towers, p.signal, p.lr)
        scored["continual"][q] = accuracy(run(extra / f"{q.stem}.json", q.overrides(), HELD_OUT))
    for setting, points in scored.items():
        chosen = choose(points)
        run(extra / f"{chosen.stem}_single.json", [*chosen.overrides(), MATCHED_SINGLE], HELD_OUT)
        if setting != "episodic":
            for n in PERIODS:
                q = Point(
                    setting, chosen.towers, chosen.signal, chosen.lr, (f"method.adapt_every={n}",)
                )
                run(extra / f"{q.stem}.json", q.overrides(), HELD_OUT)
    run(extra / "zeroshot.json", [], HELD_OUT, method="zeroshot")
    # the continual points are compared with zero-shot under their own protocol
    run(extra / "zeroshot_continual.json", CONTINUAL, HELD_OUT, method="zeroshot")
    run(extra / "lora.json", [], HELD_OUT, method="lora")
    return scored


def load_grid(out: Path) -> dict[str, dict[Point, float]]:
    """The grid's accuracies from the files of ``run_grid`` (without running anything)."""
    extra = out / HELD_OUT
    scored: dict[str, dict[Point, float]] = {s: {} for s in (*SETTINGS, "continual")}
    for setting in SETTINGS:
        for p in grid_points(setting):
            path = extra / f"{p.stem}.json"
            if path.exists():
                scored[setting][p] = accuracy(json.loads(path.read_text(encoding="utf-8")))
    for path in sorted(extra.glob("continual_*.json")):
        parts = path.stem.split("_")
        if len(parts) == 4:  # continual_<towers>_<signal>_lr<lr>
            p = Point("continual", parts[1], parts[2], float(parts[3][2:]))
            scored["continual"][p] = accuracy(json.loads(path.read_text(encoding="utf-8")))
    return scored


def chosen_points(out: Path) -> dict[str, Point]:
    grid = load_grid(out)
    missing = [s for s, pts in grid.items() if not pts]
    if missing:
        raise SystemExit(f"no grid results for {missing} in {out / HELD_OUT}: run --part grid")
    return {setting: choose(points) for setting, points in grid.items()}


def eval_path(out: Path, chosen: Point, suite: str, single: bool = False) -> Path:
    """The evaluation file of a setting's chosen variant (or its matched single rank); the
    committed default run where the chosen variant is MuRA's defaults."""
    if not single and chosen.overrides() == []:
        return ROOT / "results" / suite / "mura.json"
    return out / suite / f"{chosen.setting}{'_single' if single else ''}.json"


def run_eval(out: Path) -> None:
    chosen = chosen_points(out)
    for setting, point in chosen.items():
        method = [o for o in point.overrides() if o not in CONTINUAL]
        for suite in EVAL[setting]:
            run(eval_path(out, point, suite), method, suite)
        run(eval_path(out, point, HOME[setting], True), [*method, MATCHED_SINGLE], HOME[setting])


# -- the report ------------------------------------------------------------------------------
def _evidence():
    """``benchmarks/digits_evidence.py`` (its paired intervals and tables)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import digits_evidence

    return digits_evidence


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _ci(record: dict) -> str:
    from tta_bench.report import stats

    est = stats.suite_estimate(record)
    if est is None:
        return "n/a"
    return f"{100 * est.mean:.2f} [{100 * est.ci_low:.2f}, {100 * est.ci_high:.2f}]"


def cost(record: dict) -> str:
    """ms per sample, forward and backward passes per sample (image-tower equivalents, as
    the harness counts them) and peak memory, from a results file's cells."""
    cells = [c for c in record["cells"] if "accuracy" in c]

    def mean(key: str) -> float:
        values = [c[key] for c in cells if c.get(key) is not None]
        return sum(values) / len(values) if values else float("nan")

    ms = 1000 * record["summary"]["mean_time_per_sample_s"]
    peak = record["summary"].get("max_peak_memory_bytes") or 0
    return (
        f"{ms:.2f} | {mean('forward_passes_per_sample'):.1f} | "
        f"{mean('backward_passes_per_sample'):.1f} | {peak / 2**20:.0f}"
    )


def grid_table(out: Path, setting: str, points: dict[Point, float]) -> list[str]:
    rows = sorted(
        {(p.signal, p.lr) for p in points}, key=lambda k: (list(SIGNALS).index(k[0]), k[1])
    )
    lines = ["| signal | lr | " + " | ".join(TOWERS) + " |", "|---|---|" + "---|" * len(TOWERS)]
    for signal, lr in rows:
        cells = []
        for towers in TOWERS:
            p = Point(setting, towers, signal, lr)
            path = out / HELD_OUT / f"{p.stem}.json"
            cells.append(_ci(_load(path)) if p in points and path.exists() else "-")
        lines.append(f"| {signal} | {lr:g} | " + " | ".join(cells) + " |")
    return lines


def _interval(a: Path, b: Path, confidence: float = 0.95) -> tuple[str, bool]:
    """``A - B`` in points with its interval at ``confidence``, and whether the interval
    excludes zero above."""
    d, lo, hi, unit = _evidence().paired_interval(a, b, confidence)
    return f"{100 * d:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}] ({unit})", lo > 0


def choice_lines(out: Path, grid: dict[str, dict[Point, float]]) -> list[str]:
    """Why each setting's point was chosen: its held-out accuracy against the runner-up
    and zero-shot on the same suite."""
    zs = accuracy(_load(out / HELD_OUT / "zeroshot.json"))
    lines = []
    for setting, points in grid.items():
        if not points:
            continue
        chosen = choose(points)
        ranked = sorted(points, key=lambda p: -points[p])
        runner = next((p for p in ranked if p != chosen), None)
        why = (
            "the highest held-out accuracy"
            if points[chosen] == points[ranked[0]]
            else f"within {TIE} point of the best (`{ranked[0].stem}`, "
            f"{points[ranked[0]]:.2f}) with fewer towers"
        )
        lines.append(
            f"- **{setting}**: `{chosen.stem}` "
            f"(`{' '.join(chosen.method_overrides()) or 'defaults'}`), {points[chosen]:.2f}% "
            f"on `{HELD_OUT}` against zero-shot {zs:.2f}%: {why} of {len(points)} points"
            + (f"; next `{runner.stem}` {points[runner]:.2f}%." if runner else ".")
        )
    return lines


def held_out_lines(out: Path, chosen: dict[str, Point]) -> list[str]:
    """The chosen points on the held-out suite: against zero-shot, TTL, the matched single
    rank and (online) the update periods, with the cost of each."""
    extra = out / HELD_OUT
    lines = [
        "| setting | variant | accuracy % [95% CI] | vs zero-shot | ms/sample | fwd | bwd | "
        "peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setting, p in chosen.items():
        variants = [(p.stem, extra / f"{p.stem}.json")]
        variants.append((f"{p.stem} ranks=[28]", extra / f"{p.stem}_single.json"))
        for n in PERIODS if setting != "episodic" else ():
            q = Point(setting, p.towers, p.signal, p.lr, (f"method.adapt_every={n}",))
            variants.append((f"{p.stem} adapt_every={n}", extra / f"{q.stem}.json"))
        for label, path in variants:
            if not path.exists():
                continue
            rec = _load(path)
            zs = "zeroshot_continual" if setting == "continual" else "zeroshot"
            vs = _interval(path, extra / f"{zs}.json")[0]
            lines.append(f"| {setting} | `{label}` | {_ci(rec)} | {vs} | {cost(rec)} |")
    for name in ("zeroshot", "lora"):
        rec = _load(extra / f"{name}.json")
        lines.append(f"| reference | `{name}` | {_ci(rec)} | | {cost(rec)} |")
    return lines


#: The verdict's comparisons (each setting's variant against zero-shot and TTL on its home
#: suite) and the seed article's question (multi minus matched single rank, per setting)
#: are read at Bonferroni-adjusted confidence over their family.
VERDICT_CONFIDENCE = 1 - 0.05 / (2 * len(HOME))
RANKS_CONFIDENCE = 1 - 0.05 / len(HOME)


def eval_table(out: Path, chosen: Point) -> list[str]:
    """The setting's chosen variant on each evaluation suite: accuracy, paired differences
    against zero-shot, TTL and TENT on the same streams (95%), and its cost."""
    lines = [
        "| suite | accuracy % [95% CI] | vs zero-shot | vs TTL (`lora`) | vs TENT | ms/sample "
        "| fwd | bwd | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    setting = chosen.setting
    for suite in EVAL[setting]:
        path = eval_path(out, chosen, suite)
        if not path.exists():
            continue
        base = ROOT / "results" / suite
        deltas = [
            _interval(path, base / f"{m}.json")[0] if (base / f"{m}.json").exists() else "-"
            for m in ("zeroshot", "lora", "tent")
        ]
        rec = _load(path)
        lines.append(f"| `{suite}` | {_ci(rec)} | " + " | ".join(deltas) + f" | {cost(rec)} |")
    single = eval_path(out, chosen, HOME[setting], True)
    if single.exists():
        rec = _load(single)
        lines.append(
            f"| `{HOME[setting]}` ranks=[28] | {_ci(rec)} | "
            + _interval(single, ROOT / "results" / HOME[setting] / "zeroshot.json")[0]
            + f" | | | {cost(rec)} |"
        )
    return lines


def verdict(out: Path, chosen: dict[str, Point]) -> list[str]:
    """Per setting: multi minus matched single rank (the seed's first question), and whether
    the variant beats zero-shot and TTL on its home suite (Bonferroni over the family)."""
    lines = [
        f"| setting | chosen on `{HELD_OUT}` | multi - single rank (95%) | "
        f"multi - single ({100 * RANKS_CONFIDENCE:.1f}%) | vs zero-shot "
        f"({100 * VERDICT_CONFIDENCE:.2f}%) | vs TTL ({100 * VERDICT_CONFIDENCE:.2f}%) |",
        "|---|---|---|---|---|---|",
    ]
    presets = []
    for setting, p in chosen.items():
        home = ROOT / "results" / HOME[setting]
        multi, single = (
            eval_path(out, p, HOME[setting]),
            eval_path(out, p, HOME[setting], True),
        )
        if not (multi.exists() and single.exists()):
            continue
        ranks95 = _interval(multi, single)[0]
        ranks_adj = _interval(multi, single, RANKS_CONFIDENCE)[0]
        vs_zs, beats_zs = _interval(multi, home / "zeroshot.json", VERDICT_CONFIDENCE)
        vs_ttl, beats_ttl = _interval(multi, home / "lora.json", VERDICT_CONFIDENCE)
        if beats_zs and beats_ttl:
            presets.append(setting)
        lines.append(
            f"| {setting} (`{HOME[setting]}`) | `{' '.join(p.method_overrides()) or 'defaults'}` "
            f"| {ranks95} | {ranks_adj} | {vs_zs} | {vs_ttl} |"
        )
    lines.append("")
    if presets:
        named = [f"{s} (`--method {PRESETS[s]}`)" if s in PRESETS else s for s in presets]
        lines.append(
            "Beats zero-shot and TTL with adjusted intervals above zero, so it is a preset "
            "(`tta-bench ls configs`): " + ", ".join(named) + "."
        )
    else:
        lines.append(
            "No variant beats both zero-shot and TTL with adjusted intervals above zero on "
            "its setting's suite, so none becomes a preset."
        )
    return lines


def report_section(out: Path = DIR) -> list[str]:
    """The section "When does MuRA help?" of ``results/digits-c/REPORT.md``."""
    if not (out / HELD_OUT).is_dir():
        return []
    chosen = chosen_points(out)
    lines = [
        "## When does MuRA help?",
        "",
        f"MuRA's variants (options of the one method) tuned on the held-out `{HELD_OUT}` "
        "only, in three settings: per-sample episodes (MuRA's default), online within each "
        "shift (components persist from batch to batch, reset at each shift) and continual "
        "(never reset). Grid, choices and update periods: `results/mura-variants/README.md` "
        "(`python benchmarks/mura_variants.py`). Differences in points, paired over the "
        "same streams (batch block bootstrap where both runs have per-sample files, else "
        "the paired t over the 3 seeds).",
        "",
        *verdict(out, chosen),
        "",
    ]
    for setting, p in chosen.items():
        lines += [
            f"### {setting}: `--method mura {' '.join(p.method_overrides())}`".rstrip(),
            "",
            *eval_table(out, p),
            "",
        ]
    lines.append(
        "Cost columns: ms per image on this machine's CPU, forward and backward passes per "
        "image in image-tower equivalents (as the harness counts them), peak memory."
    )
    return lines


def readme(out: Path) -> str:
    grid = load_grid(out)
    chosen = {s: choose(pts) for s, pts in grid.items() if pts}
    lines = [
        "# When does MuRA help? Variants tuned on the held-out `digits-c-extra`",
        "",
        "Written by `python benchmarks/mura_variants.py --part report` from the results "
        "files in this folder (its docstring: the settings, the signals, the choice rule). "
        f"`{HELD_OUT}/` holds the grid (3 seeds each); `digits-c/`, `digits-c-continual/`, "
        "`digits-c-correlated/`, `digits-open/` the chosen variants' evaluation runs (a "
        "chosen variant equal to MuRA's defaults is the committed `results/<suite>/mura.json`).",
        "",
    ]
    for setting, points in grid.items():
        if points:
            lines += [f"## Grid: {setting}", "", *grid_table(out, setting, points), ""]
    lines += [
        "## The choices, their matched single rank and update periods (held out)",
        "",
        *choice_lines(out, grid),
        "",
        *held_out_lines(out, chosen),
        "",
        *report_section(out)[2:],
    ]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("grid", "eval", "report", "all"), default="all")
    parser.add_argument("--dir", type=Path, default=DIR)
    args = parser.parse_args(argv)
    if args.part in ("grid", "all"):
        run_grid(args.dir)
    if args.part in ("eval", "all"):
        run_eval(args.dir)
    if args.part in ("report", "all"):
        (args.dir / "README.md").write_text(readme(args.dir), encoding="utf-8")
        print((args.dir / "README.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
