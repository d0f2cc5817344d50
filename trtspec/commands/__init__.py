"""One module per command (group); `trtspec.cli` wires them into the `trtspec` group."""
