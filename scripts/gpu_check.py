"""Device check for the GPU verification path: one command, JSON + a short Markdown table.

    python scripts/gpu_check.py                        # one H200: Qwen3-8B shapes, bfloat16, < 8 min
    python scripts/gpu_check.py --device cpu --tiny    # tiny shapes on CPU, < 60 s (run by the tests)
    python scripts/gpu_check.py --device cpu --overhead-only   # per-step overhead at Qwen3-8B shapes

It builds a Qwen3-8B-shaped target and a z-lab-shaped DFlash drafter with random weights
directly on the device (no download), then (writing gpu_check.json after every section):
  0. decodes greedily one token per forward and verifies the same tokens as one tree, in float32
     and the run's dtype: first divergence, its logit margin, device syncs per step;
  1. checks every available attention backend against sdpa inside the model (logits of one
     tree verification) and times the attention call alone;
  2. times tree verification for s in {1, 16, ..., 1024} at c in {512, 2048} per backend;
  3. runs the controller's calibration (sdpa path) and reports its fit error, and the
     measured ceilings next to the datasheet (H200: 989 TFLOP/s bf16, 4.8 TB/s);
  4. times drafter forwards (one block of 16 over c context tokens);
  5. measures the per-step overhead outside the model forwards at 64 tree nodes, on the
     device path the engine uses (the host path it replaced is in docs/gpu.md).
Random weights make acceptance meaningless: it reports latencies, never speedups.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.calibration import CalibrationGrid, calibrate  # noqa: E402
from controller.ceilings import datasheet_ceilings, device_name  # noqa: E402
from drafting.proposal import Marginals  # noqa: E402
from drafting.dflash import DFlashDrafter, DFlashModel, DFlashSpec  # noqa: E402
from engine import attention as attn  # noqa: E402
from engine.timing import verify_timer  # noqa: E402
from engine.tree import FixedBudgetPolicy, Tree, build_tree  # noqa: E402
from engine.greedy_device import accept_greedy_device  # noqa: E402
from engine.tree_buffers import TreeBufferPool  # noqa: E402
from engine.forward import Segment, TargetForward, target_forward_for  # noqa: E402
from engine.kv_cache import KVPool  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
            tie_word_embeddings=False)
S_FULL, C_FULL = (1, 16, 32, 64, 128, 256, 512, 1024), (512, 2048, 8192, 32768)
S_TINY, C_TINY = (1, 16, 64), (64, 256)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_models(shape: dict, device: torch.device, dtype: torch.dtype, draft_layers: int, seed: int = 0):
    """Random Qwen3 target and DFlash drafter (z-lab layout) built directly on `device`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**shape)
    with torch.device(device):
        target = Qwen3ForCausalLM(cfg).to(dtype).eval().requires_grad_(False)
    L = shape["num_hidden_layers"]
    ids = [int(round(1 + i * (L - 4) / (draft_layers - 1))) for i in range(draft_layers)] if L >= 5 else [1, L - 1]
    dspec = DFlashSpec.from_dict(dict(shape, num_hidden_layers=draft_layers, block_size=16, num_target_layers=L,
                                      dflash_config={"mask_token_id": shape["vocab_size"] - 1,
                                                     "target_layer_ids": ids}))
    with torch.device(device):
        dmodel = DFlashModel(dspec, target_hidden=shape["hidden_size"]).to(dtype).eval().requires_grad_(False)
    drafter = DFlashDrafter(dmodel, target.get_input_embeddings(), target.get_output_embeddings())
    return target, drafter


def random_tree(n: int, vocab: int, gen: torch.Generator) -> Tree:
    par = attn.random_tree_parents(n, 15, gen)
    depths = torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        depths[i] = depths[par[i]] + 1
    return Tree(tokens=torch.randint(0, vocab, (n,), generator=gen), parents=par, depths=depths, a_hat=1.0,
                log_scores=torch.zeros(n))


