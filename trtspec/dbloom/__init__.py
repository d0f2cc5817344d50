"""DBloom: the block horizon, not the drafter, caps tau when the ceiling bin spikes; post-train on a longer block.
preflight: histogram analysis and the stranded speed-up (decoded or teacher-forced); expand: expand-block."""
