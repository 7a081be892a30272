"""How well predictions agree with measurements: the mean absolute percentage error and
Spearman's rank correlation (Pearson's correlation of the ranks, ties given their mean rank)."""
from __future__ import annotations


def mape(predicted: list[float], measured: list[float]) -> float:
    """mean |predicted - measured| / measured, in percent."""
    return 100 * sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(measured)


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    rx, ry = ranks(x), ranks(y)
    n = len(x)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx and vy else float("nan")
