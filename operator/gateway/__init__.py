"""shoal-gateway: an inference-aware reverse proxy in front of a fleet of `shoal-engine serve` replicas.

Data plane only: it must import no torch and no transformers (its image is the small one), which a test checks.

  backends.py   the backend set: discovered endpoints, polled health/load, in-flight counts, circuit breakers
  poller.py     polls every backend's readiness path and /metrics (bounded, concurrent; stale data scores as unknown)
  discovery.py  static --endpoint URLs or Kubernetes EndpointSlices (Ready endpoints only; operator/k8s's informer)
  prefix.py     the request's prompt as chained hashes of fixed-size character blocks (no tokenizer)
  routing.py    filters -> weighted scorers -> picker profiles: prefix-load | least-load | round-robin
  proxy.py      the aiohttp app: forwarding, SSE pass-through, retries, 503/429/413, hold queue; GatewayConfig
  options.py    how a GatewayConfig field is declared once as a flag and a spec.gateway field
  metric_names.py  each engine runtime's readiness path and load metric names (shoal:, vllm:, sglang:)
  batch_store.py, batch_runner.py, batch_api.py  OpenAI Files and Batches (--batch-dir): durable state, runs at
                the lowest priority, the routes
  metrics.py    shoal:gateway_* Prometheus metrics
  cli.py        the `shoal-gateway` command line
  bench_fleet.py, bench_shared.py, bench_batch.py  benchmarks over local engine processes (python -m ...)
"""
