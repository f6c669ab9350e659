"""The paper's numbers, read from conf/paper/numbers.yaml (the one place they live) and nowhere else.

The one reader of that file, below both fp4moe.scale (the model's T1/T2 checks) and fp4moe.report; no torch."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fp4moe.paths import conf_dir

NUMBERS = conf_dir() / "paper" / "numbers.yaml"


def load(path: str | Path | None = None) -> dict[str, Any]:
    """numbers.yaml as a plain dict."""
    with open(path or NUMBERS) as f:
        return yaml.safe_load(f)


def t1_cells(numbers: dict[str, Any]) -> list[dict[str, Any]]:
    """T1 cells in the paper's order (scope, then recipe): scope, scope_label, recipe, tgs, peak_memory_pct,
    oom, source."""
    t1 = numbers["t1"]
    out = []
    for scope, meta in t1["scopes"].items():
        for recipe in t1["recipes"]:
            cell = t1["cells"][scope][recipe]
            out.append({"scope": scope, "scope_label": meta["label"], "recipe": recipe, "tgs": cell["tgs"],
                        "peak_memory_pct": cell["peak_memory_pct"], "oom": bool(cell["oom"]),
                        "source": cell.get("source", t1["source"])})
    return out


def t2_rows(numbers: dict[str, Any]) -> list[dict[str, Any]]:
    """T2 rows in the paper's order: row (key), label, vs_fp8_pct, vs_bf16_pct (peak-memory change), source."""
    t2 = numbers["t2"]
    return [{"row": key, "label": r["label"], "vs_fp8_pct": float(r["peak_memory_change_vs_fp8_pct"]),
             "vs_bf16_pct": float(r["peak_memory_change_vs_bf16_pct"]), "source": r.get("source", t2["source"])}
            for key, r in t2["rows"].items()]


def sister_memory_cells(numbers: dict[str, Any]) -> list[dict[str, Any]]:
    """The sister artifact's DeepSeek-V3 peak memory (not the paper's): layout ('ep8' | 'ep16' | 'ep32'), ac ('full'
    | 'sel'), recipe, gb (None: OOM), oom, source, file, units."""
    s = numbers["sister_dsv3_memory"]
    return [{"layout": layout, "ac": ac, "recipe": recipe, "gb": None if gb is None else float(gb), "oom": gb is None,
             "source": s["source"], "file": s["file"], "units": s["units"]}
            for layout, acs in s["cells"].items() for ac, row in acs.items() for recipe, gb in row.items()]


def source_of(numbers: dict[str, Any], key: str) -> str:
    """The ``source`` of a top-level block (abstract / secondary-summary)."""
    return str(numbers[key].get("source", "unknown"))


__all__ = ["NUMBERS", "load", "t1_cells", "t2_rows", "sister_memory_cells", "source_of"]
