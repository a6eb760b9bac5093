"""The bench's PNG plots, made with matplotlib (the `bench` extra; imported only here, when plotting).

- `speedup.png`: decode speedup over plain decoding by method, bars with whiskers from the 25th to the
  75th percentile of the per-prompt speedups, and a line at 1 (plain decoding);
- `acceptance.png`: acceptance rate by draft position, one line per drafting method;
- `categories.png`: speedup by prompt category, when the prompts have more than one.
"""

from __future__ import annotations

from pathlib import Path

from specdec.bench.compare import Summary

FASTER, SLOWER, BASELINE = "#2b8a3e", "#c92a2a", "#868e96"


def write_plots(out_dir: Path, summaries: list[Summary], subtitle: str) -> list[Path]:
    """The plots for these summaries in `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [_speedup(plt, out_dir / "speedup.png", summaries, subtitle)]
    if any(s.per_position for s in summaries):
        paths.append(_acceptance(plt, out_dir / "acceptance.png", summaries, subtitle))
    if len(summaries[0].speedup_by_category) > 1:
        paths.append(_categories(plt, out_dir / "categories.png", summaries, subtitle))
    return paths


def _figure(plt, width: float, height: float, ncols: int = 1):
    """A figure with room at the top (in inches, whatever its height) for `_save`'s title and subtitle."""
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), layout="constrained")
    fig.get_layout_engine().set(rect=(0, 0, 1, 1 - 0.75 / height))
    return fig, axes


def _save(plt, fig, path: Path, title: str, subtitle: str) -> Path:
    height = fig.get_figheight()
    fig.suptitle(title, fontsize=12, fontweight="bold", x=0.01, y=1 - 0.08 / height, ha="left", va="top")
    fig.text(0.01, 1 - 0.4 / height, subtitle, fontsize=8.5, color="#495057", ha="left", va="top")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _speedup(plt, path: Path, summaries: list[Summary], subtitle: str) -> Path:
    fig, ax = _figure(plt, 8, 1.6 + 0.6 * len(summaries))
    names = [s.name if s.config_json is None else f"{s.name}\n{s.tokens_per_pass:.2f} tokens per target pass"
             for s in summaries][::-1]  # the baseline on top
    values = [s.speedup for s in summaries][::-1]
    spread = [s.speedup_quartiles for s in summaries][::-1]
    colors = [BASELINE if s.config_json is None else FASTER if s.speedup >= 1 else SLOWER for s in summaries][::-1]
    err = [[max(0.0, v - low) for v, (low, _) in zip(values, spread)],
           [max(0.0, high - v) for v, (_, high) in zip(values, spread)]]
    ax.barh(names, values, color=colors, xerr=err, capsize=4, error_kw={"elinewidth": 1, "ecolor": "#343a40"})
    ax.axvline(1.0, color="#343a40", linewidth=1, linestyle="--")
    for y, (v, (_, high)) in enumerate(zip(values, spread)):
        ax.text(max(v, high) + 0.02, y, f"{v:.2f}x", va="center", fontsize=9)
    ax.set_xlim(0, max(max(values), max(h for _, h in spread)) * 1.18)
    ax.set_xlabel("decode speedup over plain decoding (x)\nwhiskers: 25th to 75th percentile of the prompts' speedups")
    ax.grid(axis="x", alpha=0.3)
    return _save(plt, fig, path, "Speedup by method: longer is faster, the dashed line is plain decoding", subtitle)


def _acceptance(plt, path: Path, summaries: list[Summary], subtitle: str) -> Path:
    fig, ax = _figure(plt, 8, 4.6)
    width = 0
    for s in summaries:
        if s.per_position:
            positions = range(1, len(s.per_position) + 1)
            ax.plot(positions, s.per_position, marker="o", label=s.name)
            width = max(width, len(s.per_position))
    ax.set_xticks(range(1, width + 1))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position (1: the first drafted token)")
    ax.set_ylabel("share of drafts accepted up to it")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)
    return _save(plt, fig, path, "Acceptance by draft position: higher means longer drafts are kept", subtitle)


def _categories(plt, path: Path, summaries: list[Summary], subtitle: str) -> Path:
    categories = list(summaries[0].speedup_by_category)
    drafting = summaries[1:]
    fig, ax = _figure(plt, max(8.0, 0.45 * len(categories) * len(drafting)), 5)
    bar = 0.8 / max(1, len(drafting))
    for i, s in enumerate(drafting):
        xs = [c + (i - (len(drafting) - 1) / 2) * bar for c in range(len(categories))]
        ax.bar(xs, [s.speedup_by_category[c] for c in categories], bar, label=s.name)
    ax.axhline(1.0, color="#343a40", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel("decode speedup over plain decoding (x)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=2, frameon=False)
    return _save(plt, fig, path, "Speedup by prompt category: above the dashed line is faster than plain", subtitle)


def write_serve_plot(out_dir: Path, rows: list[dict], subtitle: str) -> Path:
    """`serve.png`: output tokens/s, TTFT and TPOT percentiles by number of concurrent clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = [r["concurrency"] for r in rows]
    fig, axes = _figure(plt, 11, 4, ncols=3)
    axes[0].plot(clients, [r["throughput"] for r in rows], marker="o", color=FASTER)
    axes[0].set_ylabel("output tokens/s")
    for ax, name, scale, unit in ((axes[1], "ttft", 1, "s"), (axes[2], "tpot", 1e3, "ms")):
        for p, style in zip((50, 90, 99), ("-", "--", ":")):
            ax.plot(clients, [scale * r[f"{name}_p{p}"] for r in rows], marker="o", linestyle=style, label=f"p{p}")
        ax.set_ylabel(f"{name.upper()} ({unit})")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.set_xlabel("concurrent clients")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    return _save(plt, fig, out_dir / "serve.png", "Serving under load: throughput up, latency low is better", subtitle)
