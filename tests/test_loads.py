"""Load, as gateways read it from the shim: vLLM's gauges on /metrics (what SMG scrapes from a
vLLM worker), SMG's /v1/loads, vllm-router's /get_load. No API key needed: they name no
tenant's data."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_until


def vllm_gauges(url: str) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        assert family.type == "gauge"
        for sample in family.samples:
            assert sample.labels == {"engine": "0", "model_name": "kvbank"}
            out[sample.name] = sample.value
    return out


def test_loads_follow_the_requests_in_flight(stack):
    url = stack.shim_url
    idle = vllm_gauges(url)
    assert idle == {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
                    "vllm:kv_cache_usage_perc": 0.0}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    stream = client.chat.completions.create(
        model="kvbank", stream=True, max_tokens=1500,
        messages=[{"role": "user", "content": "Write a long story about a lighthouse."}])
    next(iter(stream))  # it is generating
    busy = wait_until(lambda: (g := vllm_gauges(url))["vllm:num_requests_running"] == 1 and g,
                      "the running request in vllm:num_requests_running")
    assert 0 < busy["vllm:kv_cache_usage_perc"] <= 1
    loads = httpx.get(f"{url}/v1/loads", timeout=10).json()
    (rank,) = loads["loads"]
    assert loads["dp_rank_count"] == 1 and isinstance(loads["timestamp"], str)
    assert rank["dp_rank"] == 0 and rank["num_running_reqs"] == 1
    assert rank["num_total_reqs"] == rank["num_running_reqs"] + rank["num_waiting_reqs"]
    assert 0 < rank["num_used_tokens"] <= rank["max_total_num_tokens"]
    assert isinstance(rank["max_running_requests"], int) and rank["max_running_requests"] >= 1
    assert httpx.get(f"{url}/get_load", timeout=10).json() == {"load": 1}
    stream.close()  # the client goes away: its generation is cancelled
    wait_until(lambda: vllm_gauges(url)["vllm:num_requests_running"] == 0,
               "the cancelled request to leave vllm:num_requests_running")
    assert httpx.get(f"{url}/get_load", timeout=10).json() == {"load": 0}
