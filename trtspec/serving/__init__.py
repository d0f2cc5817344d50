"""Serving: the front ends over the batched engine, `trtspec serve` (OpenAI's HTTP API, in vLLM's
layers: body and protocol read a request, responses formats its answer, app routes, server runs
uvicorn; ray_serve deploys it as replicas with ray_options) and the Triton model (triton_model;
triton: its model repository and server), and what they share: frontend (the engine-to-front-end
bridge, text cut at stop strings, finish reasons, the statistics' one serialisation, metrics and
TTFT; the request fields are trtspec.runtime.request.REQUEST_FIELDS), metrics (the Prometheus families; triton_metrics
mirrors them into Triton's) and door (serve's admission defaults)."""
