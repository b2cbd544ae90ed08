"""Plot the drafter's tau learning curve (data/drafter-train/eval.jsonl) and loss (loss.jsonl) to a PNG.

Usage: python scripts/drafter_plot.py [data/drafter-train] [docs/drafter_curve.png]; prints a markdown table.
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

run = Path(sys.argv[1] if len(sys.argv) > 1 else "data/drafter-train")
png = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/drafter_curve.png")
rows = [json.loads(line) for line in open(run / "eval.jsonl")]
base = [e for e in rows if "baseline" in e]  # the shipped drafter, measured on the same prompts
ev = [e for e in rows if "baseline" not in e]
loss = [json.loads(line) for line in open(run / "loss.jsonl")]
fig, ax = plt.subplots(1, 3, figsize=(15, 4))
h = [e["train_h"] for e in ev]
ax[0].plot(h, [e["chain"] for e in ev], "o-", label="chain (B-1 deep)")
ax[0].plot(h, [e["tree32"] for e in ev], "s-", label="32-node tree")
for b in base[-1:]:
    ax[0].axhline(b["tree32"], color="gray", ls="--", label="shipped before: 32-node tree")
    ax[0].axhline(b["chain"], color="gray", ls=":", label="shipped before: chain")
ax[0].set_xlabel("training hours (optimiser steps only)")
ax[0].set_ylabel("tau (held-out prompts, greedy)")
ax[0].grid(alpha=0.3)
ax[0].legend()
# Against what training has read: blocks seen, each point labelled with the data loaded then.
blk = [e["blocks"] / 1e6 for e in ev]
ax[1].plot(blk, [e["chain"] for e in ev], "o-", label="chain")
ax[1].plot(blk, [e["tree32"] for e in ev], "s-", label="32-node tree")
for x, e in zip(blk, ev):
    ax[1].annotate(f"{e['data_tokens'] / 1e6:.2f} M", (x, e["tree32"]), fontsize=7, xytext=(2, 4),
                   textcoords="offset points")
ax[1].set_xlabel("blocks trained on (millions); labels: response tokens of data loaded")
ax[1].set_ylabel("tau (held-out prompts, greedy)")
ax[1].grid(alpha=0.3)
ax[1].legend()
ax[2].plot([r["train_h"] for r in loss], [r["loss"] for r in loss], label="loss")
ax[2].plot([r["train_h"] for r in loss], [r["est_tau"] for r in loss], label="teacher-forced chain tau estimate (training batches)")
val = [r for r in loss if "val_tau_est" in r]  # held-out sequences (1 in 64 of each shard, never trained on)
if val:
    ax[2].plot([r["train_h"] for r in val], [r["val_tau_est"] for r in val], "o-",
               label="the same on held-out sequences")
ax[2].set_xlabel("training hours")
ax[2].grid(alpha=0.3)
ax[2].legend()
fig.tight_layout()
png.parent.mkdir(parents=True, exist_ok=True)
fig.savefig(png, dpi=110)
print("| step | train h | blocks seen | data tokens | held-out TF tau est. | chain tau | tree32 tau |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for b in base:
    print(f"| shipped ({b['baseline']}) | | | | | {b['chain']:.3f} | {b['tree32']:.3f} |")
for e in ev:
    tf = f"{e['val_tau_est']:.3f}" if "val_tau_est" in e else ""
    print(f"| {e['step']} | {e['train_h']:.2f} | {e['blocks']} | {e['data_tokens']} | {tf} | {e['chain']:.3f} "
          f"| {e['tree32']:.3f} |")