def tree_forward(fwd: TargetForward, pool, tree: Tree, prefix_len: int, backend: str, slot: int = 0):
    """One verification forward through the engine's own forward, in `slot`: logits [n, V]."""
    dev = fwd.device
    seg = Segment(slot, prefix_len, tree.size, attn.TreeAttention.from_tree(tree, prefix_len, dev) if tree.size > 1 else None)
    return fwd(pool, tree.tokens.to(dev), tree.position_ids(prefix_len)[0].to(dev), [seg], backend=backend)[0]


def prefill(fwd: TargetForward, c: int, gen: torch.Generator, capacity: int):
    """A one-slot KV pool holding c random prompt tokens."""
    pool = fwd.new_pool(1, capacity)
    if c:
        ids = torch.randint(0, fwd.config.vocab_size, (c,), generator=gen).to(fwd.device)
        fwd(pool, ids, torch.arange(c, device=fwd.device), [Segment(0, 0, c)], last_only=True)
    return pool


@torch.inference_mode()
def check_backends(model, backends: list[str], device, dtype, n: int, c: int) -> dict:
    """Per backend: max |logit difference| to sdpa and argmax agreement over one n-node tree."""
    gen = torch.Generator().manual_seed(1)
    tree = random_tree(n, model.config.vocab_size, gen)
    fwd = target_forward_for(model)
    pool = prefill(fwd, c, gen, c + n)
    out = {}
    ref = None
    for b in ["sdpa"] + [x for x in backends if x != "sdpa"]:
        try:
            logits = tree_forward(fwd, pool, tree, c, b).float()
        except Exception as e:  # report, do not abort the whole check
            out[b] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
            continue
        if ref is None:
            ref = logits
        diff = float((logits - ref).abs().max())
        agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        tol = 1e-3 if dtype == torch.float32 else 0.25
        out[b] = {"ok": diff <= tol or agree == 1.0, "max_abs_logit_diff": diff, "argmax_agreement": agree}
    # Attention alone, Qwen3-8B head shapes, per backend (seconds summed over its points).
    cfg = model.config
    times = attn.benchmark_backends(device, dtype, n_q=cfg.num_attention_heads, n_kv=cfg.num_key_value_heads,
                                    head_dim=cfg.head_dim, backends=backends,
                                    points=((16, 64),) if device.type == "cpu" else None, repeats=3)
    for b, t in times.items():
        out.setdefault(b, {})["attention_only_s"] = t
    return out


@torch.inference_mode()
def time_verification(model, backends: list[str], device, s_values, c_values, warmup: int, repeats: int,
                      budget_s: float) -> list[dict]:
    """Median seconds of one tree verification per (backend, c, s); stops a backend when over budget."""
    gen = torch.Generator().manual_seed(2)
    rows = []
    start = time.perf_counter()
    fwd = target_forward_for(model)
    for b in backends:
        for c in c_values:
            pool = prefill(fwd, c, gen, c + max(s_values))
            for s in s_values:
                if time.perf_counter() - start > budget_s:
                    rows.append({"backend": b, "c": c, "s": s, "seconds": None, "skipped": "time budget"})
                    continue
                tree = random_tree(s, model.config.vocab_size, gen)

                def one():
                    tree_forward(fwd, pool, tree, c, b)

                try:
                    rows.append({"backend": b, "c": c, "s": s, "seconds": timed(one, device, warmup, repeats)})
                except Exception as e:
                    rows.append({"backend": b, "c": c, "s": s, "seconds": None, "error": str(e)[:200]})
    return rows


@torch.inference_mode()
def time_drafter(drafter: DFlashDrafter, device, c_values, warmup: int, repeats: int) -> list[dict]:
    """Seconds of one drafter pass (block of B over c cached context tokens), top-K extraction included."""
    rows = []
    feat_dim = drafter.model.fc.in_features
    dt = drafter.model.fc.weight.dtype
    for c in c_values:
        state = drafter.new_state()
        drafter.extend(state, [0] * c, torch.randn(c, feat_dim, device=device, dtype=dt))
        drafter.propose(state, 1, drafter.max_depth)  # consumes the context once
        sec = timed(lambda: drafter.propose(state, 1, drafter.max_depth), device, warmup, repeats)
        rows.append({"c": c, "block_size": drafter.block_size, "seconds": sec})
    return rows


