"""`kvtier serve --kv-cache-dtype fp8`: /server_info says the cache's dtype and where its scales
came from; completions run on the fp8 cache."""

from __future__ import annotations

import httpx


def test_server_info_says_the_fp8_cache_and_its_calibrated_scales(procs, checkpoint):
    server = procs(["serve", checkpoint("llama-tiny"), "--kv-cache-dtype", "fp8", "--max-model-len", 256], "fp8").wait_ready()
    info = httpx.get(server.url + "/server_info", timeout=60).json()
    assert info["engine_config"]["kv_cache_dtype"] == "fp8"
    assert info["kv_cache"]["dtype"] == "fp8" and info["kv_cache"]["scales"] == "calibrated"
    assert len(info["kv_cache"]["digest"]) == 16
    body = {"model": info["model"], "prompt": [1, 2, 3, 4, 5], "max_tokens": 3, "temperature": 0}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert out["usage"]["completion_tokens"] == 3
