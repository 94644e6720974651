"""The bench report's PNG charts (matplotlib, optional: ``pip install 'localspec[bench]'``): speedup
against acceptance, and tokens per second per system and workload."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localspec.bench.report import ALL, workload_order


def write_charts(report: dict, directory: str | Path) -> tuple[dict[str, str], str | None]:
    """speedup_vs_acceptance.png and tokens_per_second.png; ({title: path}, None) or ({}, why not)."""
    plt = _pyplot()
    if plt is None:
        return {}, "charts skipped: matplotlib is not installed (pip install 'localspec[bench]')"
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = _ChartData.of(report)
    out: dict[str, str] = {}
    for title, filename, draw in CHARTS:
        fig = draw(plt, data)
        fig.tight_layout()
        path = directory / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out[title] = str(path)
    return out, None


def _pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


@dataclass(frozen=True)
class _ChartData:
    """What the charts draw: the per-workload result rows, the workloads in order and the systems
    that have rows, with a colour per workload."""

    rows: list[dict]
    workloads: list[str]
    systems: list[str]
    colors: dict[str, str]

    @classmethod
    def of(cls, report: dict) -> _ChartData:
        rows = [r for r in report["results"] if r["workload"] != ALL]
        workloads = workload_order(report)
        systems = [s["name"] for s in report["systems"] if any(r["system"] == s["name"] for r in rows)]
        return cls(rows, workloads, systems, {w: f"C{i}" for i, w in enumerate(workloads)})


MARKERS = "os^Dv<>pP*hX"  # one per system in the speedup chart, in turn


def _speedup_vs_acceptance(plt, data: _ChartData):
    """Each system's speedup (filled) and ceiling (hollow, joined to it) against its acceptance rate,
    a marker per system and a colour per workload."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, name in enumerate(data.systems):
        if name == "baseline":
            continue
        marker = MARKERS[i % len(MARKERS)]
        for r in data.rows:
            if r["system"] != name or r["acceptance_rate"] is None or r["speedup"] is None:
                continue
            color = data.colors[r["workload"]]
            ax.scatter(r["acceptance_rate"], r["speedup"], color=color, marker=marker, s=55, zorder=3)
            if r["ceiling"] is not None:
                ax.scatter(r["acceptance_rate"], r["ceiling"], facecolors="none", edgecolors=color, marker=marker,
                           s=55, zorder=2)
                ax.plot([r["acceptance_rate"]] * 2, [r["speedup"], r["ceiling"]], color=color, lw=0.6, alpha=0.5)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.legend(handles=_speedup_legend(data), fontsize=8, ncol=2, loc="best")
    ax.set_xlabel("acceptance rate (accepted / drafted)")
    ax.set_ylabel("speedup over the oracle alone (×)")
    ax.set_title("Speedup against acceptance (filled: measured, hollow: ceiling)")
    ax.grid(alpha=0.3)
    return fig


def _speedup_legend(data: _ChartData) -> list:
    """The speedup chart's legend: the workloads' colours, the systems' markers, the ceiling's look."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=data.colors[w], marker="o", ls="", label=w) for w in data.workloads]
    handles += [Line2D([], [], color="k", marker=MARKERS[i % len(MARKERS)], ls="", label=n)
                for i, n in enumerate(data.systems) if n != "baseline"]
    handles += [Line2D([], [], color="k", marker="o", mfc="none", ls="", label="ceiling (predicted)")]
    return handles


def _tokens_per_second_chart(plt, data: _ChartData):
    """Tokens per second: a group of bars per workload, a bar per system."""
    systems, workloads = data.systems, data.workloads
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(workloads) * max(1, len(systems)) / 3), 5))
    width = 0.8 / max(1, len(systems))
    for i, name in enumerate(systems):
        xs, ys = [], []
        for j, w in enumerate(workloads):
            r = next((r for r in data.rows if r["system"] == name and r["workload"] == w), None)
            if r and r["tokens_per_second"]:
                xs.append(j + (i - (len(systems) - 1) / 2) * width)
                ys.append(r["tokens_per_second"])
        ax.bar(xs, ys, width, label=name, color=f"C{i}")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads)
    ax.set_ylabel("tokens / s")
    ax.set_title("Generation speed per system and workload")
    ax.legend(fontsize=8, ncol=3)
    ax.grid(axis="y", alpha=0.3)
    return fig


# write_charts' charts: (title, file name, what draws it)
CHARTS = (("Speedup against acceptance", "speedup_vs_acceptance.png", _speedup_vs_acceptance),
          ("Tokens per second", "tokens_per_second.png", _tokens_per_second_chart))
