# The bundled backend image: kvgate with the `backend` extra (PyTorch).
# TORCH_SPEC picks the wheel; PIP_EXTRA_INDEX_URL may point at a CPU-only or CUDA wheel index.
FROM python:3.11.9-slim-bookworm

ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_EXTRA_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN pip install ${PIP_EXTRA_INDEX_URL:+--extra-index-url "$PIP_EXTRA_INDEX_URL"} "$TORCH_SPEC"
COPY pyproject.toml README.md constraints.txt ./
COPY config ./config
COPY tokenizer ./tokenizer
COPY gateway ./gateway
COPY verifier ./verifier
COPY gpu_backend ./gpu_backend
# /var/lib/kvgate/models-state is where `kvgate model pull` puts models (docker-compose.smollm2.yml
# mounts a named volume there; it starts owned by kvgate because the directory exists in the image).
RUN pip install -c constraints.txt ".[backend]" \
 && useradd --system --uid 10001 --home-dir /var/lib/kvgate --create-home kvgate \
 && install -d -o kvgate -g kvgate /var/lib/kvgate/models-state
USER kvgate
WORKDIR /var/lib/kvgate
EXPOSE 30000 30001 30002
ENTRYPOINT ["kvgate", "backend"]
