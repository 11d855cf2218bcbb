"""vLLM's other request paths, which the gateway passes through rather than routes by prediction.

Embeddings, tokenizing, scoring and the like are answered by any one endpoint alone; the gateway sends each to the
endpoint with the fewest requests (as last scraped, plus those it passed there since that are still open), and
neither predicts nor learns from them. Stateful and administrative paths (`/v1/responses`, LoRA loading, cache
resets) are not passed: sent through a router, they would reach one endpoint of many.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from leadtime.router_plugin.discovery import DiscoveredEndpoint
from leadtime.router_plugin.scrape import EndpointScrape

PASSED_THROUGH = frozenset(
    (
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    )
)


@dataclass
class PassedThroughLoad:
    """Where passed-through requests go: the least loaded of the endpoints that serve clients, ties in turn."""

    open: dict[str, int] = field(default_factory=dict)
    """Per endpoint, the passed-through requests still open there (an endpoint with none has no entry)."""
    _turn: int = 0

    def choose(self, scrapes: Iterable[EndpointScrape], excluded: set[str]) -> DiscoveredEndpoint | None:
        """Of the endpoints serving clients now (scraped, not prefill-only, not swapped out), the least loaded."""
        serving = [
            s
            for s in scrapes
            if s.state is not None
            and s.endpoint.endpoint_id not in excluded
            and s.state.role != "prefill"
            and s.state.timeslice_state in ("none", "resident")
        ]
        if not serving:
            return None
        self._turn += 1

        def load(item: tuple[int, EndpointScrape]) -> tuple[int, int]:
            i, s = item
            assert s.state is not None
            busy = s.state.num_request_waiting + s.state.num_request_running + self.open.get(s.endpoint.endpoint_id, 0)
            return busy, (i - self._turn) % len(serving)

        return min(enumerate(serving), key=load)[1].endpoint

    def opened(self, endpoint_id: str) -> None:
        self.open[endpoint_id] = self.open.get(endpoint_id, 0) + 1

    def closed(self, endpoint_id: str) -> None:
        """One request passed to `endpoint_id` is done. An endpoint left with none goes: in Kubernetes endpoint names
        are pod names, and every rollout would add entries at 0 for ever."""
        left = self.open[endpoint_id] - 1
        if left:
            self.open[endpoint_id] = left
        else:
            del self.open[endpoint_id]
