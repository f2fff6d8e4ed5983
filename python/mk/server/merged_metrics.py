"""The /metrics page of a data-parallel server (mk.server.replicas): every replica's page in one, each
sample labelled with its `replica` (the same families as one server's page, one series per replica)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

LABEL = "replica"


def merge_pages(pages: dict[str, str]) -> bytes:
    """One Prometheus text page of `pages` (replica -> its page), families in the first page's order."""
    families: dict[str, Metric] = {}
    for replica, page in pages.items():
        for family in text_string_to_metric_families(page):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            families[family.name].samples += [s._replace(labels={**s.labels, LABEL: replica}) for s in family.samples]
    return generate_latest(_Families(list(families.values())))


class _Families:
    """What generate_latest reads: a registry's collect()."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