def run_calibration(model, dtype, device, s_values, c_values, budget_s: float | None) -> dict:
    grid = CalibrationGrid(tuple(s for s in s_values if s <= 512), tuple(c_values))
    res = calibrate(verify_timer(model), model.config, dtype, grid, model_name="qwen3-8b-shape-random",
                    device=device, attn_backend="sdpa", use_cache=False, progress=False, time_budget_s=budget_s,
                    warmup=2, repeats=3)
    sheet = datasheet_ceilings(device_name(device))
    out = {
        "fit_mape": res.fit_mape, "heldout_mape": res.heldout_mape, "params": res.params.to_dict(),
        "points": len(res.points), "elapsed_s": res.elapsed_s,
        "measured": {"flops_per_s": res.ceilings.flops_per_s, "bytes_per_s": res.ceilings.bytes_per_s},
        "datasheet": None if sheet is None else {"flops_per_s": sheet.flops_per_s, "bytes_per_s": sheet.bytes_per_s},
    }
    if sheet is not None:
        out["fraction_of_datasheet"] = {"flops": res.ceilings.flops_per_s / sheet.flops_per_s,
                                        "bandwidth": res.ceilings.bytes_per_s / sheet.bytes_per_s}
    return out


@torch.inference_mode()
def step_overhead(shape: dict, device: torch.device, dtype: torch.dtype, n: int = 64, c: int = 512,
                  repeats: int = 20) -> dict:
    """Median seconds of each per-step piece outside the model forwards, at n tree nodes over c tokens.

    tree_build: best-first over [15, 128] marginals. compact: KV gather of a non-prefix path in
    every layer from a host list. Device path (the engine's): load_device: tree into the per-bucket
    buffers (one copy), ancestors and additive mask on the device; accept_device: accept_greedy_device
    (one host read); compact_device: the gather with the device index. argmax: the argmax over
    [n, V] alone, part of the acceptance. walk_device: the acceptance over a stand-in with a
    vocabulary of only the tokens involved (same path), i.e. without the big argmax.
    mask_device: TreeAttention.from_tree + visible (for reference).
    """
    gen = torch.Generator().manual_seed(3)
    V, L = shape["vocab_size"], shape["num_hidden_layers"]
    lp = torch.log_softmax(8 * torch.randn(15, V, generator=gen), -1)  # peaked, like a trained drafter
    vals, idx = torch.topk(lp, 128, dim=-1)
    marg = Marginals(token_ids=idx, logprobs=vals)
    policy = FixedBudgetPolicy(n)
    tree = build_tree(1, marg, policy, 15)
    logits = torch.randn(tree.size, V, generator=gen).to(device, dtype)
    # A target whose argmax accepts the path to the deepest, latest node: not a prefix of insertion
    # order, so compaction gathers in every layer.
    chain = [max(range(tree.size), key=lambda i: (int(tree.depths[i]), i))]
    while chain[-1] > 0:
        chain.append(int(tree.parents[chain[-1]]))
    for parent, child in zip(chain[::-1], chain[::-1][1:]):
        logits[parent, int(tree.tokens[child])] = 100.0
    kv = KVPool(L, 1, shape["num_key_value_heads"], c + tree.size, shape["head_dim"], dtype, device)
    kv.keys.normal_()
    kv.values.normal_()
    path = chain[::-1]  # what the logits above make the target accept
    pool = TreeBufferPool(device)
    dtree = pool.load(tree, c)
    acc = accept_greedy_device(dtree, logits)  # also builds dtree's ancestors, as verification does
    if acc.path != path:
        raise AssertionError(f"device acceptance {acc.path} differs from the reference {path}")

    # The same decision over a vocabulary of only the tokens involved: times the walk without the big argmax.
    targ = torch.argmax(logits, dim=-1).tolist()
    vocab_small = sorted(set(tree.tokens.tolist()) | set(targ))
    rank = {t: i for i, t in enumerate(vocab_small)}
    small_tree = Tree(tokens=torch.tensor([rank[t] for t in tree.tokens.tolist()]), parents=tree.parents,
                      depths=tree.depths, a_hat=tree.a_hat, log_scores=tree.log_scores)
    small_logits = torch.zeros(tree.size, len(vocab_small), dtype=dtype, device=device)
    small_logits[torch.arange(tree.size), torch.tensor([rank[t] for t in targ])] = 1
    small_dtree = TreeBufferPool(device).load(small_tree, c)
    if accept_greedy_device(small_dtree, small_logits).path != path:
        raise AssertionError("the small-vocabulary stand-in changed the accepted path")

    def compact(index=None):
        kv.compact(0, c, path, index)  # the rows it moves are garbage after the first call: same work
        sync(device)

    def load_device():
        dt = pool.load(tree, c)
        dt.additive_mask(dtype)  # builds the ancestors too
        sync(device)

    parts = {
        "tree_build": lambda: build_tree(1, marg, policy, 15),
        "mask_device": lambda: attn.TreeAttention.from_tree(tree, c, device).visible(),
        "compact": compact,
        "load_device": load_device,
        "argmax": lambda: torch.argmax(logits, dim=-1),
        "accept_device": lambda: accept_greedy_device(dtree, logits),
        "compact_device": lambda: compact(acc.index),
        "walk_device": lambda: accept_greedy_device(small_dtree, small_logits),
    }
    out = {k: timed(f, device, 2, repeats) for k, f in parts.items()}
    out["total_device_path"] = out["tree_build"] + out["load_device"] + out["accept_device"] + out["compact_device"]
    out.update(n=tree.size, c=c, accepted_path=len(path), vocab=V, layers=L)
    return out


