"""Writes the recorded expositions engine/testdata/*.txt.

Each fixture is what the engine's own prometheus_client code path serves on
/metrics: the metric families, HELP texts, label names and histogram buckets
are those of the named release's metrics code (vLLM: vllm/v1/metrics/loggers.py,
and vllm/engine/metrics.py for the V0 engine; SGLang:
python/sglang/srt/metrics/collector.py), registered and rendered here by the
real prometheus_client (and, for vLLM, prometheus-fastapi-instrumentator, which
vLLM's API server mounts), so the text format, the `_created` series, label
order and number formatting are the library's, not ours. The values are
chosen so the tests know the answer (see engine/parse_test.go).

    python3 -m venv /tmp/fixtures && /tmp/fixtures/bin/pip install \
        prometheus_client prometheus-fastapi-instrumentator fastapi httpx
    /tmp/fixtures/bin/python engine/testdata/make_fixtures.py engine/testdata

Not run by the tests; rerun it only to change a fixture.
"""

import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
MAX_MODEL_LEN = 32768


def buckets_1_2_5(max_value):
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
        1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
        2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]


def observe(rng, h, n, lo, hi):
    for _ in range(n):
        h.observe(rng.uniform(lo, hi))


def http_app_traffic(registry):
    """vLLM's mount_metrics: Instrumentator(...).add().instrument(app).expose(app)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from prometheus_fastapi_instrumentator import Instrumentator

    app = FastAPI()

    @app.post("/v1/chat/completions")
    def chat():
        return {"object": "chat.completion"}

    @app.post("/v1/completions")
    def completions():
        return {"object": "text_completion"}

    @app.get("/v1/models")
    def models():
        return {"data": []}

    @app.get("/health")
    def health():
        return {}

    Instrumentator(
        excluded_handlers=["/metrics", "/health", "/load", "/ping", "/version", "/server_info"],
        registry=registry,
    ).add().instrument(app).expose(app)
    c = TestClient(app)
    for i in range(120):
        c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * (i % 50)}]})
    for _ in range(15):
        c.post("/v1/completions", json={"prompt": "hello"})
    for _ in range(4):
        c.get("/v1/models")
    c.get("/health")
    return c


def vllm_012_dp2(path):
    """vLLM 0.12 (V1 engine), --data-parallel-size 2, one API server: the
    default registry (process, platform and gc collectors), the engine's
    PrometheusStatLogger with one series per engine, then the HTTP metrics."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    rng = random.Random(12)
    ln = ["model_name", "engine"]
    engines = ["0", "1"]

    def per(metric):
        return {e: metric.labels(MODEL, e) for e in engines}

    running = per(Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labelnames=ln, multiprocess_mode="mostrecent"))
    waiting = per(Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labelnames=ln, multiprocess_mode="mostrecent"))
    sleep = Gauge("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.", labelnames=ln + ["sleep_state"], multiprocess_mode="mostrecent")
    for s in ("awake", "weights_offloaded", "discard_all"):
        for e in engines:
            sleep.labels(engine=e, model_name=MODEL, sleep_state=s).set(1 if s == "awake" else 0)
    kv = per(Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labelnames=ln, multiprocess_mode="mostrecent"))
    pq = per(Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", labelnames=ln))
    ph = per(Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labelnames=ln))
    per(Counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.", labelnames=ln))
    per(Counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.", labelnames=ln))
    per(Counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.", labelnames=ln))
    per(Counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.", labelnames=ln))
    pre = per(Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", labelnames=ln))
    prompt = per(Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labelnames=ln))
    gen = per(Counter("vllm:generation_tokens", "Number of generation tokens processed.", labelnames=ln))
    success = Counter("vllm:request_success", "Count of successfully processed requests.", labelnames=ln + ["finished_reason"])
    hists = {}
    for name, doc, b in [
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", buckets_1_2_5(MAX_MODEL_LEN)),
        ("vllm:request_generation_tokens", "Number of generation tokens processed.", buckets_1_2_5(MAX_MODEL_LEN)),
        ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]),
        ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", buckets_1_2_5(MAX_MODEL_LEN)),
        ("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]),
        ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", buckets_1_2_5(MAX_MODEL_LEN)),
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TPOT),
        ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", TPOT),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY),
        ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LATENCY),
        ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", LATENCY),
        ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", LATENCY),
        ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LATENCY),
    ]:
        hists[name] = per(Histogram(name, doc, labelnames=ln, buckets=b))
    children = {(r, e): success.labels(MODEL, e, r) for r in ("stop", "length", "abort") for e in engines}

    # Engine 0 is busier than engine 1; the tests expect the sums and the mean.
    want = {
        "0": dict(running=12, waiting=3, kv=0.4375, q=1048576, h=393216, pre=5),
        "1": dict(running=9, waiting=0, kv=0.3125, q=524288, h=131072, pre=2),
    }
    for e, w in want.items():
        running[e].set(w["running"])
        waiting[e].set(w["waiting"])
        kv[e].set(w["kv"])
        pq[e].inc(w["q"])
        ph[e].inc(w["h"])
        pre[e].inc(w["pre"])
        prompt[e].inc(w["q"])
        gen[e].inc(w["q"] // 8)
        children[("stop", e)].inc(700 if e == "0" else 350)
        children[("length", e)].inc(40 if e == "0" else 22)
        children[("abort", e)].inc(3 if e == "0" else 1)
        n = 740 if e == "0" else 372
        observe(rng, hists["vllm:request_prompt_tokens"][e], n, 20, 6000)
        observe(rng, hists["vllm:request_generation_tokens"][e], n, 1, 1500)
        observe(rng, hists["vllm:iteration_tokens_total"][e], 4 * n, 1, 9000)
        observe(rng, hists["vllm:request_max_num_generation_tokens"][e], n, 16, 4096)
        observe(rng, hists["vllm:request_params_n"][e], n, 1, 1)
        observe(rng, hists["vllm:request_params_max_tokens"][e], n, 16, 4096)
        observe(rng, hists["vllm:time_to_first_token_seconds"][e], n, 0.02, 3)
        observe(rng, hists["vllm:inter_token_latency_seconds"][e], 20 * n, 0.008, 0.09)
        observe(rng, hists["vllm:request_time_per_output_token_seconds"][e], n, 0.01, 0.08)
        for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                     "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                     "vllm:request_decode_time_seconds"):
            observe(rng, hists[name][e], n, 0.05, 40)

    info = {
        "block_size": "16", "cache_dtype": "auto", "calculate_kv_scales": "False",
        "cpu_offload_gb": "0", "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9",
        "is_attention_free": "False", "kv_cache_memory_bytes": "None", "kv_sharing_fast_prefill": "False",
        "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "num_cpu_blocks": "None",
        "num_gpu_blocks": "29127", "num_gpu_blocks_override": "None", "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None", "swap_space": "4", "swap_space_bytes": "4294967296",
    }
    g = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labelnames=list(info) + ["engine"], multiprocess_mode="mostrecent")
    for e in engines:
        g.labels(**info, engine=e).set(1)

    c = http_app_traffic(REGISTRY)
    body = c.get("/metrics", headers={"Accept": "text/plain;version=0.0.4"}).text
    open(path, "w").write(body)


