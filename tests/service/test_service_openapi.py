"""schemathesis against /openapi.json on the live app (a real Ray head behind it): a bounded
number of generated requests per operation, none may get a 5xx."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from service_support import AUTH, LiveServer, make_settings, ray_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# 9 operations take parameters (3 take none: one case each): ~30 x 9 + 3 = a few hundred cases.
MAX_EXAMPLES_PER_OPERATION = 30
CASES_RUN: list[str] = []


@pytest.fixture(scope="module")
def live_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("openapi")
    # Jobs the fuzzer manages to submit run from an empty working dir: Ray takes them (the
    # real submission path) and their entrypoint exits at once instead of training.
    empty = tmp / "empty-working-dir"
    empty.mkdir()
    with ray_cluster(tmp, num_cpus=1) as head:
        app_settings = make_settings(tmp / "db.sqlite", head, job_working_dir=empty)
        with LiveServer(app_settings) as server:
            yield server.url


@pytest.fixture(scope="module")
def api_schema(live_url: str) -> schemathesis.BaseSchema:
    loaded = schemathesis.openapi.from_url(f"{live_url}/openapi.json")
    # The coverage phase enumerates boundary values without a cap; keep the run bounded.
    loaded.config.phases.update(phases=["examples", "fuzzing"])
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


def test_openapi_has_stable_operation_ids(api_schema: schemathesis.BaseSchema) -> None:
    ids = {op.ok().definition.raw["operationId"] for op in api_schema.get_all_operations()}
    assert ids == {
        "create_job", "list_jobs", "get_job", "stop_job", "get_job_logs", "get_layer_metrics",
        "get_step_metrics", "get_metrics_summary", "stream_metrics", "prometheus_metrics",
        "healthz", "readyz",
    }  # fmt: skip


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_server_errors(case: schemathesis.Case, live_url: str) -> None:
    CASES_RUN.append(case.operation.label)
    case.call_and_validate(base_url=live_url, headers=AUTH, checks=[not_a_server_error], timeout=30)


@pytest.fixture(scope="module", autouse=True)
def _report_case_count() -> Iterator[None]:
    yield
    print(f"\nschemathesis: {len(CASES_RUN)} cases over {len(set(CASES_RUN))} operations, no 5xx")
