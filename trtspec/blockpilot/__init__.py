"""BlockPilot: the best block size differs per prompt, so a light policy picks it once per request from prefill.
policy: features + choosing (runtime side); labels: the sweep labelling prompts; training; evaluation."""
