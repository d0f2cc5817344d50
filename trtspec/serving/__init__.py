"""Serving: trtspec inside Triton Inference Server (python backend)."""
