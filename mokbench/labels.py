"""Short names for tables and charts.

A scenario id (``kimi-k2-E48H7168I2048k8+se-T16384-ep1-bf16-uniform``) names every field that
changes the numbers, which makes it too long for an 80-column table or a chart's x axis. Within
one report only some fields vary, so a scenario's short label is its model name plus the fields
that tell the report's scenarios apart (``kimi-k2 T16384``); the fields they all share are said
once (``E48 H7168 I2048 k8 +se ep1 bf16 uniform``). Ids that do not parse keep their full
text, so a label is never ambiguous.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# The fields of Scenario.scenario_id, in its order.
ID_RE = re.compile(
    r"^(?P<model>.+)-E(?P<E>\d+)H(?P<H>\d+)I(?P<I>\d+)k(?P<k>\d+)(?P<se>\+se)?"
    r"-T(?P<T>\d+)-ep(?P<ep>\d+)-(?P<precision>[^-]+)-(?P<routing>[^-]+)$")
FIELDS = ("E", "H", "I", "k", "se", "T", "ep", "precision", "routing")


def scenario_fields(scenario_id: str) -> dict[str, str] | None:
    """The id's fields as display tokens (``{"model": "tiny", "E": "E8", ..., "se": "+se"}``),
    or None when the id does not parse."""
    m = ID_RE.match(scenario_id)
    if m is None:
        return None
    g = m.groupdict()
    tokens = {"model": g["model"], "se": "+se" if g["se"] else "no-se",
              "precision": g["precision"], "routing": g["routing"]}
    tokens.update({f: f"{f}{g[f]}" for f in ("E", "H", "I", "k", "T", "ep")})
    return tokens


SHAPE_FIELDS = ("E", "H", "I", "k")


def _varying(parsed: list[dict[str, str]]) -> list[str]:
    """Fields a label needs: a shape field where it differs between scenarios of the same
    model (the model name implies the rest), any other field where it differs at all."""
    out = []
    for f in FIELDS:
        if f in SHAPE_FIELDS:
            by_model: dict[str, set[str]] = {}
            for p in parsed:
                by_model.setdefault(p["model"], set()).add(p[f])
            if any(len(v) > 1 for v in by_model.values()):
                out.append(f)
        elif len({p[f] for p in parsed}) > 1:
            out.append(f)
    return out


def short_scenario_labels(scenario_ids: Iterable[str]) -> tuple[dict[str, str], str]:
    """(scenario id -> short label, the fields every parsed id shares as one string).

    The label is the model name and the fields that tell scenarios apart, joined by spaces (so
    tables and charts can wrap them); an id that does not parse is its own label.
    """
    ids = list(dict.fromkeys(scenario_ids))
    parsed = {s: scenario_fields(s) for s in ids}
    good = [p for p in parsed.values() if p is not None]
    varying = _varying(good) if len(good) > 1 else ["T"]  # one scenario: keep its tokens
    labels = {s: s if p is None else " ".join([p["model"], *(p[f] for f in varying)])
              for s, p in parsed.items()}
    if len(set(labels.values())) < len(labels):  # defensive: never merge two scenarios
        labels = {s: s for s in ids}
    shared = [f for f in FIELDS if f not in varying and len({p[f] for p in good}) == 1]
    common = " ".join(good[0][f] for f in shared) if good else ""
    return labels, common


def backend_display(label: str) -> str:
    """A backend label with a space after each option comma (``mok@a=1, b=2``) so a narrow
    column can wrap it between options instead of cutting it."""
    return label.replace(",", ", ")
