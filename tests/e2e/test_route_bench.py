"""``tierkv bench route`` on a small chat trace against NVIDIA Dynamo's real KV indexer
(``ai-dynamo-runtime`` 1.6.1, the tests' venv): routed by Dynamo, two sidecars save exactly the
prefix tokens an oracle asking each sidecar saves, choosing the same worker every time, and at
least what round-robin saves; Dynamo's match of the chosen worker always equals that sidecar's
own lookup."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.dynamo_indexer import dynamo_python
from tierkv.bench.route_bench import RouteBenchConfig, run_route_bench
from tierkv.bench.traces import synthetic


@pytest.mark.slow
def test_dynamo_routes_as_the_oracle_and_saves_at_least_round_robins_tokens(
        tmp_path: Path) -> None:
    requests = synthetic("chat", 60, seed=45)
    results = {r.policy: r for r in run_route_bench(
        requests, RouteBenchConfig(tmp_path, dynamo_python()))}
    dynamo, oracle, round_robin = results["dynamo"], results["oracle"], results["round-robin"]
    assert dynamo.match_disagreements == 0  # Dynamo's match is the sidecar's lookup, exactly
    assert dynamo.unsettled == 0
    assert dynamo.prompt_tokens == oracle.prompt_tokens == round_robin.prompt_tokens
    # Exact events and the same tie rule: the oracle's choices, and so its hits.
    assert dynamo.oracle_agreements == len(requests)
    assert dynamo.hit_tokens == oracle.hit_tokens
    assert dynamo.hit_tokens >= round_robin.hit_tokens
    assert round_robin.hit_tokens > 0  # the sidecars did hold what was put
