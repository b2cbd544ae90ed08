"""Benchmark figures from per-prompt records: the summary list, the Markdown table, the plot.

Definitions (docs/method.md, section 1):
    TPOT      sum of decode seconds / sum of decode tokens over a dataset's prompts
              (prefill and each turn's first token excluded), so long answers weigh more
    speedup   TPOT of the faster AR baseline (ar-hf or ar) / the mode's TPOT, same prompts
    tau       committed tokens per verification step (bonus included) over the dataset
    mismatches  at temperature 0, prompts whose output differs from the reference mode
              (ar; ar-hf when ar was not run); None when sampling or no reference ran
With several passes over the prompts (records' `repeat`), TPOT, tokens/s and the speedup are
medians over passes of each pass's figure (the speedup paired per pass: the baseline's TPOT in
that pass over the mode's), so a slow phase of the machine in one pass moves them less; tau,
tree sizes, TTFT and mismatches pool every pass.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.modes import BASELINES

#: Keys of every summary entry (scripts depend on the first eight).
SUMMARY_KEYS = ("dataset", "mode", "speedup", "tau", "tokens_per_s", "tpot_s", "mean_tree_size", "mismatches",
                "prompts", "decode_tokens", "ttft_s", "e2e_s", "baseline", "reference", "repeats", "speedups")


def reference_mode(modes: list[str]) -> str | None:
    """The mode every output is compared with at temperature 0."""
    for m in ("ar", "ar-hf"):
        if m in modes:
            return m
    return None


def _agg(recs: list[dict]) -> dict:
    dsum = sum(r["decode_s"] for r in recs)
    dtok = sum(r["decode_tokens"] for r in recs)
    steps = sum(r["steps"] for r in recs)
    tree = None if any(r["tree_tokens"] is None for r in recs) else sum(r["tree_tokens"] for r in recs)
    n = len(recs)
    return {
        "tpot_s": dsum / dtok if dtok else None,
        "tokens_per_s": dtok / dsum if dsum > 0 else None,
        "tau": sum(r["accepted"] for r in recs) / steps if steps else None,
        "mean_tree_size": tree / steps if steps and tree is not None else None,
        "prompts": n,
        "decode_tokens": dtok,
        "ttft_s": sum(r["ttft_s"] for r in recs) / n if n else None,
        "e2e_s": sum(r["e2e_s"] for r in recs) / n if n else None,
    }


def mark_exactness(records: list[dict], modes: list[str], greedy: bool) -> None:
    """Set each record's `matches_reference` (True/False, None when not comparable), in place."""
    ref = reference_mode(modes) if greedy else None
    by_key = {(r["dataset"], r["prompt_id"], r.get("repeat", 0)): r for r in records if r["mode"] == ref}
    for r in records:
        other = by_key.get((r["dataset"], r["prompt_id"], r.get("repeat", 0))) if ref else None
        r["matches_reference"] = None if other is None else (r["token_ids"] == other["token_ids"])


def summarize(records: list[dict], datasets: list[str], modes: list[str], greedy: bool) -> list[dict]:
    """One entry per (dataset, mode) with records; keys SUMMARY_KEYS. Marks exactness on the records.

    repeats: passes found; speedups: the speedup of each pass (one entry without repeats)."""
    mark_exactness(records, modes, greedy)
    ref = reference_mode(modes) if greedy else None
    out = []
    for ds in datasets:
        groups = {m: [r for r in records if r["dataset"] == ds and r["mode"] == m] for m in modes}
        passes = sorted({r.get("repeat", 0) for rs in groups.values() for r in rs})
        per = {p: {m: _agg([r for r in rs if r.get("repeat", 0) == p]) for m, rs in groups.items()} for p in passes}
        aggs = {m: _agg(rs) for m, rs in groups.items() if rs}
        base = [(aggs[b]["tpot_s"], b) for b in BASELINES if b in aggs and aggs[b]["tpot_s"]]
        base_tpot, base_mode = min(base) if base else (None, None)
        for m, a in aggs.items():
            compared = [r["matches_reference"] for r in groups[m] if r["matches_reference"] is not None]
            mism = sum(1 for same in compared if not same) if compared else None
            speedups, tpots, rates = [], [], []
            for p in passes:
                got = per[p][m]
                if not got["prompts"] or not got["tpot_s"]:
                    continue
                tpots.append(got["tpot_s"])
                rates.append(got["tokens_per_s"])
                b = per[p].get(base_mode) if base_mode else None
                if b and b["tpot_s"]:
                    speedups.append(b["tpot_s"] / got["tpot_s"])
            several = len(tpots) > 1
            out.append({
                "dataset": ds, "mode": m,
                "speedup": statistics.median(speedups) if several and speedups else
                (base_tpot / a["tpot_s"] if base_tpot and a["tpot_s"] else None),
                "tau": a["tau"],
                "tokens_per_s": statistics.median(rates) if several else a["tokens_per_s"],
                "tpot_s": statistics.median(tpots) if several else a["tpot_s"],
                "mean_tree_size": a["mean_tree_size"], "mismatches": mism,
                "prompts": len({r["prompt_id"] for r in groups[m]}), "decode_tokens": a["decode_tokens"],
                "ttft_s": a["ttft_s"], "e2e_s": a["e2e_s"], "baseline": base_mode, "reference": ref,
                "repeats": len(tpots), "speedups": speedups,
            })
    return out


