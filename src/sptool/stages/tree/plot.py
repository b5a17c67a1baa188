"""A picture of the domain tree for reports (matplotlib, imported lazily).

One row per node, indented by depth and joined to its parent by elbow lines; a coloured box shows
the posterior mean α̃/(α̃+β̃) (red → green), with the window and visit count beside it.
"""

from __future__ import annotations

import os

from sptool.core.records import RuntimeFailure


def plot_tree(tree: dict, rows: list[dict], path: str | os.PathLike) -> None:
    """Draw ``rows`` (from :func:`sptool.stages.tree.tree_rows`) to a PNG file at ``path``, atomically."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        raise RuntimeFailure("tree show --format png needs matplotlib: pip install matplotlib") from None

    shown = [row for row in rows if row["depth"] > 0]
    height = max(2.0, 0.32 * len(shown) + 1.0)
    figure, axes = plt.subplots(figsize=(10, height), dpi=110)
    cmap = plt.get_cmap("RdYlGn")
    y_of: dict[str, float] = {}
    for index, row in enumerate(shown):
        y = -index
        y_of[row["id"]] = y
        x = (row["depth"] - 1) * 0.6
        parent_y = y_of.get(row["parent"])
        if parent_y is not None:
            px = (row["depth"] - 2) * 0.6 + 0.1
            axes.plot([px, px, x], [parent_y - 0.25, y, y], color="0.6", linewidth=0.8, zorder=1)
        axes.scatter([x], [y], s=110, color=cmap(row["mean"]), edgecolors="0.3", zorder=2)
        window = "".join(str(g) for g in row["window"]) or "-"
        name = "unk" if row["is_unk"] else row["label"]
        axes.text(x + 0.15, y, f"{name}", va="center", fontsize=9,
                  style="italic" if row["is_unk"] else "normal",
                  color="0.5" if row["is_unk"] else "black")
        axes.text(6.2, y, f"{row['mean']:.2f}   [{window}]   n={row['visits']}", va="center",
                  fontsize=8, family="monospace", color="0.25")
    axes.set_xlim(-0.3, 9.5)
    axes.set_ylim(-len(shown) + 0.3, 1.2)
    axes.text(6.2, 0.8, "mean   [window]   visits", fontsize=8, family="monospace", color="0.4")
    axes.set_title(f"{tree['domain']} domain tree (revision {tree['revision']}, "
                   f"L={tree['max_depth']}, μ={tree['window_size']})", fontsize=10)
    axes.axis("off")
    figure.tight_layout()
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.part.png")
    try:
        figure.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(figure)
        if os.path.exists(tmp):
            os.unlink(tmp)
