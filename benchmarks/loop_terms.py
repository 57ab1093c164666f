"""loop.json's optimisation-term keys from the same run (`bench_loop.py --extra loop_terms:figures`):
the learning rate the first and last steps trained at, and the mean KL to the frozen reference,
read from the run's step rows (report.json)."""

from __future__ import annotations

from pathlib import Path


def figures(run_dir: Path, report: dict) -> dict:
    rows = report.get("steps") or []
    lrs = [r["learning_rate"] for r in rows if r.get("learning_rate") is not None]
    kls = [r["kl_ref_mean"] for r in rows if r.get("kl_ref_mean") is not None]
    return {"lr_first": lrs[0] if lrs else None, "lr_last": lrs[-1] if lrs else None,
            "kl_ref_mean": sum(kls) / len(kls) if kls else None, "kl_ref_by_step": kls}