def vllm_08_v1(path):
    """vLLM 0.8 (V1 engine), one engine: the cache gauge still
    vllm:gpu_cache_usage_perc, the prefix counters vllm:gpu_prefix_cache_*."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    r = CollectorRegistry()
    rng = random.Random(8)
    lv = [MODEL, "0"]
    ln = ["model_name", "engine"]
    Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labelnames=ln, registry=r).labels(*lv).set(6)
    Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labelnames=ln, registry=r).labels(*lv).set(1)
    Gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", labelnames=ln, registry=r).labels(*lv).set(0.625)
    Counter("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in terms of number of queried blocks.", labelnames=ln, registry=r).labels(*lv).inc(20480)
    Counter("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number of cached blocks.", labelnames=ln, registry=r).labels(*lv).inc(5120)
    Counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", labelnames=ln, registry=r).labels(*lv).inc(4)
    Counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", labelnames=ln, registry=r).labels(*lv).inc(327680)
    Counter("vllm:generation_tokens_total", "Number of generation tokens processed.", labelnames=ln, registry=r).labels(*lv).inc(40960)
    s = Counter("vllm:request_success_total", "Count of successfully processed requests.", labelnames=ln + ["finished_reason"], registry=r)
    for reason, n in (("stop", 190), ("length", 12), ("abort", 0)):
        s.labels(*lv, reason).inc(n)
    for name, doc, b, lo, hi in [
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", buckets_1_2_5(MAX_MODEL_LEN), 20, 5000),
        ("vllm:request_generation_tokens", "Number of generation tokens processed.", buckets_1_2_5(MAX_MODEL_LEN), 1, 800),
        ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", [1, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152, 160, 168, 176, 184, 192, 200, 208, 216, 224, 232, 240, 248, 256, 272, 288, 304, 320, 336, 352, 368, 384, 400, 416, 432, 448, 464, 480, 496, 512], 1, 512),
        ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", buckets_1_2_5(MAX_MODEL_LEN), 16, 2048),
        ("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20], 1, 1),
        ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", buckets_1_2_5(MAX_MODEL_LEN), 16, 2048),
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT, 0.02, 2),
        ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", TPOT, 0.01, 0.06),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY, 0.1, 30),
        ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LATENCY, 0.0, 2),
        ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", LATENCY, 0.1, 30),
        ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", LATENCY, 0.01, 2),
        ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LATENCY, 0.1, 30),
    ]:
        observe(rng, Histogram(name, doc, labelnames=ln, buckets=b, registry=r).labels(*lv), 202, lo, hi)
    Counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", labelnames=ln, registry=r).labels(*lv)
    Counter("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", labelnames=ln, registry=r).labels(*lv)
    info = {"block_size": "16", "cache_dtype": "auto", "calculate_kv_scales": "False", "cpu_offload_gb": "0",
            "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9", "is_attention_free": "False",
            "num_cpu_blocks": "None", "num_gpu_blocks": "27864", "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": "builtin", "sliding_window": "None", "swap_space": "4",
            "swap_space_bytes": "4294967296"}
    Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labelnames=list(info), registry=r).labels(**info).set(1)
    open(path, "wb").write(generate_latest(r))


def vllm_05_v0(path):
    """vLLM 0.5 (V0 engine, vllm/engine/metrics.py): label model_name only,
    no prefix-cache counters, _created series disabled by vLLM itself."""
    import prometheus_client
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

    prometheus_client.disable_created_metrics()
    r = CollectorRegistry()
    rng = random.Random(5)
    ln = ["model_name"]
    Info("vllm:cache_config", "information of cache_config", registry=r).info(
        {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "False",
         "gpu_memory_utilization": "0.9", "num_cpu_blocks": "2048", "num_gpu_blocks": "27540",
         "num_gpu_blocks_override": "None", "sliding_window": "None", "swap_space_bytes": "4294967296"})
    Gauge("vllm:num_requests_running", "Number of requests currently running on GPU.", labelnames=ln, registry=r).labels(MODEL).set(31)
    Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labelnames=ln, registry=r).labels(MODEL).set(17)
    Gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", labelnames=ln, registry=r).labels(MODEL).set(2)
    Gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", labelnames=ln, registry=r).labels(MODEL).set(0.96875)
    Gauge("vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.", labelnames=ln, registry=r).labels(MODEL).set(0.0625)
    Counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", labelnames=ln, registry=r).labels(MODEL).inc(96)
    Counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", labelnames=ln, registry=r).labels(MODEL).inc(2100000)
    Counter("vllm:generation_tokens_total", "Number of generation tokens processed.", labelnames=ln, registry=r).labels(MODEL).inc(310000)
    for name, doc, b, lo, hi in [
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0], 0.05, 8),
        ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5], 0.02, 0.3),
        ("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0], 0.5, 90),
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", buckets_1_2_5(MAX_MODEL_LEN), 20, 5000),
        ("vllm:request_generation_tokens", "Number of generation tokens processed.", buckets_1_2_5(MAX_MODEL_LEN), 1, 800),
        ("vllm:request_params_best_of", "Histogram of the best_of request parameter.", [1, 2, 5, 10, 20], 1, 1),
        ("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20], 1, 1),
    ]:
        observe(rng, Histogram(name, doc, labelnames=ln, buckets=b, registry=r).labels(MODEL), 1400, lo, hi)
    s = Counter("vllm:request_success_total", "Count of successfully processed requests.", labelnames=ln + ["finished_reason"], registry=r)
    s.labels(MODEL, "stop").inc(1310)
    s.labels(MODEL, "length").inc(90)
    Gauge("vllm:avg_prompt_throughput_toks_per_s", "Average prefill throughput in tokens/s.", labelnames=ln, registry=r).labels(MODEL).set(5210.4)
    Gauge("vllm:avg_generation_throughput_toks_per_s", "Average generation throughput in tokens/s.", labelnames=ln, registry=r).labels(MODEL).set(1804.9)
    open(path, "wb").write(generate_latest(r))


# SGLang runs its scheduler(s) and its tokenizer manager in separate processes
# and always serves /metrics from prometheus_client's multiprocess collector
# (PROMETHEUS_MULTIPROC_DIR): there are no _created series, counters and
# histograms are summed over processes, gauges in "mostrecent" mode lose the
# pid label and the others keep it (older prometheus_client releases also
# wrote every HELP as "Multiprocess metric").

SGL_ITL = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
           0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000]
SGL_TTFT = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
SGL_E2E = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400]
SGL_QUEUE = [0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300,
             400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000]


def sgl_scheduler(labels, v, recent):
    from prometheus_client import Counter, Gauge, Histogram

    def g(name, doc, value, mostrecent=True):
        kw = {"multiprocess_mode": "mostrecent"} if mostrecent else {}
        Gauge(name, doc, labelnames=labels.keys(), **kw).labels(**labels).set(value)

    g("sglang:num_running_reqs", "The number of running requests.", v["running"])
    g("sglang:num_used_tokens", "The number of used tokens.", v["used"])
    g("sglang:token_usage", "The token usage.", v["usage"])
    g("sglang:pending_prealloc_token_usage", "The token usage for pending preallocated tokens (not preallocated yet).", 0)
    g("sglang:swa_token_usage", "The token usage for SWA layers.", 0)
    if recent:
        g("sglang:mamba_usage", "The token usage for Mamba layers.", 0)
        g("sglang:decode_sum_seq_lens", "The sum of all sequence lengths in decode.", v["used"])
    g("sglang:gen_throughput", "The generation throughput (token/s).", v["gen"])
    g("sglang:num_queue_reqs", "The number of requests in the waiting queue.", v["queue"])
    g("sglang:num_grammar_queue_reqs", "The number of requests in the grammar waiting queue.", 0)
    g("sglang:num_running_reqs_offline_batch", "The number of running low-priority offline batch requests(label is 'batch').", 0)
    g("sglang:cache_hit_rate", "The prefix cache hit rate.", v["hit_rate"])
    if recent:
        g("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", v["max_tokens"])
    g("sglang:spec_accept_length", "The average acceptance length of speculative decoding.", 0)
    g("sglang:spec_accept_rate", "The average acceptance rate of speculative decoding (`accepted tokens / total draft tokens` in batch).", 0)
    g("sglang:num_retracted_reqs", "The number of retracted requests.", 0, mostrecent=False)
    if recent:
        Counter("sglang:num_retracted_requests_total", "Total number of retracted requests.", labelnames=labels.keys()).labels(**labels).inc(v["retracted"])
        Counter("sglang:num_retracted_input_tokens_total", "Total number of retracted input tokens.", labelnames=labels.keys()).labels(**labels).inc(v["retracted"] * 1800)
        Counter("sglang:num_retracted_output_tokens_total", "Total number of retracted output tokens.", labelnames=labels.keys()).labels(**labels).inc(v["retracted"] * 300)
    g("sglang:num_paused_reqs", "The number of paused requests by async weight sync.", 0, mostrecent=False)
    for name, doc in [
        ("sglang:num_prefill_prealloc_queue_reqs", "The number of requests in the prefill prealloc queue."),
        ("sglang:num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight queue."),
        ("sglang:num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue."),
        ("sglang:num_decode_transfer_queue_reqs", "The number of requests in the decode transfer queue."),
        ("sglang:kv_transfer_speed_gb_s", "The transfer speed of the KV cache in GB/s."),
        ("sglang:kv_transfer_latency_ms", "The transfer latency of the KV cache in ms."),
    ]:
        g(name, doc, 0)
    g("sglang:utilization", "The utilization.", v["util"])
    g("sglang:engine_startup_time", "The time taken for the engine to start up.", 41.7)
    g("sglang:engine_load_weights_time", "The time taken for the engine to load weights.", 12.3)
    if recent:
        g("sglang:new_token_ratio", "The new token ratio.", 0.31)
    g("sglang:is_cuda_graph", "Whether the batch is using CUDA graph.", 1)
    rng = random.Random(hash(tuple(labels.values())) & 0xFFFF)
    q = Histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", labelnames=labels.keys(), buckets=SGL_QUEUE).labels(**labels)
    observe(rng, q, 600, 0, 3)
    if recent:
        passes = Counter("sglang:cuda_graph_passes_total", "Total number of forward passes categorized by CUDA graph.", labelnames=list(labels.keys()) + ["mode"])
        passes.labels(**labels, mode="decode_cuda_graph").inc(91234)
        passes.labels(**labels, mode="decode_none").inc(211)
        rt = Counter("sglang:realtime_tokens_total", "Total number of tokens processed (updated on each log interval). mode: prefill_compute, prefill_cache, decode.", labelnames=list(labels.keys()) + ["mode"])
        rt.labels(**labels, mode="prefill_compute").inc(v["compute"])
        rt.labels(**labels, mode="prefill_cache").inc(v["cache"])
        rt.labels(**labels, mode="decode").inc(v["decode"])


def sgl_tokenizer(labels, v, recent):
    from prometheus_client import Counter, Histogram

    rng = random.Random(77)
    Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.", labelnames=labels.keys()).labels(**labels).inc(v["prompt"])
    Counter("sglang:generation_tokens_total", "Number of generation tokens processed.", labelnames=labels.keys()).labels(**labels).inc(v["prompt"] // 6)
    Counter("sglang:cached_tokens_total", "Number of cached prompt tokens.", labelnames=labels.keys()).labels(**labels).inc(v["cached"])
    Counter("sglang:num_requests_total", "Number of requests processed.", labelnames=labels.keys()).labels(**labels).inc(v["requests"])
    Counter("sglang:num_aborted_requests_total", "Number of requests aborted.", labelnames=labels.keys()).labels(**labels).inc(2)
    observe(rng, Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labelnames=labels.keys(), buckets=SGL_TTFT).labels(**labels), v["requests"], 0.05, 3)
    observe(rng, Histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labelnames=labels.keys(), buckets=SGL_ITL).labels(**labels), 10 * v["requests"], 0.006, 0.05)
    observe(rng, Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", labelnames=labels.keys(), buckets=SGL_E2E).labels(**labels), v["requests"], 0.3, 40)
    if recent:
        h = Histogram("sglang:num_retractions", "Histogram of retraction counts per request.", labelnames=labels.keys(), buckets=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 20, 25, 30, 40, 50, 75, 100]).labels(**labels)
        for i in range(v["requests"]):
            h.observe(1 if i < 4 else 0)


def _child(target, args, mpdir):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = mpdir
    target(*args)


def sglang(path, procs):
    mpdir = tempfile.mkdtemp()
    try:
        ctx = mp.get_context("spawn")
        for target, args in procs:
            p = ctx.Process(target=_child, args=(target, args, mpdir))
            p.start()
            p.join()
            assert p.exitcode == 0
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = mpdir
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess

        r = CollectorRegistry()
        multiprocess.MultiProcessCollector(r)
        open(path, "wb").write(generate_latest(r))
    finally:
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        shutil.rmtree(mpdir)


def sglang_dp2(path):
    """A recent SGLang (collector.py with realtime_tokens_total and the
    retraction counter), --dp-size 2 --enable-dp-attention: one scheduler per
    dp rank, labelled model_name, engine_type, tp_rank, pp_rank, moe_ep_rank,
    dp_rank, and one tokenizer manager."""
    def sched(dp):
        return {"model_name": MODEL, "engine_type": "unified", "tp_rank": dp, "pp_rank": 0, "moe_ep_rank": dp, "dp_rank": dp}
    v0 = dict(running=7, queue=2, usage=0.5, used=65536, gen=1830.5, hit_rate=0.7, max_tokens=131072, util=0.81, retracted=3, compute=300000, cache=700000, decode=250000)
    v1 = dict(running=5, queue=1, usage=0.25, used=32768, gen=1207.25, hit_rate=0.6, max_tokens=131072, util=0.62, retracted=1, compute=200000, cache=300000, decode=160000)
    tok = dict(prompt=1480000, cached=990000, requests=1210)
    sglang(path, [
        (sgl_scheduler, (sched(0), v0, True)),
        (sgl_scheduler, (sched(1), v1, True)),
        (sgl_tokenizer, ({"model_name": MODEL, "engine_type": "unified"}, tok, True)),
    ])


def sglang_old(path):
    """An older SGLang (collector.py before the realtime token counter and the
    retraction counter), one scheduler labelled model_name and engine_type."""
    lab = {"model_name": MODEL, "engine_type": "unified"}
    v = dict(running=14, queue=4, usage=0.875, used=114688, gen=2210.0, hit_rate=0.55, util=0.9)
    tok = dict(prompt=640000, cached=352000, requests=510)
    sglang(path, [
        (sgl_scheduler, (lab, v, False)),
        (sgl_tokenizer, ({"model_name": MODEL}, tok, False)),
    ])


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    # Each writer in its own process: prometheus_client's registries, and the
    # created-series switch, are process-global.
    ctx = mp.get_context("spawn")
    for fn, name in [
        (vllm_012_dp2, "vllm-0.12-dp2.txt"),
        (vllm_08_v1, "vllm-0.8.txt"),
        (vllm_05_v0, "vllm-0.5-v0.txt"),
        (sglang_dp2, "sglang-dp2.txt"),
        (sglang_old, "sglang-old.txt"),
    ]:
        p = ctx.Process(target=fn, args=(os.path.join(out, name),))
        p.start()
        p.join()
        assert p.exitcode == 0, name
        print("wrote", name)
