"""LoRA adapters over HTTP on the real stack (two gateways, one worker group, real Redis): the
`openai` SDK selects one with `model`, huggingface_hub's InferenceClient with TGI's
`adapter_id` (the `text-generation` client, 0.7.0, has no such field); greedy outputs equal
transformers + PEFT. Adapters enter with --lora-adapters and at run time through vLLM's
load/unload routes, and both gateways agree on the set."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import time

import httpx
import openai
import pytest
import torch
from huggingface_hub import InferenceClient

from tests.e2e.test_pipeline import prompt_text
from tests.support.cluster import Cluster
from tests.support.reference import greedy_continuation, tokenizer

pytestmark = pytest.mark.integration
EOS = 2  # tiny_llama's
NEW_TOKENS = 8
SPECS = {
    "a": dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=8, target_modules=["gate_proj", "down_proj", "o_proj"]),
    "c": dict(r=2, lora_alpha=8, target_modules="all-linear"),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    paths = {}
    for seed, (name, kwargs) in enumerate(SPECS.items()):
        torch.manual_seed(200 + seed)
        model = AutoModelForCausalLM.from_pretrained(tiny_llama)
        get_peft_model(model, LoraConfig(init_lora_weights=False, **kwargs)).save_pretrained(
            root / name
        )
        paths[name] = str(root / name)
    return paths


@pytest.fixture(scope="module")
def cluster(redis_url, tiny_llama, adapters):
    flags = ["--lora-adapters", f"a={adapters['a']},b={adapters['b']}", "--max-loras", "2"]
    cluster = Cluster(redis_url, "e2e-lora", tiny_llama, num_gateways=2, args=flags)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def expected_text(
    tiny_llama, adapter_path: str | None, prompt: str, new_tokens: int = NEW_TOKENS
) -> tuple[list[int], str]:
    """transformers + PEFT greedy ids and text for a text prompt (BOS added, as /generate)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, adapter_path).eval()
    hf = tokenizer(tiny_llama)
    ids = greedy_continuation(model, hf(prompt).input_ids, new_tokens, [EOS])
    prefix = hf.decode(hf(prompt).input_ids, skip_special_tokens=True)
    text = hf.decode(hf(prompt).input_ids + ids, skip_special_tokens=True)[len(prefix) :]
    return ids, text


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def complete(url: str, model: str, prompt: str) -> openai.types.Completion:
    return sdk(url).completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
    )


