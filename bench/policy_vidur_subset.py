"""Extract the Vidur profiling subset the policy's performance model reads (run once; the output
is committed under policy/perfdata/vidur/ because ../shared is not shipped).

    python bench/policy_vidur_subset.py [--src ../shared/perfdata/vidur] [--dst policy/perfdata/vidur]

Kept, unchanged in value: the *median* column of every per-operator time (ms) with num_tokens and
num_tensor_parallel_workers (H100, Llama-2-7b and Llama-2-70b), and the median NCCL all-reduce /
send-recv time (ms) by message size and worker count on the 8xH100 DGX (all GPUs of one node).
Dropped: min/max/mean/std columns, the model-shape columns (constant per file), other models,
the pairwise-NVLink host and cross-node rows.
"""

from __future__ import annotations

import argparse
import csv
import shutil
from pathlib import Path

OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
MODELS = {"llama2-7b": "meta-llama/Llama-2-7b-hf", "llama2-70b": "meta-llama/Llama-2-70b-hf"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="../shared/perfdata/vidur")
    ap.add_argument("--dst", default="policy/perfdata/vidur")
    a = ap.parse_args()
    src, dst = Path(a.src), Path(a.dst)
    (dst / "h100").mkdir(parents=True, exist_ok=True)
    for short, full in MODELS.items():
        rows = list(csv.DictReader(open(src / "compute/h100" / full / "mlp.csv")))
        rows.sort(key=lambda r: (int(r["num_tensor_parallel_workers"]), int(r["num_tokens"])))
        with open(dst / "h100" / f"{short}_mlp.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["num_tensor_parallel_workers", "num_tokens"] + [f"{op}_median_ms" for op in OPS])
            for r in rows:
                w.writerow([r["num_tensor_parallel_workers"], r["num_tokens"]]
                           + [r[f"time_stats.{op}.median"] for op in OPS])
    for coll in ("all_reduce", "send_recv"):
        rows = list(csv.DictReader(open(src / "network/h100_dgx" / f"{coll}.csv")))
        keep = [r for r in rows if (coll == "all_reduce" and r["devices_per_node"] == r["num_workers"])
                or (coll == "send_recv" and r["devices_per_node"] == "2")]
        keep.sort(key=lambda r: (int(r["num_workers"]), int(r["size"])))
        with open(dst / "h100" / f"{coll}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["num_workers", "size_bytes", "median_ms"])
            for r in keep:
                w.writerow([r["num_workers"], r["size"], r[f"time_stats.{coll}.median"]])
    shutil.copy(src / "LICENSE", dst / "LICENSE")


if __name__ == "__main__":
    main()
