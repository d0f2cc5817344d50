"""BlockPilot: the best block size differs per prompt, so a light policy picks it once per request from prefill.

policy: the prefill summaries, the policy and its choice (runtime side); load: the load-aware
chooser under continuous batching; costs: the chooser's cycle-cost table, timed when an engine
starts; labels: label sets (files, schema, modelled speeds); training; evaluation. The labelling
run (`trtspec label-blocks`) is a measurement and lives with the others: trtspec.perf.labelling."""