def metric(url: str, name: str, labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    selector = f"{{{labels}}}" if labels else ""
    match = re.search(rf"^{name}(?:_total)?{selector} ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_openai_model_selects_the_adapter_and_equals_peft(cluster, tiny_llama, adapters):
    url = cluster.gateway_urls[0]
    prompt = prompt_text(3, 6)
    outputs = {}
    for name in ("a", "b"):
        _, text = expected_text(tiny_llama, adapters[name], prompt)
        answer = complete(url, name, prompt)
        assert answer.model == name
        assert answer.choices[0].text == text, name
        outputs[name] = text
    _, base = expected_text(tiny_llama, None, prompt)
    assert complete(url, "tgi", prompt).choices[0].text == base
    assert len({base, *outputs.values()}) == 3  # the adapters change the output
    chat = sdk(url).chat.completions.create(
        model="a", messages=[{"role": "user", "content": prompt}], max_tokens=4, temperature=0
    )
    assert chat.model == "a"
    assert metric(url, "textgen_adapter_requests", 'adapter="a"') >= 2
    worker = cluster.ops_urls["worker-g0"]
    assert metric(worker, "textgen_worker_lora_loads", 'adapter="a"') >= 1
    assert metric(worker, "textgen_worker_lora_tokens", 'adapter="b"') >= 1


def test_concurrent_requests_of_every_adapter_and_the_base(cluster, tiny_llama, adapters):
    """Eight requests at once over both gateways; max_loras 2 holds both adapters."""
    prompts = [prompt_text(i, 5) for i in range(2)]
    jobs = [(model, p) for p in prompts for model in ("a", "b", "tgi", "a")]
    paths = {"a": adapters["a"], "b": adapters["b"], "tgi": None}
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [
            pool.submit(complete, cluster.gateway_urls[i % 2], model, prompt)
            for i, (model, prompt) in enumerate(jobs)
        ]
        answers = [f.result() for f in futures]
    for (model, prompt), answer in zip(jobs, answers, strict=True):
        assert answer.choices[0].text == expected_text(tiny_llama, paths[model], prompt)[1]


def test_tgi_adapter_id_with_inference_client(cluster, tiny_llama, adapters, online):
    url = cluster.gateway_urls[1]
    client = InferenceClient(base_url=url)
    prompt = prompt_text(5, 6)
    ids, _ = expected_text(tiny_llama, adapters["b"], prompt)
    output = client.text_generation(prompt, max_new_tokens=NEW_TOKENS, details=True, adapter_id="b")
    assert [t.id for t in output.details.tokens] == ids
    streamed = client.text_generation(
        prompt, max_new_tokens=NEW_TOKENS, details=True, stream=True, adapter_id="b"
    )
    assert [event.token.id for event in streamed] == ids
    # TGI's behaviour: an unknown adapter_id runs the base model
    base_ids, _ = expected_text(tiny_llama, None, prompt)
    other = client.text_generation(prompt, max_new_tokens=NEW_TOKENS, details=True, adapter_id="x")
    assert [t.id for t in other.details.tokens] == base_ids
    assert metric(url, "textgen_unknown_adapter_requests", "") >= 1


def test_models_info_and_unknown_model(cluster):
    for url in cluster.gateway_urls:  # both gateways read one registry
        listed = sdk(url).models.list().data
        assert [m.id for m in listed][1:] == ["a", "b"]
        assert all(m.parent == listed[0].id for m in listed[1:])
        info = httpx.get(f"{url}/info", timeout=10).json()
        assert info["lora_adapters"] == ["a", "b"] and info["max_loras"] == 2
    with pytest.raises(openai.NotFoundError) as caught:
        complete(cluster.gateway_urls[0], "zzz", "hello")
    assert caught.value.body["message"] == "The model `zzz` does not exist."
    assert caught.value.body["code"] == "model_not_found"


def test_load_and_unload_at_run_time(cluster, tiny_llama, adapters):
    first, second = cluster.gateway_urls
    prompt = prompt_text(8, 6)
    _, base = expected_text(tiny_llama, None, prompt)
    _, with_c = expected_text(tiny_llama, adapters["c"], prompt)
    body = {"lora_name": "c", "lora_path": adapters["c"]}
    loaded = httpx.post(f"{first}/v1/load_lora_adapter", json=body, timeout=30)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'c' added successfully."
    again = httpx.post(f"{second}/v1/load_lora_adapter", json=body, timeout=30)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert complete(second, "c", prompt).choices[0].text == with_c  # the other gateway knows it
    # a third adapter with two slots: a or b is evicted, every output still right
    assert (
        complete(first, "a", prompt).choices[0].text
        == expected_text(tiny_llama, adapters["a"], prompt)[1]
    )
    unloaded = httpx.post(f"{second}/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=30)
    assert unloaded.status_code == 200, unloaded.text
    for url in cluster.gateway_urls:
        with pytest.raises(openai.NotFoundError):
            complete(url, "c", prompt)
    assert complete(first, "tgi", prompt).choices[0].text == base
    gone = httpx.post(f"{first}/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=30)
    assert gone.status_code == 404
    # the worker drops it at its next heartbeat (once a second)
    worker = cluster.ops_urls["worker-g0"]
    deadline = time.monotonic() + 10
    while metric(worker, "textgen_worker_lora_evictions", 'adapter="c"') < 1:
        assert time.monotonic() < deadline, "the worker still holds the unloaded adapter"
        time.sleep(0.2)


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"lora_name": "d", "lora_path": "/nonexistent"}, 400, "no adapter_config.json"),
        ({"lora_name": "tgi", "lora_path": "/nonexistent"}, 400, "names the base model"),
        ({"lora_name": "bad name", "lora_path": "/x"}, 400, "invalid LoRA adapter name"),
        ({"lora_name": "d"}, 400, "lora_path"),
    ],
)
def test_load_refuses_bad_adapters(cluster, body, status, words):
    answer = httpx.post(f"{cluster.gateway_urls[0]}/v1/load_lora_adapter", json=body, timeout=30)
    assert answer.status_code == status
    assert words in answer.text


def test_adapter_routes_need_the_api_key(cluster, adapters):
    url = cluster.add_gateway("--api-key", "Secret123")
    body = {"lora_name": "d", "lora_path": adapters["c"]}
    refused = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30)
    assert refused.status_code == 401
    refused = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=30)
    assert refused.status_code == 401
    assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]][1:] == [
        "a",
        "b",
    ]


def test_a_tensor_parallel_group_applies_adapters(own_cluster, tiny_llama, adapters):
    """--num-shard 2 (gloo): each rank applies its slice of every adapter (B's rows of a
    column-parallel layer, A's columns of a row-parallel one, those shares summed); outputs
    equal PEFT's, adapters and the base model mixed in one batch."""
    spec = f"a={adapters['a']},b={adapters['b']}"
    cluster = own_cluster("--num-shard", "2", "--lora-adapters", spec, num_groups=1)
    url = cluster.gateway_urls[0]
    prompts = [prompt_text(i, 6) for i in range(2)]
    jobs = [(model, p) for p in prompts for model in ("a", "b", "tgi")]
    paths = {"a": adapters["a"], "b": adapters["b"], "tgi": None}
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(url, *job), jobs))
    for (model, prompt), answer in zip(jobs, answers, strict=True):
        assert answer.choices[0].text == expected_text(tiny_llama, paths[model], prompt)[1], model


