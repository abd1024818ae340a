"""Property-based fuzzing of `kvtier serve` from its own OpenAPI schema (schemathesis): whatever
the body, no 5xx and no hang (every call has a timeout)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.core.result import Err

pytestmark = pytest.mark.slow  # (a server of its own and ~20 s of fuzzing: CI runs it with -m slow)


@pytest.fixture(scope="module")
def served(procs, moe_model):
    # a small context bounds the work any generated request can ask for
    return procs(["serve", moe_model, "--max-model-len", 96, "--served-model-name", "moe"], "fuzz").wait_ready()


def test_no_server_error_for_any_request(served):
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    failures, calls = [], []
    for op in schema.get_all_operations():
        if isinstance(op, Err):
            raise op.err()  # the server's schema has an operation schemathesis cannot read
        operation = op.ok()

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def fuzz(case):
            resp = case.call(base_url=served.url, timeout=30)
            calls.append(resp.status_code)
            if resp.status_code >= 500:
                failures.append((case.method, case.path, case.body, resp.status_code, resp.text[:300]))

        fuzz()
    assert not failures, failures[:5]
    assert len(calls) >= 100 and any(c == 200 for c in calls) and any(c == 400 for c in calls), calls


def test_it_really_reaches_the_engine(served):
    """The fuzz above is worth something only if valid bodies get through: one check by hand."""
    import httpx

    r = httpx.post(served.url + "/v1/completions", json={"model": "moe", "prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
