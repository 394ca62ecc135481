# Serving image: the NGC tritonserver image (its tritonserver binary and Python backend) plus this
# repository, installed by the same scripts/setup.sh as on bare hosts. Not buildable on the
# project's CI machines (no Docker engine there); keep it in step with scripts/setup.sh.
#
#   docker build -t pd-triton .
#   openssl rand -hex 32 >api-keys   # the OpenAI front's key (one a line; clients send
#                                    # 'Authorization: Bearer KEY')
#   docker run --gpus all --shm-size 2g -p 8000:8000 -p 8001:8001 -p 8002:8002 -p 9000:9000 \
#     -v "$PWD/api-keys:/run/pd/api-keys:ro" -e PD_API_KEY_FILE=/run/pd/api-keys pd-triton
# The stages' device is `auto`: with GPUs visible they run on cuda:0 out of the box; place them
# on separate GPUs with e.g. `... pd-triton bash scripts/serve.sh --foreground --prefill-gpus 0
# --decode-gpus 1`. scripts/gpu_check.sh runs the CUDA checks inside the image. Triton's ports
# listen on all of the container's interfaces (--host 0.0.0.0: published with -p); the stages'
# KV control and data planes stay on the container's loopback. The OpenAI front (9000) listens
# on $PD_OPENAI_HOST (-e PD_OPENAI_HOST=127.0.0.1 keeps it inside the container); on any address
# but loopback it needs an API key ($PD_API_KEY_FILE, or $PD_API_KEY) and refuses to start
# without one, saying so.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

ENV DEBIAN_FRONTEND=noninteractive \
    PD_TARGET=cuda \
    PD_OPENAI_HOST=0.0.0.0 \
    PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3-venv libibverbs1 iproute2 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pd-triton
COPY . .
# tritonserver is on PATH in this image, so setup.sh skips the nvidia-pytriton wheel.
RUN bash scripts/setup.sh

EXPOSE 8000 8001 8002 9000
CMD ["bash", "scripts/serve.sh", "--foreground", "--host", "0.0.0.0"]
