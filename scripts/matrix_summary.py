"""Condense a controller matrix (scripts/controller_matrix.sh) into one summary.json: per run
(DTYPE-quiet, DTYPE-busy) the bench summary, the controller's gate state and, per dataset,
bastion over the best fixed mode (chain, tree-N) and over AR, from the medians of the passes and
paired per pass. Prints one line per cell.
Usage: python scripts/matrix_summary.py MATRIX_DIR OUT_JSON "MACHINE" "GATE"
"""
import json
import sys
from pathlib import Path

src, out, machine, gate = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
summary = {}
for run in ("float32-quiet", "float32-busy", "bfloat16-quiet", "bfloat16-busy"):
    path = src / run / "results.json"
    if not path.exists():
        continue
    res = json.loads(path.read_text())
    cells = {(r["dataset"], r["mode"]): r for r in res["summary"]}
    ctl = res["controllers"].get("bastion", {})
    over = {}
    for ds in sorted({d for d, _ in cells}):
        fixed = [m for d, m in cells if d == ds and (m == "chain" or m.startswith("tree-"))]
        best = max(fixed, key=lambda m: cells[(ds, m)]["speedup"])
        b, f = cells[(ds, "bastion")], cells[(ds, best)]
        over[ds] = {"best_fixed": best, "ratio": b["speedup"] / f["speedup"], "bastion_over_ar": b["speedup"],
                    "per_pass": [x / y for x, y in zip(b.get("speedups", []), f.get("speedups", []))],
                    "bastion_tau": b["tau"], "best_tau": f["tau"], "mismatches": b["mismatches"]}
        print(f"{run:15s} {ds:9s} {over[ds]['ratio']:.3f} of {best}, {b['speedup']:.2f}x AR, per pass "
              + " / ".join(f"{x:.3f}" for x in over[ds]["per_pass"]) + f", mismatches {b['mismatches']}")
    summary[run] = {"machine": machine, "gate": gate, "summary": res["summary"],
                    "controller": {k: ctl.get(k) for k in ("steps", "gate", "t_draft_s", "t_other_s", "refits",
                                                          "rescales", "online_mape")},
                    "bastion_over_best_fixed": over}
out.write_text(json.dumps(summary, indent=1))
