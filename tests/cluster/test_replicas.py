"""kvboost serve --replicas on a local Ray cluster (cluster/deploy.py, cluster/router.py): two replicas of a tiny
model behind the ingress. A conversation's turns stay on the replica holding its K/V (and reuse it), a Responses turn
continues on the replica that stored the response, the server's endpoints answer through the ingress, and a replica
killed mid-stream ends its client's stream with an error (never a hang) while Ray restarts it and others serve on."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")
serve = pytest.importorskip("ray.serve")

from kvboost.cluster.deploy import REPLICA_HEADER, ReplicaSpec, build_app  # noqa: E402
from kvboost.server.background import bind_socket  # noqa: E402
from kvboost.server.settings import ServerSettings  # noqa: E402

from ..tiny_models import make_tiny_model  # noqa: E402

SYSTEMS = [f"You are assistant number {i}. Answer every question about {topic} in one short sentence. " * 3
           for i, topic in enumerate(("rivers", "mountains", "deserts"))]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 << 20,
             runtime_env={"env_vars": {"KVBOOST_AOT": "0"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ServerSettings(model=str(folder), served_model_name="m", max_batch_size=4)
        spec = ReplicaSpec(settings, {"chunk_size": 16, "device": "cpu"})
        serve.run(build_app(spec, 2, cpus_per_replica=1, stats_period_s=0.5), name="kvboost", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def _chat(http, messages, **extra) -> httpx.Response:
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 6,
                                                "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r


def test_a_conversation_stays_on_the_replica_holding_its_kv(http):
    for system in SYSTEMS:
        messages = [{"role": "system", "content": system}]
        served_by, previous_prompt = None, 0
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn}: name one example."})
            r = _chat(http, messages)
            usage = r.json()["usage"]
            if served_by is None:
                served_by = r.headers[REPLICA_HEADER]
            else:
                assert r.headers[REPLICA_HEADER] == served_by
                # everything the previous turn computed, but the tail of its last (incomplete) chunk
                assert usage["prompt_tokens_details"]["cached_tokens"] >= previous_prompt - 16
            previous_prompt = usage["prompt_tokens"] + usage["completion_tokens"]
            messages.append(r.json()["choices"][0]["message"])
            time.sleep(0.6)  # a routing report in between (stats every 0.5 s)


def test_the_servers_endpoints_answer_through_the_ingress(http, base_url):
    assert http.get("/health").json()["status"] == "ok"
    assert "vllm:num_requests_running" in http.get("/metrics").text
    assert http.post("/v1/chat/completions", json={"model": "m", "messages": []}).status_code == 400
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                            temperature=0, stream=True)
    assert len([c for c in stream if c.choices and c.choices[0].delta.content]) >= 1


def test_a_response_continues_on_the_replica_that_stored_it(base_url, http):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    first = client.responses.with_raw_response.create(model="m", instructions=SYSTEMS[0], input="Name a river.",
                                                      max_output_tokens=6, temperature=0)
    stored_on, response = first.headers[REPLICA_HEADER], first.parse()
    for _ in range(3):  # wherever the keys alone would send it, the stored response pins it
        turn = client.responses.with_raw_response.create(model="m", previous_response_id=response.id,
                                                         input="And another?", max_output_tokens=6, temperature=0)
        assert turn.headers[REPLICA_HEADER] == stored_on
        assert turn.parse().usage.input_tokens_details.cached_tokens > 0
    got = http.get(f"/v1/responses/{response.id}")
    assert got.status_code == 200 and got.headers[REPLICA_HEADER] == stored_on


def _replica_actor(unique_id: str):
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(unique_id) and "kvboost-replica" in actor["name"]:
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise LookupError(unique_id)


def _running_replicas() -> int:
    status = serve.status().applications["kvboost"].deployments["kvboost-replica"]
    return status.replica_states.get("RUNNING", 0)


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error(base_url, http):
    body = {"model": "m", "messages": [{"role": "user", "content": "Count for a long time."}], "max_tokens": 900,
            "temperature": 0, "logit_bias": {"2": -100}, "stream": True}
    t0 = time.monotonic()
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        victim = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        ray.kill(_replica_actor(victim), no_restart=False)
        rest = [line for line in lines if line.startswith("data:")]
    assert time.monotonic() - t0 < 60
    assert rest and '"replica_failed"' in rest[-1]  # the last event says the output is incomplete
    # The other replica serves meanwhile; Ray brings the killed one back.
    r = _chat(http, [{"role": "user", "content": "Still there?"}])
    assert r.headers[REPLICA_HEADER] != victim
    deadline = time.monotonic() + 120
    while _running_replicas() < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert _running_replicas() == 2


def test_the_config_file_builder_makes_the_same_application_and_refuses_unknown_args():
    from kvboost.cluster.deploy import build

    app = build({"replicas": 3, "imbalance": 2, "server": {"model": "some/model", "max_batch_size": 8},
                 "engine": {"chunk_size": 64}})
    assert type(app).__name__ == "Application"
    with pytest.raises(ValueError, match="unknown args \\['replica'\\]"):
        build({"replica": 2})
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        build({"replicas": 0})
