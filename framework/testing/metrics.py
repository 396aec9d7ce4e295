"""Reading Prometheus ``/metrics`` text in tests."""

from __future__ import annotations


def metric_value(text: str, name: str, label: str | None = None) -> float:
    """The value of the Prometheus sample ``name`` in ``/metrics`` text: the first one, or the
    first whose labels contain ``label`` (e.g. ``'"abort"'``); 0.0 for an absent labelled sample
    (a counter not yet incremented), an assertion error for an absent metric."""
    import re

    labels = rf"\{{[^}}]*{re.escape(label)}[^}}]*\}}" if label else r"(?:\{[^}]*\})?"
    match = re.search(rf"^{re.escape(name)}{labels} (\S+)$", text, re.MULTILINE)
    if match is None and label is not None:
        return 0.0
    assert match, f"{name} not in /metrics"
    return float(match.group(1))
