"""Serving: the front ends over the batched engine, `trtspec serve` (OpenAI's HTTP API, in vLLM's
layers: body and protocol read a request, responses formats its answer, app routes, server runs
uvicorn) and the Triton model (triton_model; triton: its model repository and server), and what they
share: frontend (a request's GenerationConfig, the engine-to-front-end bridge, text cut at stop
strings, finish reasons, metrics and TTFT), metrics (the Prometheus families; triton_metrics
mirrors them into Triton's) and door (serve's admission defaults)."""
