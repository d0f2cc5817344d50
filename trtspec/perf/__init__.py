"""The measurement layer: what trtspec measures about itself, above the runtime it measures.

machine: the machine description recorded beside every figure; sweep: the one sweep (prompts x
block-size choices x repeats, with its seeding rule) behind every measurement; bench: speculative vs
AR speed-up, tau and acceptance; host_profile: draft, verify and host time per cycle (`bench
--profile`); concurrency: throughput and latency under concurrent clients (`bench --concurrency`);
cycle_costs: draft(B) / verify(B) step and decode-cycle timings of a Qwen3-4B-shaped pair
(scripts/gpu/cycle_costs.py); labelling: BlockPilot's labels (`label-blocks`). The timing primitive
they share with BlockPilot's cost table is trtspec.timing, below both.

Nothing in the serving path (the runtime, trtspec.api, trtspec.serving, trtspec.blockpilot)
imports this package; tests/test_layers.py keeps it so.
"""
