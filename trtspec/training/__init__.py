"""Training DFlash drafters: data from the target's own continuations, the DFlash recipe."""
