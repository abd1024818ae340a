"""No secret leaves a server or a router: a password planted in every URL option and both API
keys never appear in any endpoint's answer or in the log (`kvtier serve` and `kvtier router`
processes on 127.0.0.1, their pools unreachable on purpose: a dead pool's errors are where a
URL with its password is most likely to be printed)."""

from __future__ import annotations

import time

import httpx
import pytest

from kvtier.serve.launch import free_port

KEY, BACKEND_KEY = "client-key-4b1d", "backend-key-7e2a"
SECRETS = ("s3cretpw", "m00npw", "r0uterpw", "w0rkerpw", KEY, BACKEND_KEY)


def _storage_url() -> str:
    # a port nothing listens on: the pool is down from the start, its client logs its failures
    return f"redis://:s3cretpw@127.0.0.1:{free_port()}/0"


def _everything(url: str, headers: dict) -> dict[str, str]:
    """Every GET endpoint's answer, with and without the key, and some error answers."""
    paths = ("/health", "/metrics", "/server_info", "/kvtier/stats", "/v1/models", "/tokenizer_info", "/openapi.json")
    got = {}
    with httpx.Client(timeout=30) as c:
        for p in paths:
            got[p] = c.get(url + p, headers=headers).text
            got[p + " (no key)"] = c.get(url + p).text
        got["bad body"] = c.post(url + "/v1/completions", content=b"{", headers=headers).text
        got["bad model"] = c.post(url + "/v1/completions", json={"model": "x", "prompt": [1]}, headers=headers).text
        got["completion"] = c.post(
            url + "/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}, headers=headers
        ).text
    return got


def _leaks(texts: dict[str, str]) -> list[str]:
    return [f"{secret!r} in {where}" for where, text in texts.items() for secret in SECRETS if secret in text]


def test_no_endpoint_or_log_line_of_a_server_shows_a_password_or_key(procs, moe_model):
    server = procs(
        [
            "serve",
            moe_model,
            "--api-key",
            KEY,
            "--served-model-name",
            "m",
            "--max-model-len",
            256,
            "--storage",
            _storage_url(),
            "--num-host-blocks",
            64,
            "--log-stats-interval",
            0.2,
        ],
        "secrets-serve",
    )
    server.wait_ready()
    headers = {"Authorization": f"Bearer {KEY}"}
    texts = _everything(server.url, headers)
    assert '"engine_config"' in texts["/server_info"]  # (the configuration is shown: only its secrets are not)
    assert "redis://:***@" in texts["/server_info"], texts["/server_info"][:2000]
    time.sleep(0.5)  # a stats line or two
    texts["log"] = server.log.read_text(errors="replace")
    assert "storage" in texts["log"]  # (the pool's failures are logged)
    assert not _leaks(texts)


def _health_once_the_pool_reported(url: str) -> str:
    """/health once the engine has reported its pool's state (it does every few seconds while it
    has work: a request each round gives it some)."""
    deadline = time.monotonic() + 60
    while True:
        httpx.post(url + "/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 1}, timeout=30)
        r = httpx.get(url + "/health", timeout=30)
        if "failures_in_a_row" in r.json()["pool"] or time.monotonic() > deadline:
            return r.text
        time.sleep(0.2)


def test_health_and_metrics_show_no_path_or_host_unless_asked(procs, moe_model):
    server = procs(
        [
            "serve",
            moe_model,
            "--served-model-name",
            "m",
            "--max-model-len",
            256,
            "--storage",
            _storage_url(),
            "--num-host-blocks",
            64,
        ],
        "secrets-quiet",
    )
    server.wait_ready()
    health = _health_once_the_pool_reported(server.url)
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert '"failures_in_a_row"' in health  # the pool's state is there, not where it is
    for text in (health, metrics):
        assert str(moe_model) not in text and "127.0.0.1" not in text, text[:2000]


def test_expose_config_puts_the_paths_and_hosts_back_without_secrets(procs, moe_model):
    server = procs(
        [
            "serve",
            moe_model,
            "--served-model-name",
            "m",
            "--max-model-len",
            256,
            "--storage",
            _storage_url(),
            "--num-host-blocks",
            64,
            "--expose-config",
        ],
        "secrets-exposed",
    )
    server.wait_ready()
    health = _health_once_the_pool_reported(server.url)
    assert str(moe_model) in health and "127.0.0.1" in health, health
    assert "s3cretpw" not in health


def test_a_router_refuses_a_server_url_with_credentials_without_printing_them(tmp_path):
    import subprocess

    from kvtier.serve.launch import kvtier_command

    r = subprocess.run(
        kvtier_command("router", "--workers", "http://u:w0rkerpw@127.0.0.1:9"), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "--backend-api-key" in r.stderr and "http://u:***@127.0.0.1:9" in r.stderr, r.stderr
    assert "w0rkerpw" not in r.stdout + r.stderr


@pytest.mark.slow
def test_no_endpoint_or_log_line_of_a_router_shows_a_password_or_key(procs, moe_model):
    server = procs(
        ["serve", moe_model, "--api-key", BACKEND_KEY, "--served-model-name", "m", "--max-model-len", 256], "secrets-worker"
    ).wait_ready()
    router = procs(
        [
            "router",
            "--workers",
            server.url,
            "--api-key",
            KEY,
            "--backend-api-key",
            BACKEND_KEY,
            "--storage",
            f"redis://:r0uterpw@127.0.0.1:{free_port()}/0",
        ],
        "secrets-router",
    )
    router.wait_ready()
    texts = _everything(router.url, {"Authorization": f"Bearer {KEY}"})
    assert '"choices"' in texts["completion"]  # (the router served it)
    texts["log"] = router.log.read_text(errors="replace")
    assert "r0uterpw" in " ".join(router.args)  # (planted)
    assert not _leaks(texts)
