"""One day of a ``policy.savings`` replay as a PNG (``remp policy evaluate --png FILE --day N``):
the load (req/s), the topology chosen by ``auto`` and by the ``oracle``, and the GPUs each holds
(with ``reactive`` and the whole host for reference), over the day.

``day_view`` is pure (the numbers the figure shows); ``render_png`` draws them with matplotlib's
Agg backend (optional dependency: the ``plot`` extra; ``PlotUnavailable`` when it is missing).
Days are the replay's: consecutive 24-h spans from the trace's first window, numbered from 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policy.decide import DAY_S
from policy.savings import SavingsEvaluation
from remp.topology import Topology

PLOTTED = ("auto", "oracle")  # topology and GPUs
REFERENCE = ("reactive",)  # GPUs only


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


@dataclass
class DayView:
    day: int
    days: int
    hours: np.ndarray  # window starts, hours since the day's start
    load_rps: np.ndarray  # NaN: missing window
    topologies: dict[str, list[Topology]]  # per plotted policy, per window
    gpus: dict[str, np.ndarray]  # per policy, per window
    host_gpus: int
    capacity_rps: dict[str, np.ndarray]  # SLO capacity of the topology held, per plotted policy
    gpu_hours_fraction: dict[str, float]  # that day, vs the whole host
    relative_attainment: dict[str, float]  # that day's in-SLO requests vs fixed-best


def days_of(ev: SavingsEvaluation) -> int:
    t = ev.t_start_s
    return int((t[-1] - t[0]) // DAY_S) + 1


def day_view(ev: SavingsEvaluation, day: int = 0) -> DayView:
    """The windows of day ``day``; ValueError when the replay has no such day or lacks a policy."""
    if ev.rates is None or ev.t_start_s is None:
        raise ValueError("this replay kept no per-window load (run it with policy.savings.run_savings)")
    ndays = days_of(ev)
    if not 0 <= day < ndays:
        raise ValueError(f"day {day} is not in the trace: it has {ndays} day(s), 0..{ndays - 1}")
    missing = [p for p in (*PLOTTED, "fixed-best") if p not in ev.runs]
    if missing:
        raise ValueError(f"the replay has no {', '.join(missing)} policy to plot")
    t = ev.t_start_s
    d0 = t[0] + day * DAY_S
    sel = np.flatnonzero((t >= d0) & (t < d0 + DAY_S))
    host = ev.fixed_best.world_size
    valid = ~np.isnan(ev.rates[sel])
    names = [*PLOTTED, *(p for p in REFERENCE if p in ev.runs)]
    topos = {n: [ev.runs[n].topologies[i] for i in sel] for n in names}
    gpus = {n: np.array([x.world_size for x in topos[n]], dtype=float) for n in names}
    cap = ev.slo_capacity or {}
    base = ev.runs["fixed-best"].good_by_day
    frac, att = {}, {}
    for n in names:
        frac[n] = float(gpus[n][valid].sum() / max(host * valid.sum(), 1))
        g = ev.runs[n].good_by_day
        att[n] = float(g[day] / base[day]) if base[day] > 0 else 1.0
    return DayView(day, ndays, (t[sel] - d0) / 3600.0, ev.rates[sel], {n: topos[n] for n in PLOTTED},
                   gpus, host, {n: np.array([cap.get(x, np.nan) for x in topos[n]]) for n in PLOTTED},
                   frac, att)


def pyplot():
    """matplotlib.pyplot on the Agg backend; PlotUnavailable (one line) when not installed."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--png needs matplotlib, which is not installed: "
                              "pip install 'remp[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render_png(ev: SavingsEvaluation, day: int, path: str) -> DayView:
    """Draw day ``day`` of ``ev`` to ``path`` (PNG); returns what it drew."""
    v = day_view(ev, day)
    plt = pyplot()
    fig, (ax_load, ax_topo, ax_gpu) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True,
                                                   gridspec_kw={"height_ratios": [3, 2, 2]})
    try:
        x = v.hours
        style = {"auto": dict(color="tab:blue", lw=2.0), "oracle": dict(color="tab:orange", lw=1.3, ls="--"),
                 "reactive": dict(color="tab:gray", lw=1.0, ls=":")}
        ax_load.step(x, v.load_rps, where="post", color="black", lw=1.2, label="load")
        for n in PLOTTED:
            ax_load.step(x, v.capacity_rps[n], where="post", alpha=0.8,
                         label=f"SLO capacity held by {n}", **style[n])
        ax_load.set_ylabel("req/s")
        ax_load.set_ylim(bottom=0)
        ax_load.legend(loc="upper left", fontsize=8, ncol=3)
        ax_load.grid(alpha=0.3)

        used = sorted({t for n in PLOTTED for t in v.topologies[n]}, key=lambda t: (t.world_size, t.tp))
        level = {t: i for i, t in enumerate(used)}
        for n in PLOTTED:
            ax_topo.step(x, [level[t] for t in v.topologies[n]], where="post", label=n, **style[n])
        ax_topo.set_yticks(range(len(used)), [f"{t} ({t.world_size} GPU)" for t in used])
        ax_topo.set_ylim(-0.5, len(used) - 0.5)
        ax_topo.set_ylabel("topology")
        ax_topo.legend(loc="upper left", fontsize=8, ncol=2)
        ax_topo.grid(alpha=0.3)

        ax_gpu.axhline(v.host_gpus, color="black", lw=0.8, alpha=0.6, label=f"whole host ({v.host_gpus})")
        for n, g in v.gpus.items():
            ax_gpu.step(x, g, where="post", label=f"{n}: {v.gpu_hours_fraction[n]:.3f} of the host's GPU-h, "
                        f"rel. att. {v.relative_attainment[n]:.4f}", **style[n])
        ax_gpu.set_ylim(0, v.host_gpus * 1.15)
        ax_gpu.set_ylabel("GPUs held")
        ax_gpu.set_xlabel(f"hours since the start of day {v.day}")
        ax_gpu.legend(loc="lower left", fontsize=8)
        ax_gpu.grid(alpha=0.3)
        span = max(float(x[-1]) + ev.window_s / 3600.0, 1e-3) if len(x) else 24.0
        ax_gpu.set_xlim(0, span)

        fig.suptitle(f"{ev.trace} · {ev.profile} · {ev.objective} · K={ev.load_scale:g} · day {v.day} of "
                     f"{v.days} ({ev.window_s:g}-s windows)", fontsize=11)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
    return v
