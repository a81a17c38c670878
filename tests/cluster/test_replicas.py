"""kvboost serve --replicas on a local Ray cluster (cluster/deploy.py, cluster/router.py): two replicas of a tiny
model behind the ingress. A conversation's turns stay on the replica holding its K/V (and reuse it), a Responses turn
continues on the replica that stored the response, the server's endpoints answer through the ingress, and a replica
killed mid-stream ends its client's stream with an error (never a hang) while Ray restarts it and others serve on."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.ray

from kvboost.cluster.deploy import REPLICA_HEADER, ReplicaSpec, build_app  # noqa: E402
from kvboost.server.background import bind_socket  # noqa: E402
from kvboost.server.settings import ServerSettings  # noqa: E402

from ..tiny_models import make_tiny_model  # noqa: E402

STREAM_TOKENS = 200
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
        # One request at a time per replica: a stream's tokens are those of the same request sent alone.
        settings = ServerSettings(model=str(folder), served_model_name="m", max_batch_size=1)
        disk = tmp_path_factory.mktemp("disk")  # each replica writes behind to disk/replica-<rank>
        spec = ReplicaSpec(settings, {"chunk_size": 16, "device": "cpu", "disk_cache_dir": str(disk)})
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


def test_a_turn_goes_to_its_kv_even_when_that_replica_is_busier(http, base_url):
    """Below the imbalance threshold the replica holding the history wins over an idle one (routing by load alone
    would send the turn to the idle replica and lose the history)."""
    system = "You are the archivist of an old library. Answer in one sentence. " * 4
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Where are the maps?"}]
    holder = _chat(http, messages).headers[REPLICA_HEADER]
    busy = threading.Event()
    out: dict = {}
    story = [messages[0], {"role": "user", "content": "Tell a long story."}]
    long = threading.Thread(target=_stream, args=(base_url, story, busy, out), daemon=True)
    long.start()  # shares the system prompt: routed to the holder, which is then busier than the other replica
    assert busy.wait(60)
    messages += [{"role": "assistant", "content": "In the east wing."}, {"role": "user", "content": "And the globes?"}]
    r = _chat(http, messages)
    long.join(120)
    assert out["replica"] == holder and r.headers[REPLICA_HEADER] == holder
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48


def test_the_servers_endpoints_answer_through_the_ingress(http, base_url):
    assert http.get("/health").json()["status"] == "ok"
    metrics = http.get("/metrics").text  # every replica that has answered, each sample labelled with it
    served = {line.split('replica="')[1].split('"')[0] for line in metrics.splitlines()
              if line.startswith("vllm:num_requests_running{")}
    assert served and served <= _replica_ids()
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


def _replica_ids() -> set[str]:
    return {a["name"].rsplit("#", 1)[-1] for a in ray.util.list_named_actors(all_namespaces=True)
            if "kvboost-replica" in a["name"]}


def _running_replicas() -> int:
    status = serve.status().applications["kvboost"].deployments["kvboost-replica"]
    return status.replica_states.get("RUNNING", 0)


def _stream(base_url: str, prompt: str | list[dict], started: threading.Event, out: dict) -> None:
    """One streaming client (a completion, or a chat for a list of messages): its status, replica, text, and the
    error event that ended it (if one did)."""
    chat = isinstance(prompt, list)
    body = {"model": "m", ("messages" if chat else "prompt"): prompt, "max_tokens": STREAM_TOKENS,
            "temperature": 0, "logit_bias": {"2": -100}, "stream": True}
    try:
        with httpx.stream("POST", f"{base_url}/v1/{'chat/' if chat else ''}completions", json=body, timeout=120) as r:
            out["status"], out["replica"], out["text"] = r.status_code, r.headers.get(REPLICA_HEADER), ""
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                    break
                choice = event["choices"][0]
                out["text"] += (choice["delta"].get("content") or "") if chat else choice["text"]
                started.set()
            if r.status_code != 200:
                out["error"] = json.loads(r.read())["error"]
    except Exception as exc:  # a broken connection or a timeout: neither a 200 nor a clean error
        out["failure"] = repr(exc)


def test_a_replica_killed_under_16_streams_leaves_no_hung_or_wrong_output(base_url, http):
    prompts = [f"Story {i}: once upon a time, in a village by the sea, there lived" for i in range(16)]
    reference = {}
    for p in prompts:  # each alone, not streamed: what each stream must say if it completes
        r = http.post("/v1/completions", json={"model": "m", "prompt": p, "max_tokens": STREAM_TOKENS,
                                               "temperature": 0, "logit_bias": {"2": -100}})
        reference[p] = r.json()["choices"][0]["text"]
    results = [{} for _ in prompts]
    started = [threading.Event() for _ in prompts]
    clients = [threading.Thread(target=_stream, args=(base_url, p, s, out), daemon=True)
               for p, s, out in zip(prompts, started, results)]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 60
    while not any(s.is_set() for s in started) and time.monotonic() < deadline:
        time.sleep(0.005)
    victim = next(out["replica"] for out, s in zip(results, started) if s.is_set())  # one streaming right now
    before = _replica_ids()
    ray.kill(_replica_actor(victim), no_restart=False)
    for c in clients:
        c.join(timeout=180)
    assert not any(c.is_alive() for c in clients)  # no client hangs
    assert not [out["failure"] for out in results if "failure" in out]  # every client: a 200 or a clean error
    done = [(p, out) for p, out in zip(prompts, results) if "error" not in out]
    errors = [out["error"] for out in results if "error" in out]
    assert all(out["status"] == 200 and out["text"] == reference[p] for p, out in done)  # no wrong output
    assert errors and all(e["code"] in ("replica_failed", "replica_unavailable") for e in errors)
    assert len(done) >= 8  # the survivor (and the restarted replica) served the rest
    # Ray brings the killed replica back; the deployment serves on.
    deadline = time.monotonic() + 120
    while _running_replicas() < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert _running_replicas() == 2
    assert _chat(http, [{"role": "user", "content": "Still there?"}]).status_code == 200
    # The replacement took the killed replica's rank, so its disk directory: what was written behind is there.
    (replacement,) = _replica_ids() - before
    stats = http.get("/v1/stats", headers={REPLICA_HEADER: replacement})
    assert stats.headers[REPLICA_HEADER] == replacement
    assert stats.json()["cache"]["tiers"]["disk"]["entries"] > 0


def test_the_config_file_builder_makes_the_same_application_and_refuses_unknown_args():
    from kvboost.cluster.deploy import build

    app = build({"replicas": 3, "imbalance": 2, "server": {"model": "some/model", "max_batch_size": 8},
                 "engine": {"chunk_size": 64}})
    assert type(app).__name__ == "Application"
    with pytest.raises(ValueError, match="unknown args \\['replica'\\]"):
        build({"replica": 2})
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        build({"replicas": 0})