@torch.inference_mode()
def tree_vs_ar(shape: dict, device: torch.device, dtypes: list[torch.dtype], prompt: int, steps: int) -> list[dict]:
    """Greedy decoding one token per forward against one tree verification of the same tokens.

    For each dtype: a random target (the given shapes) decodes `steps` tokens after a random
    prompt, one forward per token (AR). Then a fresh slot verifies a tree holding that AR path
    with a decoy sibling at every depth (so node order is not the path order), and the tree's
    argmax along the path is compared with AR's tokens. Reports the first divergence and AR's
    top-1 minus top-2 logit margin there (a near-tie explains a bfloat16 flip), the smallest
    margin over the path, and the device syncs of one AR step (torch.cuda sync debug mode).
    """
    import warnings

    rows = []
    for dtype in dtypes:
        target, _ = build_models(shape, device, dtype, draft_layers=2)
        fwd = target_forward_for(target)
        gen = torch.Generator().manual_seed(4)
        V = shape["vocab_size"]
        ids = torch.randint(0, V, (prompt,), generator=gen).to(device)
        pool = fwd.new_pool(2, prompt + 2 * steps + 2)
        logits, _ = fwd(pool, ids, torch.arange(prompt, device=device), [Segment(0, 0, prompt)], last_only=True)
        ar, margins, syncs = [], [], None
        for i in range(steps):
            top = torch.topk(logits[-1].float(), 2)
            margins.append(float(top.values[0] - top.values[1]))
            tok = int(top.indices[0])
            ar.append(tok)
            step_in = torch.tensor([tok], device=device)
            pos = torch.tensor([prompt + i], device=device)
            if device.type == "cuda" and syncs is None:
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    logits, _ = fwd(pool, step_in, pos, [Segment(0, prompt + i, 1)])
                torch.cuda.set_sync_debug_mode(0)
                syncs = sum("synchroniz" in str(w.message) for w in caught)
            else:
                logits, _ = fwd(pool, step_in, pos, [Segment(0, prompt + i, 1)])
        # The tree: root = the prompt's first AR token; path nodes carry ar[1:], each with a decoy sibling.
        tokens, parents, depths = [ar[0]], [-1], [0]
        node = 0
        for d, tok in enumerate(ar[1:], start=1):
            tokens += [(tok + 1) % V, tok]  # the decoy comes first
            parents += [node, node]
            depths += [d, d]
            node = len(tokens) - 1
        tree = Tree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                    a_hat=1.0, log_scores=torch.zeros(len(tokens)))
        fwd(pool, ids, torch.arange(prompt, device=device), [Segment(1, 0, prompt)], last_only=True)
        tl = tree_forward(fwd, pool, tree, prompt, "sdpa", slot=1).float()
        path = [0] + [2 * d for d in range(1, len(ar))]
        got = tl[path].argmax(-1).tolist()  # the target's choice after each path node
        want = ar[1:] + [None]
        first = next((i for i, (g, w) in enumerate(zip(got, want)) if w is not None and g != w), None)
        rows.append({"dtype": str(dtype).removeprefix("torch."), "steps": steps, "tree_nodes": tree.size,
                     "first_divergence": first, "margin_at_divergence": None if first is None else margins[first + 1],
                     "min_margin": min(margins), "syncs_per_ar_step": syncs})
        del target, fwd, pool
    return rows


