"""Reading ``/metrics`` in tests: the Prometheus text parsed into samples, summed by labels."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Samples:
    """Every sample of one scrape, and the text it came from."""

    text: str
    samples: tuple[tuple[str, Mapping[str, str], float], ...]

    @classmethod
    def parse(cls, text: str) -> Samples:
        samples = tuple(
            (sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        )
        return cls(text, samples)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples named ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(
            value
            for sample, sample_labels, value in self.samples
            if sample == name and all(sample_labels.get(k) == v for k, v in labels.items())
        )

    def has(self, name: str, **labels: str) -> bool:
        return any(
            sample == name and all(sample_labels.get(k) == v for k, v in labels.items())
            for sample, sample_labels, _ in self.samples
        )

    def type_lines(self, family: str) -> int:
        """How many ``# TYPE`` lines declare ``family`` (a name registered twice shows two)."""
        return len(re.findall(rf"^# TYPE {re.escape(family)} ", self.text, re.MULTILINE))


def scrape(base_url: str) -> Samples:
    response = httpx.get(f"{base_url}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return Samples.parse(response.text)
