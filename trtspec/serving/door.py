"""What `trtspec serve` lets in, and how long it waits, by default: one home for the defaults that
its options (`trtspec.commands.serve`, importable without the [serve] extra) and the server
(`trtspec.serving.app`) share."""

MAX_BODY_BYTES = 8 * 2**20  # --max-body-bytes: a 128k-token prompt is about 1 MB of JSON
READ_TIMEOUT_S = 30.0       # --read-timeout: to send a request's head, and then its body
