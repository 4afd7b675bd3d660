"""Attention statistics at long lengths (issue 23's numbers): time and peak memory of ``attnkit.record_stats`` beside
the same forward without it, and eager's whole weights for comparison.

Rows (each in a fresh subprocess, so that no allocator cache or earlier peak is carried over; peak = how far the
resident set rose above its size before the forward, :func:`attnkit.tools.bench.peak_memory`, in the first run; time:
the median of ``REPEATS`` runs):

* ``llama``: a Llama-shaped model built from a config (8 layers, hidden 512, 8 heads, 2 key/value heads,
  intermediate 1376), attnkit registered, B=1, one forward of ``L`` tokens under ``torch.no_grad()``: plain, and
  inside ``record_stats(model, topk=32)`` (every layer's statistics kept);
* ``eager``: the same model with transformers' eager attention and ``output_attentions=True`` (whole weights);
* ``mha``: ``attnkit.MultiHeadAttention(512, 8)``, causal, plain and with ``record_stats(topk=16)``;
* ``agree``: at L=2048, GQA, left and right padding: the statistics attnkit records equal those reduced (in float64)
  from eager's ``output_attentions`` of the same weights: top-k values, their keys, entropy, column sums.

Usage::

    python benchmarks/stats.py --json stats.json                 # everything (about 10 minutes on 2 cores)
    python benchmarks/stats.py --rows mha,agree                  # the quick ones
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

TOPK = 32
# Timed runs per row (the median is reported): the 32k Llama forward takes minutes, once each.
REPEATS = {"mha": 3, "llama": 1, "eager": 1}


def llama(L: int, attention: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnkit.integrations import transformers as attnkit_hf

    attnkit_hf.register()
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max(L, 2048),
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def one(row: str, L: int, mode: str) -> dict:
    """One measurement in this process: seconds and extra peak bytes of one forward."""
    import torch

    import attnkit
    from attnkit.tools.bench import peak_memory

    torch.manual_seed(0)
    result: dict = {}
    if row in ("llama", "eager"):
        model = llama(L, "attnkit" if row == "llama" else "eager")
        ids = torch.randint(0, 1000, (1, L))

        def run() -> None:
            with torch.no_grad():
                if mode == "stats":
                    with attnkit.record_stats(model, topk=TOPK) as rec:
                        model(ids)
                    result["stats_bytes"] = rec.nbytes
                    result["layers"] = len(rec)
                else:
                    out = model(ids, output_attentions=row == "eager")
                    if row == "eager":
                        result["weights_bytes"] = sum(a.numel() * a.element_size() for a in out.attentions)

    else:
        mha = attnkit.MultiHeadAttention(512, 8).eval()
        x = torch.randn(1, L, 512)

        def run() -> None:
            with torch.no_grad():
                if mode == "stats":
                    with attnkit.record_stats(mha, topk=16) as rec:
                        mha(x, x, x, is_causal=True)
                    result["stats_bytes"] = rec.nbytes
                else:
                    mha(x, x, x, is_causal=True)

    start = time.perf_counter()
    result["peak_bytes"] = peak_memory(run)
    times = [time.perf_counter() - start]
    for _ in range(REPEATS[row] - 1):  # the first run's peak, the median of the runs' times
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    result["seconds"] = statistics.median(times)
    result["runs"] = [round(t, 3) for t in times]
    return result


def agree(L: int = 2048) -> dict:
    """attnkit's recorded statistics against those of eager's whole weights, with left and right padding."""
    import torch

    import attnkit
    from attnkit import stats

    worst: dict[str, float] = {}
    for side in ("left", "right"):
        torch.manual_seed(0)
        ids = torch.randint(0, 1000, (2, L))
        attention_mask = torch.ones(2, L, dtype=torch.long)
        if side == "left":
            attention_mask[1, : L // 3] = 0
        else:
            attention_mask[1, -L // 3 :] = 0
        ours, theirs = llama(L, "attnkit"), llama(L, "eager")
        theirs.load_state_dict(ours.state_dict())
        with torch.no_grad(), attnkit.record_stats(ours, topk=TOPK) as rec:
            ours(ids, attention_mask=attention_mask)
        with torch.no_grad():
            eager = theirs(ids, attention_mask=attention_mask, output_attentions=True).attentions
        for i, w in enumerate(eager):
            got = rec[f"model.layers.{i}.self_attn"]
            # rows that see no key (left padding's queries): attnkit gives them zeros, eager its own convention;
            # they are left out of both sides (a padded query of right padding sees the real keys: kept)
            live = got.topk_values[..., :1] > 0  # (B, H, L, 1)
            want = stats.from_weights(w.double() * live, TOPK)
            rows = live[..., 0]  # (B, H, L)
            errs = {
                "topk_values": (got.topk_values.double() - want.topk_values).abs()[rows],
                "entropy": (got.entropy.double() - want.entropy).abs()[rows],
                "column_sum (relative)": (got.column_sum.double() - want.column_sum).abs()
                / want.column_sum.abs().clamp_min(1),
            }
            named = (w.double() * live).gather(-1, got.topk_indices.clamp_min(0))
            index_err = torch.where(got.topk_indices >= 0, named - got.topk_values.double(), 0.0).abs()
            errs["topk_indices (weight named - value)"] = index_err[rows]
            for name, e in errs.items():
                worst[name] = max(worst.get(name, 0.0), float(e.max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="mha,agree,eager,llama")
    parser.add_argument("--json")
    parser.add_argument("--one", nargs=3, metavar=("ROW", "L", "MODE"))
    args = parser.parse_args()
    if args.one:
        row, L, mode = args.one
        print(json.dumps(one(row, int(L), mode)))
        return
    plan = {
        "mha": [("mha", 16384, m) for m in ("plain", "stats")],
        "eager": [("eager", L, "plain") for L in (2048, 4096)],
        "llama": [("llama", 32768, m) for m in ("plain", "stats")],
    }
    results: list[dict] = []
    for row in args.rows.split(","):
        if row == "agree":
            results.append({"row": "agree", "L": 2048, "worst": agree()})
            print(json.dumps(results[-1]), flush=True)
            continue
        for name, L, mode in plan[row]:
            child = subprocess.run(
                [sys.executable, __file__, "--one", name, str(L), mode], capture_output=True, text=True, check=False
            )
            entry = {"row": name, "L": L, "mode": mode}
            if child.returncode:
                entry["error"] = child.stderr.strip().splitlines()[-1:]
            else:
                entry.update(json.loads(child.stdout.strip().splitlines()[-1]))
            results.append(entry)
            print(json.dumps(entry), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
