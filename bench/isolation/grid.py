"""The grid of `cliffguard bench isolation --sweep` and its verdict: the cells (chat rate x rag rate
x rag length), the runs they need (chat alone, rag alone, split, shared), whether chat keeps its SLO
in each cell, the table and the heat map. No server here: `bench.isolation` runs them."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.isolation.scenarios import ROUTE_THRESHOLD, device_of, judge, pool_file, verdict_text
from bench.options import int_list
from pools.workload import LengthDist, WorkloadClass, parse_rates

QUICK_GRID = ("0.5,2", "0.3", "1500")       # --chat-rates, --rag-rates, --rag-lens of --quick
DEFAULT_GRID = ("0.5,1,2", "0.1,0.2,0.4", "1500,3000")
RAG_LEN_SPREAD = 0.2                        # rag prompts: uniform within +-20% of the length asked
BLOCK_SIZE = 16


# --- the grid and its runs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Grid:
    """The sweep's loads. Seeds: chat rate i -> 1000 x seed + i; rag pair j (rag rates outer, lengths
    inner) -> 1000 x seed + 500 + j. `only`: run just these cells of the grid (`--cells`), each with the
    arrivals it has in the whole grid, so one cell of a sweep can be run again by itself."""

    chat_rates: tuple[float, ...]
    rag_rates: tuple[float, ...]
    rag_lens: tuple[int, ...]
    rag_output_tokens: int = 128
    seed: int = 0
    shared: bool = True          # run the shared layout per cell (--no-shared: split and baselines only)
    only: tuple[tuple[float, float, int], ...] = ()

    def __post_init__(self) -> None:
        grid = [(c, r, n) for c in self.chat_rates for r in self.rag_rates for n in self.rag_lens]
        for cell in self.only:
            if cell not in grid:
                raise ValueError(f"--cells: {cell[0]:g},{cell[1]:g},{cell[2]} is not a cell of the grid (its chat "
                                 "rate, rag rate and rag length must be among --chat-rates, --rag-rates, --rag-lens)")
        if min(self.rag_lens) * (1 - RAG_LEN_SPREAD) <= ROUTE_THRESHOLD:
            raise ValueError(f"--rag-lens: the shortest rag prompt must be above the chat route's "
                             f"{ROUTE_THRESHOLD} tokens, so every rag length must be >= "
                             f"{math.floor(ROUTE_THRESHOLD / (1 - RAG_LEN_SPREAD)) + 1}, got {min(self.rag_lens)}")
        if self.rag_output_tokens < 1:
            raise ValueError(f"--rag-output-tokens: must be >= 1, got {self.rag_output_tokens}")

    @property
    def rag_pairs(self) -> list[tuple[float, int]]:
        return [(rate, n) for rate in self.rag_rates for n in self.rag_lens]

    @property
    def cells(self) -> list[tuple[float, float, int]]:
        """(chat rate, rag rate, rag length) of every cell to run (those of `only`, when it names any)."""
        return [(c, r, n) for c in self.chat_rates for r, n in self.rag_pairs
                if not self.only or (c, r, n) in self.only]

    def chat_seed(self, chat_rate: float) -> int:
        return 1000 * self.seed + self.chat_rates.index(chat_rate)

    def rag_seed(self, rag_rate: float, rag_len: int) -> int:
        return 1000 * self.seed + 500 + self.rag_pairs.index((rag_rate, rag_len))

    def rag_class(self, rag_len: int) -> WorkloadClass:
        low, high = round(rag_len * (1 - RAG_LEN_SPREAD)), round(rag_len * (1 + RAG_LEN_SPREAD))
        return WorkloadClass(name="rag", endpoint="completion", prompt_len=LengthDist("uniform", min=low, max=high),
                             output_len=LengthDist("fixed", value=self.rag_output_tokens))

    @property
    def max_model_len(self) -> int:
        """The rag (and shared) pool's context: 4096 as `bench isolation`'s, or the longest rag prompt
        plus its output when that is more (in whole blocks)."""
        longest = round(max(self.rag_lens) * (1 + RAG_LEN_SPREAD)) + self.rag_output_tokens
        return max(4096, -(-longest // BLOCK_SIZE) * BLOCK_SIZE)


def sweep_grid(args: argparse.Namespace) -> Grid:
    """The grid of the command line: the flags, else the defaults (--quick's own)."""
    chat, rag, lens = QUICK_GRID if args.quick else DEFAULT_GRID
    return Grid(tuple(parse_rates(args.chat_rates or chat, "--chat-rates")),
                tuple(parse_rates(args.rag_rates or rag, "--rag-rates")),
                tuple(int_list(args.rag_lens or lens, "--rag-lens", 1, "lengths must be >= 1")),
                args.rag_output_tokens, args.seed, shared=not args.no_shared, only=parse_cells(args.cells))


def parse_cells(text: str | None) -> tuple[tuple[float, float, int], ...]:
    """`--cells "1.25,0.2,3000;0.75,0.4,1500"` -> ((1.25, 0.2, 3000), (0.75, 0.4, 1500)); () for None."""
    if not text:
        return ()
    cells = []
    for part in (p for p in text.split(";") if p.strip()):
        items = part.split(",")
        if len(items) != 3:
            raise ValueError(f"--cells: each cell is CHAT_RATE,RAG_RATE,RAG_LEN, got {part.strip()!r}")
        (chat,), (rag,) = parse_rates(items[0], "--cells"), parse_rates(items[1], "--cells")
        cells.append((chat, rag, int_list(items[2], "--cells", 1, "rag lengths must be >= 1")[0]))
    return tuple(cells)


@dataclass(frozen=True)
class Run:
    """One run of the sweep: which loads go to which layout's server."""

    kind: str                    # chat alone | rag alone | split | shared
    layout: str                  # split | shared
    chat_rate: float | None = None
    rag_rate: float | None = None
    rag_len: int | None = None

    def describe(self) -> str:
        loads = ([f"chat {self.chat_rate:g}/s"] if self.chat_rate else []) + (
            [f"rag {self.rag_rate:g}/s x {self.rag_len} tok"] if self.rag_rate else [])
        return f"{self.kind}: {', '.join(loads)}"


def plan_runs(grid: Grid) -> list[Run]:
    """Every run, in order: the split server's (chat alone per chat rate, rag alone per rag pair, split
    per cell; baselines only where a cell to run needs them), then the shared server's (shared per cell)."""
    cells = grid.cells
    return ([Run("chat alone", "split", chat_rate=c) for c in grid.chat_rates if any(c == x for x, _, _ in cells)]
            + [Run("rag alone", "split", rag_rate=r, rag_len=n) for r, n in grid.rag_pairs
               if any((r, n) == (y, z) for _, y, z in cells)]
            + [Run("split", "split", c, r, n) for c, r, n in grid.cells]
            + [Run("shared", "shared", c, r, n) for c, r, n in grid.cells if grid.shared])


def sweep_pool_files(args: argparse.Namespace, grid: Grid) -> dict[str, str]:
    """layout -> pool file: `bench isolation`'s, chat's slo as the flags say (none with --no-slo)."""
    slo = None if args.no_slo else (args.ttft_ms, args.itl_ms)
    common = {"memory": args.memory, "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_model_len": grid.max_model_len, **device_of(args)}
    return {"split": pool_file("split", chat_slo=slo, names_slo=not args.no_slo, chat_kv_share=args.chat_kv_share,
                               **common),
            "shared": pool_file("shared", chat_slo=None, **common)}


def assemble(grid: Grid, runs: list[tuple[Run, dict[str, Any]]], args: argparse.Namespace,
             slo_ms: tuple[float, float] | None = None) -> dict[str, Any]:
    """Baselines, cells with their verdicts (`bench.isolation.judge`), and the summary, from the runs;
    `slo_ms`: the (ttft_ms, itl_ms) the split server's chat pool ran with (default: the flags')."""
    ttft_ms, itl_ms = slo_ms or (args.ttft_ms, args.itl_ms)
    by = {run: result for run, result in runs}
    cells = []
    for c, r, n in grid.cells:
        alone = by[Run("chat alone", "split", chat_rate=c)]
        rag_alone = by[Run("rag alone", "split", rag_rate=r, rag_len=n)]
        split, shared = by[Run("split", "split", c, r, n)], by.get(Run("shared", "shared", c, r, n), {})
        cell: dict[str, Any] = {
            "chat_rate": c, "rag_rate": r, "rag_len": n,
            "chat_seed": grid.chat_seed(c), "rag_seed": grid.rag_seed(r, n),
            "ttft_p99_alone": alone.get("ttft_p99"), "ttft_p99_split": split.get("ttft_p99"),
            "ttft_p99_shared": shared.get("ttft_p99"), "itl_p99_alone": alone.get("itl_p99"),
            "itl_p99_split": split.get("itl_p99"), "itl_p99_shared": shared.get("itl_p99"),
            "split_chat_preemptions": split.get("chat_preemptions"),
            "shared_chat_preemptions": shared.get("chat_preemptions"),
            "rag_tokens_per_s_split": split.get("rag_tokens_per_s"),
            "rag_tokens_per_s_alone": rag_alone.get("rag_tokens_per_s"),
            "rag_device_share_split": split.get("rag_device_share"),
            "rag_device_share_alone": rag_alone.get("rag_device_share"),
            "overloaded_first_s": split.get("overloaded_first_s"),
            **judge(alone, split, rag_alone, ttft_ms=ttft_ms, itl_ms=itl_ms, min_share=args.min_share),
            "runs": {"split": split, "shared": shared},
        }
        cell["verdict"] = verdict_text(cell)
        cells.append(cell)
    in_scope = [cell for cell in cells if cell["in_scope"]]
    return {
        "grid": {"chat_rates": list(grid.chat_rates), "rag_rates": list(grid.rag_rates),
                 "rag_lens": list(grid.rag_lens), "rag_output_tokens": grid.rag_output_tokens,
                 "rag_len_spread": RAG_LEN_SPREAD, "max_model_len": grid.max_model_len},
        "baselines": {"chat_alone": [result for run, result in runs if run.kind == "chat alone"],
                      "rag_alone": [result for run, result in runs if run.kind == "rag alone"]},
        "cells": cells,
        "slo_ms": [ttft_ms, itl_ms],
        "summary": {"cells": len(cells), "in_scope": len(in_scope),
                    "met": sum(c["cell_ok"] is True for c in in_scope),
                    "invalid": sum(not c["send_lag_ok"] for c in in_scope),
                    "overloaded": sum(c["overloaded"] for c in cells),
                    "runs": len(runs), "servers": len({result["server_url"] for _, result in runs}),
                    "runs_s": sum(result["wall_s"] + result["idle_wait_s"] for _, result in runs)},
    }


def summary_line(data: dict[str, Any]) -> str:
    s = data["summary"]
    return (f"cells in scope: {s['in_scope']} of {s['cells']} (the rest: chat alone uses more than 1 - min_share "
            f"of the device); met: {s['met']} of {s['in_scope']}; invalid (a run's requests sent too late, not "
            f"judged): {s['invalid']}; overloaded (the gauge said so): {s['overloaded']}")


def format_sweep_table(data: dict[str, Any]) -> str:
    def ms(v):
        return "-" if v is None else f"{1000 * v:.0f}"

    def x(v):
        return "-" if v is None else f"{v:.2f}"

    head = (f"{'chat/s':>6} {'rag/s':>5} {'rag len':>7}  {'TTFT p99 ms alone':>17} {'split':>6} {'shared':>7}  "
            f"{'ITL p99 ms alone':>16} {'split':>6} {'shared':>7}  {'split/SLO':>9} {'preempt':>7} "
            f"{'rag ratio':>9} {'chat share':>10} {'rag share':>9}  verdict")
    lines = [head]
    for c in data["cells"]:
        lines.append(f"{c['chat_rate']:>6g} {c['rag_rate']:>5g} {c['rag_len']:>7}  {ms(c['ttft_p99_alone']):>17} "
                     f"{ms(c['ttft_p99_split']):>6} {ms(c['ttft_p99_shared']):>7}  {ms(c['itl_p99_alone']):>16} "
                     f"{ms(c['itl_p99_split']):>6} {ms(c['itl_p99_shared']):>7}  {x(c['split_ttft_slo_ratio']):>9} "
                     f"{str(c['split_chat_preemptions']):>7} {x(c['rag_ratio']):>9} "
                     f"{x(c['chat_alone_device_share']):>10} {x(c['rag_device_share_split']):>9}  {c['verdict']}")
    return "\n".join(lines)


# --- the plot --------------------------------------------------------------------------------------------------

def write_heatmap(data: dict[str, Any], path: Path, ttft_ms: float) -> None:
    """Per rag length a heat map (rows chat rate, columns rag rate) of split chat p99 TTFT / ttft_ms."""
    import matplotlib
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    grid = data["grid"]
    chat_rates, rag_rates, rag_lens = grid["chat_rates"], grid["rag_rates"], grid["rag_lens"]
    ratios = [c["split_ttft_slo_ratio"] for c in data["cells"] if c["split_ttft_slo_ratio"] is not None]
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max([2.0] + ratios))
    cmap = matplotlib.colormaps["RdYlGn_r"].with_extremes(bad="lightgrey")
    width = len(rag_lens) * (1.4 + 1.3 * len(rag_rates)) + 1.6
    fig = Figure(figsize=(max(7.0, width), max(4.0, 2.0 + len(chat_rates) * 9 / 10)), layout="constrained")
    axes = fig.subplots(1, len(rag_lens), squeeze=False)[0]
    image = None
    for ax, rag_len in zip(axes, rag_lens):
        values = np.full((len(chat_rates), len(rag_rates)), np.nan)
        for c in (c for c in data["cells"] if c["rag_len"] == rag_len):
            i, j = chat_rates.index(c["chat_rate"]), rag_rates.index(c["rag_rate"])
            ratio = c["split_ttft_slo_ratio"]
            if c["in_scope"] and c["send_lag_ok"] and ratio is not None:
                values[i, j] = ratio
            text = "-" if ratio is None else f"{ratio:.2f}"
            if c["overloaded"]:
                text += "\noverloaded"
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2.5))
            if c["in_scope"] and not c["send_lag_ok"]:
                text += "\ninvalid: send lag"
            elif c["in_scope"]:
                text += " \u2713" if c["cell_ok"] else " \u2717"
            else:
                text += "\nout of scope"
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", edgecolor="grey",
                                       linewidth=0))
            ax.text(j, i, text, ha="center", va="center", fontsize=9)
        image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, origin="lower", aspect="auto")
        ax.set_xticks(range(len(rag_rates)), [f"{r:g}" for r in rag_rates])
        ax.set_yticks(range(len(chat_rates)), [f"{r:g}" for r in chat_rates])
        ax.set_xlabel("rag requests/s")
        ax.set_ylabel("chat requests/s")
        ax.set_title(f"rag prompts ~{rag_len} tokens")
    fig.colorbar(image, ax=list(axes), label=f"split chat p99 TTFT / ttft_ms ({ttft_ms:g} ms); 1 = SLO")
    s = data["summary"]
    fig.suptitle(f"bench isolation --sweep: {s['met']} of {s['in_scope']} cells in scope met "
                 f"({s['cells']} cells)\n\u2713 cell_ok, \u2717 a bar missed; hatched grey: out of scope "
                 "(chat alone uses more than 1 - min_share of the device); black frame: overloaded; invalid: "
                 "a run's requests left too late (not judged, not coloured)", fontsize=9)
    fig.savefig(path, dpi=110)