def markdown(report: dict) -> str:
    lines = [f"# gpu_check: {report['device_name']} ({report['dtype']}, {'tiny' if report['tiny'] else 'Qwen3-8B'} shapes)",
             ""]
    if report.get("backends"):
        lines += ["| backend | agrees with sdpa | max abs logit diff | attention only (ms) |", "|---|---|---|---|"]
        for b, r in report["backends"].items():
            t = r.get("attention_only_s")
            lines.append(f"| {b} | {r.get('ok')} | {r.get('max_abs_logit_diff', float('nan')):.3g} | "
                         f"{'-' if t is None else f'{t * 1e3:.2f}'} |")
        lines.append("")
    if report.get("verification"):
        rows = report["verification"]
        backends = sorted({r["backend"] for r in rows}, key=attn.BACKENDS.index)
        cs = sorted({r["c"] for r in rows})
        ss = sorted({r["s"] for r in rows})
        lines += ["Verification latency (ms), one forward over an s-node tree with c cached tokens:", "",
                  "| s | " + " | ".join(f"{b} c={c}" for b in backends for c in cs) + " |",
                  "|---" * (1 + len(backends) * len(cs)) + "|"]
        look = {(r["backend"], r["c"], r["s"]): r["seconds"] for r in rows}
        for s in ss:
            cells = [look.get((b, c, s)) for b in backends for c in cs]
            lines.append(f"| {s} | " + " | ".join("-" if x is None else f"{x * 1e3:.2f}" for x in cells) + " |")
        lines.append("")
    if report.get("tree_vs_ar"):
        lines += ["Tree verification against one-token decoding (random weights, greedy):", "",
                  "| dtype | tokens | tree nodes | first divergence | margin there | min margin | syncs per AR step |",
                  "|---|---|---|---|---|---|---|"]
        for r in report["tree_vs_ar"]:
            lines.append(f"| {r['dtype']} | {r['steps']} | {r['tree_nodes']} | {r['first_divergence']} | "
                         f"{r['margin_at_divergence']} | {r['min_margin']:.3g} | {r['syncs_per_ar_step']} |")
        lines.append("")
    cal = report.get("calibration")
    if cal:
        m, d = cal["measured"], cal["datasheet"]
        sheet_f = "-" if d is None else f"{d['flops_per_s'] / 1e12:.0f}"
        sheet_b = "-" if d is None else f"{d['bytes_per_s'] / 1e12:.2f}"
        lines += [f"Calibration: fit MAPE {100 * cal['fit_mape']:.1f} %, held-out MAPE {100 * cal['heldout_mape']:.1f} % "
                  f"over {cal['points']} points.", "",
                  "| ceiling | measured | datasheet |", "|---|---|---|",
                  f"| {report['dtype']} matmul (TFLOP/s) | {m['flops_per_s'] / 1e12:.2f} | {sheet_f} |",
                  f"| bandwidth (TB/s) | {m['bytes_per_s'] / 1e12:.3f} | {sheet_b} |",
                  ""]
    if report.get("drafter"):
        lines += ["Drafter pass (ms): " + ", ".join(f"c={r['c']}: {r['seconds'] * 1e3:.2f}" for r in report["drafter"]),
                  ""]
    ov = report.get("overhead")
    if ov:
        dev = ("tree_build", "load_device", "accept_device", "compact_device", "total_device_path")
        lines += [f"Per-step overhead outside forwards at n={ov['n']}, c={ov['c']} (ms):", "",
                  "| path | " + " | ".join(["tree build", "indices + mask", "greedy acceptance", "KV compaction",
                                           "total"]) + " |", "|---" * 6 + "|",
                  "| device | " + " | ".join(f"{ov[k] * 1e3:.3f}" for k in dev) + " |", "",
                  f"argmax over [{ov['n']}, {ov['vocab']}] alone: {ov['argmax'] * 1e3:.3f} ms (in both acceptances); "
                  f"TreeAttention.from_tree + visible: {ov['mask_device'] * 1e3:.3f} ms.",
                  f"Acceptance without the big argmax (same tree and path, {ov['n']}-token vocabulary stand-in): "
                  f"device {ov['walk_device'] * 1e3:.3f} ms; host-list KV gather {ov['compact'] * 1e3:.3f} ms.", ""]
    lines.append(f"Total wall time {report['elapsed_s']:.1f} s. Random weights: latencies only, no speedups.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                    help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and a short grid (CPU smoke run)")
    ap.add_argument("--overhead-only", action="store_true", help="only the per-step overhead, at Qwen3-8B shapes")
    ap.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for verification timing (default 240, tiny 15)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("CUDA is not available here; use --device cpu --tiny")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = TINY if args.tiny else QWEN3_8B
    report: dict = {"device_name": device_name(device), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                    "tiny": args.tiny, "torch": torch.__version__, "python": platform.python_version(),
                    "flash_attn_available": attn.flash_available(device), "shape": shape,
                    "threads": torch.get_num_threads()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every section, so a timeout loses nothing already measured
        report["elapsed_s"] = time.perf_counter() - t_start
        if device.type == "cuda":
            report["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))

    if not args.overhead_only:
        dtypes = [torch.float32] + ([dtype] if dtype != torch.float32 else [])
        report["tree_vs_ar"] = tree_vs_ar(shape, device, dtypes, prompt=16 if args.tiny else 256,
                                          steps=8 if args.tiny else 32)
        save()
        s_values, c_values = (S_TINY, C_TINY) if args.tiny else (S_FULL, C_FULL)
        warmup, repeats = (1, 2) if args.tiny else (2, 5)
        budget = args.budget_s if args.budget_s is not None else (15.0 if args.tiny else 240.0)
        target, drafter = build_models(shape, device, dtype, draft_layers=2 if args.tiny else 5)
        report["build_s"] = time.perf_counter() - t_start
        backends = attn.available_backends(device)
        report["backends"] = check_backends(target, backends, device, dtype, n=32 if args.tiny else 64,
                                            c=c_values[0])
        save()
        report["selected_backend"] = min((b for b, r in report["backends"].items()
                                           if r.get("ok") and r.get("attention_only_s")),
                                          key=lambda b: report["backends"][b]["attention_only_s"], default="sdpa")
        report["verification"] = time_verification(target, backends, device, s_values, c_values, warmup, repeats,
                                                   budget)
        save()
        report["calibration"] = run_calibration(target, dtype, device, s_values, c_values,
                                                5.0 if args.tiny else 120.0)
        save()
        report["drafter"] = time_drafter(drafter, device, c_values, warmup, repeats)
        save()
        del target, drafter
    oshape = TINY if args.tiny else QWEN3_8B
    report["overhead"] = step_overhead(oshape, device, dtype, n=64, c=512, repeats=5 if args.tiny else 20)
    save()
    md = markdown(report)
    (out / "gpu_check.md").write_text(md)
    print(md)
    return report


if __name__ == "__main__":
    main()