def running_speedups(records: list[dict], modes: list[str]) -> dict[str, float]:
    """Speedup per mode over every record so far (all datasets pooled), for the progress bar."""
    aggs = {m: _agg([r for r in records if r["mode"] == m]) for m in modes}
    base = [aggs[b]["tpot_s"] for b in BASELINES if b in aggs and aggs[b]["tpot_s"]]
    if not base:
        return {}
    return {m: min(base) / a["tpot_s"] for m, a in aggs.items() if a["tpot_s"]}


def _fmt(x, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def markdown_table(summary: list[dict], datasets: list[str], modes: list[str]) -> str:
    """The paper's layout: rows = modes, columns = datasets (+ mean), cells = 'speedup / tau'."""
    cell = {(s["dataset"], s["mode"]): s for s in summary}
    head = "| mode | " + " | ".join(datasets) + " | mean |"
    lines = [head, "|---|" + "---|" * (len(datasets) + 1)]
    for m in modes:
        row, sp, ta = [], [], []
        for ds in datasets:
            s = cell.get((ds, m))
            if s is None:
                row.append("n/a")
                continue
            row.append(f"{_fmt(s['speedup'], '.2f', 'x')} / {_fmt(s['tau'], '.2f')}")
            if s["speedup"] is not None:
                sp.append(s["speedup"])
            if s["tau"] is not None:
                ta.append(s["tau"])
        mean = f"{_fmt(sum(sp) / len(sp) if sp else None, '.2f', 'x')} / {_fmt(sum(ta) / len(ta) if ta else None, '.2f')}"
        lines.append(f"| {m} | " + " | ".join(row) + f" | {mean} |")
    return "\n".join(lines)


def detail_table(summary: list[dict]) -> str:
    """Every summary figure, one row per (dataset, mode)."""
    lines = ["| dataset | mode | prompts | tokens/s | TPOT ms | TTFT ms | speedup | tau | mean tree | mismatches |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(
            f"| {s['dataset']} | {s['mode']} | {s['prompts']} | {_fmt(s['tokens_per_s'], '.1f')} | "
            f"{_fmt(s['tpot_s'] and s['tpot_s'] * 1e3, '.1f')} | {_fmt(s['ttft_s'] and s['ttft_s'] * 1e3, '.0f')} | "
            f"{_fmt(s['speedup'], '.2f', 'x')} | {_fmt(s['tau'], '.2f')} | {_fmt(s['mean_tree_size'], '.1f')} | "
            f"{_fmt(s['mismatches'], 'd')} |")
    return "\n".join(lines)


def markdown_report(results: dict) -> str:
    """The whole report.md: settings line, main table, details, environment, skipped items."""
    st, env = results["settings"], results["environment"]
    ds, modes = st["datasets"], st["modes"]
    hw = env.get("gpu") or env.get("cpu")
    lines = [
        "# bastion bench",
        "",
        f"Target `{st['target']}`, drafter `{env.get('drafter')}`, {st['dtype']} on {st['device']} ({hw}, "
        f"{env.get('threads')} threads); max {st['max_new_tokens']} new tokens, temperature {st['temperature']}, "
        f"seed {st['seed']}{', multi-turn' if st.get('multi_turn') else ''}. Status: {results.get('status')}.",
        "",
        f"Command: `{env.get('command')}`",
        "",
        "Cells: speedup over the faster of ar-hf and ar (decode TPOT) / tau (tokens committed per step)"
        + (f"; times and speedups are medians of {st['repeats']} passes." if st.get("repeats", 1) > 1 else "."),
        "",
        markdown_table(results["summary"], ds, modes),
        "",
        "## Details",
        "",
        detail_table(results["summary"]),
    ]
    skipped = results.get("skipped") or {}
    for kind in ("modes", "datasets", "prompts"):
        items = skipped.get(kind) or {}
        if items:
            lines += ["", f"Skipped {kind}:", ""] + [f"- {k}: {v}" for k, v in items.items()]
    bad = [s for s in results["summary"] if s["mismatches"]]
    if bad:
        lines += ["", "Exactness: outputs differ from the reference for "
                  + ", ".join(f"{s['mode']} on {s['dataset']} ({s['mismatches']})" for s in bad) + "."]
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], datasets: list[str], modes: list[str], path: Path | str) -> None:
    """PNG with two panels: speedup per dataset per mode (grouped bars); tau versus mean tree size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cell = {(s["dataset"], s["mode"]): s for s in summary}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.8))
    width = 0.8 / max(1, len(modes))
    colors = plt.get_cmap("tab20").colors  # one distinct colour per mode up to 20 modes
    for i, m in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(datasets))]
        ys = [(cell.get((d, m)) or {}).get("speedup") or 0.0 for d in datasets]
        ax1.bar(xs, ys, width, label=m, color=colors[i % len(colors)])
    ax1.axhline(1.0, color="black", lw=0.8, ls="--")
    ax1.set_xticks(range(len(datasets)), datasets)
    ax1.set_ylabel("speedup over AR (decode TPOT)")
    ax1.set_title("Speedup per dataset")
    ax1.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    markers = "osD^v<>phX*"
    for j, d in enumerate(datasets):
        pts = [(cell[(d, m)]["mean_tree_size"], cell[(d, m)]["tau"], m) for m in modes
               if (d, m) in cell and cell[(d, m)]["mean_tree_size"] and cell[(d, m)]["tau"]]
        if not pts:
            continue
        ax2.scatter([p[0] for p in pts], [p[1] for p in pts], marker=markers[j % len(markers)], label=d)
        for x, y, m in pts:
            ax2.annotate(m, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax2.set_xscale("log")
    ax2.set_xlabel("mean tree size (nodes verified per step)")
    ax2.set_ylabel("tau (tokens committed per step)")
    ax2.set_title("Accepted length versus tree size")
    if ax2.collections:
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
