"""Prefill/decode disaggregation with real processes on loopback: a prefill server, a decode server
and the proxy, NIXL over UCX/TCP between them. Greedy output through the proxy must equal the
single-instance oasis output of the same engine configuration (the prefill server answering a plain
request runs exactly that); the decode instance must hold at most half of each request's full KV in
its host memory; killing the prefill mid-request must end that request with a clear error and leave
the decode healthy with nothing held. (A decode going on with another prefill agent, and the lease
and release protocol, are checked in-process: test_disagg_engines.py; a restart here would cost a
third model load.)"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("nixl_cu12")  # the wheel in pyproject.toml on x86-64 Linux

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "oasiskv", "evals", "sample_pride_and_prejudice.txt")
# a 64-token budget (4 blocks) over a prompt of ~250 tokens: attention is sparse, blocks move every step
ENGINE = ["--kv-mode", "oasis", "--kv-budget", "64", "--sink-blocks", "1", "--local-blocks", "1", "--fetch-cap", "0.25",
          "--draft", "ngram", "--num-kv-blocks", "160", "--max-num-batched-tokens", "512", "--max-num-seqs", "4",
          "--dtype", "float32", "--device", "cpu"]
DECODE = ["--local-kv-blocks", "64", "--remote-cache-blocks", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, "UCX_TLS": "tcp", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "oasiskv.cli", *args, "--port", str(port), "--uvicorn-log-level", "warning"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not come up")


def serve(role: str, port: int) -> subprocess.Popen:
    return start(["serve", "--role", role, *ENGINE, *(DECODE if role == "decode" else [])], port)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f"oasiskv:{name}{{") or line.startswith(f"oasiskv:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.fixture(scope="module")
def cluster():
    ports = {name: free_port() for name in ("prefill", "decode", "proxy")}
    urls = {name: f"http://127.0.0.1:{p}" for name, p in ports.items()}
    procs = {"prefill": serve("prefill", ports["prefill"]), "decode": serve("decode", ports["decode"]),
             "proxy": start(["proxy", "--prefill", urls["prefill"], "--decode", urls["decode"]], ports["proxy"])}
    try:
        for name in ("proxy", "prefill", "decode"):
            wait_healthy(procs[name], urls[name])
        yield procs, urls
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def body(max_tokens: int, **extra) -> dict:
    with open(TEXT, encoding="utf-8") as f:
        prompt = f.read()[:1000]
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def sse_text(response: httpx.Response) -> tuple[str, list[dict]]:
    events = [json.loads(line[6:]) for line in response.text.split("\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events


def test_disaggregated_greedy_equals_single_instance_and_holds_less(cluster):
    _, urls = cluster
    with httpx.Client(timeout=300) as http:
        single = http.post(urls["prefill"] + "/v1/completions", json=body(8)).json()["choices"][0]["text"]
        split = http.post(urls["proxy"] + "/v1/completions", json=body(8))
        assert split.status_code == 200, split.text
        split = split.json()
        assert split["choices"][0]["text"] == single
        assert split["usage"]["completion_tokens"] == 8
        transfer = split["usage"]["kv_transfer"]
        assert transfer["remote_kv_bytes"] > 0  # blocks really came from the prefill instance
        assert transfer["local_host_kv_bytes_peak"] * 2 <= transfer["full_kv_bytes"], transfer
        streamed = http.post(urls["proxy"] + "/v1/completions", json=body(4, stream=True))
        assert single.startswith(sse_text(streamed)[0])  # streamed through the proxy: the same greedy prefix
    assert metric(urls["decode"], "kv_remote_bytes_total") > 0
    assert metric(urls["decode"], "kv_local_host_bytes_held") == 0  # nothing held once they finished
    deadline = time.time() + 10
    while metric(urls["prefill"], "engine_disagg_requests_held") and time.time() < deadline:
        time.sleep(0.2)  # decode's release notifications arrive asynchronously
    assert metric(urls["prefill"], "engine_disagg_requests_held") == 0
    assert metric(urls["prefill"], "engine_disagg_released_requests_total") == 2
    assert metric(urls["prefill"], "kv_cache_used_blocks") == 0


def test_refused_requests_fail_alone_and_free_the_prefills_kv(cluster):
    """What the decode instance refuses (logprobs, which the prefill sampled; malformed kv_transfer_params) is a
    400 for that request alone, and the prefill frees its KV at once, not at its lease's end; what needs no decode
    (an echo with max_tokens 0) the prefill answers alone; a list of prompts is refused (the params name one)."""
    _, urls = cluster
    released = metric(urls["prefill"], "engine_disagg_released_requests_total")
    with httpx.Client(timeout=300) as http:
        # a field of the wrong type passes the proxy and the prefill (which never reads it): the decode refused it in
        # its validation, before `refusing`, and the prompt's KV stayed held for the lease
        for extra, param in (({"logprobs": 1}, "logprobs"), ({"prompt": ["a b", "c d"]}, "prompt"),
                             ({"max_tokens": 0}, "max_tokens"),
                             ({"stream_options": {"include_usage": "maybe"}}, "stream_options")):
            refused = http.post(urls["proxy"] + "/v1/completions", json={**body(4), **extra})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        echo = http.post(urls["proxy"] + "/v1/completions", json={**body(0), "echo": True})
        assert echo.status_code == 200 and echo.json()["choices"][0]["text"] == body(0)["prompt"]
        first = http.post(urls["prefill"] + "/v1/completions",
                          json={**body(1), "kv_transfer_params": {"do_remote_decode": True}}).json()
        bad = {**body(4), "kv_transfer_params": {**first["kv_transfer_params"], "first_token_id": 10**9}}
        refused = http.post(urls["decode"] + "/v1/completions", json=bad)
        assert refused.status_code == 400 and "first_token_id" in refused.json()["error"]["message"], refused.text
        assert http.get(urls["decode"] + "/health").status_code == 200
        assert http.post(urls["proxy"] + "/v1/completions", json=body(2)).status_code == 200
    deadline = time.time() + 10
    while metric(urls["prefill"], "engine_disagg_requests_held") and time.time() < deadline:
        time.sleep(0.2)
    assert metric(urls["prefill"], "engine_disagg_requests_held") == 0
    # logprobs, stream_options, bad, body(2)
    assert metric(urls["prefill"], "engine_disagg_released_requests_total") == released + 4
    assert metric(urls["prefill"], "engine_disagg_expired_requests_total") == 0


def test_killing_prefill_fails_its_request_cleanly_and_decode_survives(cluster):
    procs, urls = cluster
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", urls["proxy"] + "/v1/completions", json=body(200, stream=True)) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"]  # decoding has started
            procs["prefill"].send_signal(signal.SIGKILL)
            procs["prefill"].wait()
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert "prefill instance" in error["message"] and "gone" in error["message"], error
        assert http.get(urls["decode"] + "/health").status_code == 200
        for name in ("kv_local_host_bytes_held", "kv_remote_requests_held", "kv_cache_used_blocks",
                     "num_requests_running", "num_requests_waiting"):
            assert metric(urls["decode"], name) == 0, name
        refused = http.post(urls["proxy"] + "/v1/completions", json=body(4))  # the proxy reports the dead prefill
        assert refused.status_code == 502 and "failed" in refused.json()["error"]["message"]
        assert http.get(urls["proxy"] + "/health").status_code == 503