def test_adapter_streams_survive_a_dead_worker_group(own_cluster, tiny_llama, adapters):
    """kill -9 of a worker group while streams of two adapters and the base model run: each
    resumes on the other group (which loads the adapter it names) token for token. The kill
    comes once g0 runs one of them: the gateways route adapter requests to the least busy
    holder, and on a slow host g1 took five of the six (g0 never ran two at once)."""
    from tests.e2e.test_failover import run_while_killing

    spec = f"a={adapters['a']},b={adapters['b']}"
    cluster = own_cluster(
        "--lora-adapters", spec, "--claim-timeout", "2", "--max-batch-size", "4", num_gateways=2
    )
    cases = [(["a", "b", None][i % 3], prompt_text(i, 4 + i), 120 + 10 * i) for i in range(6)]
    results = run_while_killing(cluster, "worker-g0", [(p, n, a) for a, p, n in cases], busy=1)
    for (adapter, prompt, n), events in zip(cases, results, strict=True):
        assert "error" not in events[-1], events[-1]
        assert [e["index"] for e in events] == list(range(1, len(events) + 1))
        path = adapters[adapter] if adapter else None
        assert [e["token"]["id"] for e in events] == expected_text(tiny_llama, path, prompt, n)[0]


def holders(cluster: Cluster, adapter_name: str) -> list[str]:
    """The groups whose heartbeat lists the adapter (read from Redis)."""
    import redis

    from shared.channels import Channels
    from shared.codec import decode
    from shared.messages import AdapterRef, Heartbeat

    channels = Channels(cluster.namespace)
    client = redis.Redis.from_url(cluster.redis_url)
    ref = decode(client.hget(channels.adapters, adapter_name), AdapterRef)
    beats = {g: client.get(channels.heartbeat(g)) for g in cluster.groups}
    return [g for g, beat in beats.items() if beat and ref.id in decode(beat, Heartbeat).adapters]


def wait_for_holder(cluster: Cluster, adapter_name: str, timeout: float = 15.0) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if found := holders(cluster, adapter_name):
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no group lists adapter {adapter_name} in its heartbeat")


def test_requests_go_to_the_group_holding_their_adapter(own_cluster, tiny_llama, adapters):
    """Two idle groups: once one holds adapter a (its first request loaded it), later requests
    for a are routed to it, so a concurrent burst (which the two groups would otherwise share
    from the lane) never loads a into the other. When the holder's machine dies (worker and
    scheduler, kill -9), requests for a still complete: those routed there before its
    heartbeat expired are taken over from its stream, later ones take the lane; the other
    group loads a."""
    cluster = own_cluster("--lora-adapters", f"a={adapters['a']}", num_groups=2)
    url = cluster.gateway_urls[0]
    first = prompt_text(0, 5)
    want = expected_text(tiny_llama, adapters["a"], first)[1]
    assert complete(url, "a", first).choices[0].text == want
    holder = wait_for_holder(cluster, "a")
    other = next(g for g in cluster.groups if g != holder)
    time.sleep(1.2)  # the gateway's view of the holders is at most a second old

    def burst(count: int, offset: int) -> None:
        prompts = [prompt_text(offset + i, 4 + i % 3) for i in range(count)]
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            answers = list(pool.map(lambda p: complete(url, "a", p), prompts))
        for prompt, answer in zip(prompts, answers, strict=True):
            want = expected_text(tiny_llama, adapters["a"], prompt)[1]
            assert answer.choices[0].text == want, prompt

    burst(8, 1)
    loads = {
        g: metric(cluster.ops_urls[f"worker-{g}"], "textgen_worker_lora_loads", 'adapter="a"')
        for g in cluster.groups
    }
    assert loads == {holder: 1.0, other: 0.0}
    assert metric(url, "textgen_routed_adapter_requests", "") >= 8
    for service in ("scheduler", "worker"):
        cluster.processes[f"{service}-{holder}"].send_signal(signal.SIGKILL)
    burst(4, 20)  # routed to the dead group at first, then to the lane
    taken_over = metric(
        cluster.ops_urls[f"scheduler-{other}"], "textgen_scheduler_orphaned_routed_requests", ""
    )
    assert taken_over >= 1
    deadline = time.time() + 10  # the dead holder's heartbeat expires, the other's lists a
    while holders(cluster, "a") != [other] and time.time() < deadline:
        time.sleep(0.2)
    assert holders(cluster, "a") == [other]
