"""Pictures of a simulated run (``SimReport.display``): bars in the terminal, one row per rank
and stream, and the same timeline as a PNG (matplotlib, when installed; the trace JSON for
Perfetto is ``SimReport.trace``).

A terminal row is the run's time cut into ``width`` equal cells; each cell shows what the
stream did most of that time: ``#`` compute, ``=`` communication, ``.`` waiting (for a value, or
for another stream at a borrow), blank idle.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

GLYPH = {"compute": "#", "comm": "=", "wait": ".", "overhead": "+"}
COLOR = {"compute": "#4c78a8", "comm": "#f58518", "wait": "#d0d0d0", "overhead": "#b279a2"}


# An event is a ``simulate.SimEvent`` (which imports this module, hence ``Any``).
_Event = Any


def rows(events: Iterable[_Event]) -> dict[tuple[int, str], list[_Event]]:
    """The events by (rank, stream), ranks in order and ``main`` first on each."""
    by: dict[tuple[int, str], list[_Event]] = defaultdict(list)
    for e in events:
        by[(e.rank, e.stream)].append(e)
    return {k: by[k] for k in sorted(by, key=lambda k: (k[0], k[1] != "main", k[1]))}


def _span(events: Sequence[_Event]) -> tuple[float, float]:
    return min(e.start for e in events), max(e.end for e in events)


def _unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def text(events: Sequence[_Event], width: int = 72) -> str:
    """The terminal timeline of ``events``: a row of ``width`` cells per rank and stream."""
    if width < 8:
        raise ValueError(f"width must be at least 8 cells, not {width}")
    if not events:
        return "(no events)"
    t0, t1 = _span(events)
    total = max(t1 - t0, 1e-12)
    cell = total / width
    table = rows(events)
    label = max(len(f"rank {r} {s}") for r, s in table)
    scale, unit = _unit(total)
    lines = [f"{'':{label}} |0{'':{width - 2}}{total * scale:.3g} {unit}|".rstrip()]
    for (r, s), evs in table.items():
        busy = [[0.0] * width for _ in GLYPH]  # seconds of each kind per cell
        kinds = list(GLYPH)
        for e in evs:
            k = kinds.index(e.kind) if e.kind in GLYPH else 0
            a, b = (e.start - t0) / cell, (e.end - t0) / cell
            for i in range(max(0, int(a)), min(width, int(b) + 1)):
                busy[k][i] += max(0.0, min(b, i + 1) - max(a, i))
        row = "".join(
            " " if max(col) < 0.05 else GLYPH[kinds[col.index(max(col))]] for col in zip(*busy)
        )
        lines.append(f"{f'rank {r} {s}':{label}} |{row}|")
    lines.append(f"{'':{label}}  # compute   = communication   . waiting   (one cell "
                 f"{cell * scale:.3g} {unit})")  # fmt: skip
    return "\n".join(lines)


def save_png(events: Sequence[_Event], path: str | os.PathLike[str], title: str = "") -> str:
    """Draw ``events`` as horizontal bars, a row per rank and stream, into the PNG ``path``
    (matplotlib: ``pip install monarch-dsl[sim]``). Returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "a PNG timeline needs matplotlib: pip install 'monarch-dsl[sim]' (or matplotlib)"
        ) from e
    table = rows(events)
    t0 = _span(events)[0] if events else 0.0
    total = (_span(events)[1] - t0) if events else 0.0
    scale, unit = _unit(total or 1.0)
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(table) + 1.5))
    try:
        for y, evs in enumerate(table.values()):
            for kind, color in COLOR.items():
                spans = [((e.start - t0) * scale, (e.end - e.start) * scale) for e in evs
                         if e.kind == kind]  # fmt: skip
                if spans:
                    ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=color, label=kind)
        ax.set_yticks(range(len(table)), [f"rank {r} {s}" for r, s in table])
        ax.invert_yaxis()
        ax.set_xlabel(f"time ({unit})")
        handles: dict[str, Any] = {}
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
        if handles:
            ax.legend(handles.values(), handles.keys(), loc="upper right", fontsize="small")
        if title:
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return os.fspath(path)
