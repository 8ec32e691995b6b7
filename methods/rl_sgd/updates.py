"""What an update changed: bf16 snapshots, update density (bf16, tolerance, fp32) per tensor and
overall, and the 99%-energy effective rank of each weight delta.

Both snapshots are cast from the fp32 masters by the same `.to(torch.bfloat16)` (round to nearest,
ties to even), so an entry "changed in bf16" iff its drift crossed a rounding boundary — roughly
half a bf16 ULP (2^-8 relative) — which small SGD steps seldom do while Adam's ≈lr steps do.
"""
from __future__ import annotations

import torch


def bf16_snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to(torch.bfloat16) for name, tensor in state.items()}


def effective_rank(delta: torch.Tensor, energy: float = 0.99) -> int:
    """r = min{k : Σ_{i≤k} σ_i² ≥ energy · Σ_i σ_i²} of a 2-D delta (float64 SVD); 0 for a zero delta."""
    sigma2 = torch.linalg.svdvals(delta.double()) ** 2
    total = sigma2.sum()
    if total == 0:
        return 0
    cumulative = torch.cumsum(sigma2, 0)
    return int(torch.searchsorted(cumulative, energy * total).item()) + 1


def tensor_updates(theta0: dict[str, torch.Tensor], theta_t: dict[str, torch.Tensor], *, tol: float,
                   rank_source: str = "fp32", energy: float = 0.99) -> list[dict]:
    """One record per parameter tensor: numel, changed counts (bf16 / |Δ_bf16| > tol / fp32), and for
    2-D weights the effective rank of ΔW from the masters (`effective_rank_99_fp32`) and from the bf16
    snapshots (`effective_rank_99_bf16`); `effective_rank_99` is the one `rank_source` names.

    A bf16 θ_T (a run that held its weights in bf16) started from bf16(θ₀), so its master ΔW is taken
    from there: against the fp32 θ₀ the initial cast alone would add a full-rank rounding matrix. Its
    `changed_fp32` still compares with the fp32 θ₀, so that cast alone makes it ≈ numel."""
    records = []
    for name, start in theta0.items():
        end = theta_t[name]
        start32, end32 = start.detach().float(), end.detach().float()
        start16, end16 = start.detach().to(torch.bfloat16), end.detach().to(torch.bfloat16)
        delta16 = end16.float() - start16.float()  # exact in fp32: both are bf16 values
        record = {"param_name": name, "shape": "x".join(str(s) for s in start.shape), "numel": start.numel(),
                  "changed_bf16": int((end16 != start16).sum()), "changed_tol": int((delta16.abs() > tol).sum()),
                  "changed_fp32": int((end32 != start32).sum()), "delta_fro": float(delta16.norm()),
                  "is_matrix": start.dim() == 2, "effective_rank_99": None, "effective_rank_99_fp32": None,
                  "effective_rank_99_bf16": None, "max_rank": None}
        if start.dim() == 2:
            delta32 = delta16 if end.dtype == torch.bfloat16 else end32 - start32
            record["effective_rank_99_fp32"] = effective_rank(delta32, energy)
            record["effective_rank_99_bf16"] = effective_rank(delta16, energy)
            record["effective_rank_99"] = record[f"effective_rank_99_{rank_source}"]
            record["max_rank"] = min(start.shape)
        for kind in ("bf16", "tol", "fp32"):
            record[f"density_{kind}"] = record[f"changed_{kind}"] / max(record["numel"], 1)
        records.append(record)
    return records


def summarise(records: list[dict]) -> dict[str, float]:
    """The run-level metrics of the spec from the per-tensor records."""
    def density(kind: str, rows: list[dict]) -> float:
        return sum(r[f"changed_{kind}"] for r in rows) / max(sum(r["numel"] for r in rows), 1)

    def mean_rank(key: str) -> float:  # mean over 2-D weights of r₉₉ / min(m, n)
        ranks = [r[key] / r["max_rank"] for r in records if r["is_matrix"]]
        return sum(ranks) / len(ranks) if ranks else float("nan")

    matrices = [r for r in records if r["is_matrix"]]
    return {"update_density_bf16": density("bf16", records),
            "update_density_bf16_matrices": density("bf16", matrices),
            "update_density_tol": density("tol", records),
            "update_density_fp32": density("fp32", records),
            **{key: mean_rank(key) for key in ("effective_rank_99", "effective_rank_99_bf16")}}
