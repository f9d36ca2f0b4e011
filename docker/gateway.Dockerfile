# The gateway image: kvgate without torch (the gateway never imports it).
# Base pinned to an exact release; pin by digest in your registry mirror if you need byte-identical builds.
FROM python:3.11.9-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY config ./config
COPY tokenizer ./tokenizer
COPY gateway ./gateway
COPY verifier ./verifier
COPY gpu_backend ./gpu_backend
# The state directory (secrets.json) exists in the image as 0700, so a fresh named volume mounted on
# it starts private: `kvgate serve` refuses a state directory open to other users.
# the hf extra (tokenizers, jinja2): the gateway counts a Hugging Face model with its own tokenizer.json
RUN pip install -c constraints.txt ".[hf]" \
 && useradd --system --uid 10001 --home-dir /var/lib/kvgate --create-home kvgate \
 && install -d -m 0700 -o kvgate -g kvgate /var/lib/kvgate/state
USER kvgate
WORKDIR /var/lib/kvgate
EXPOSE 8080
ENTRYPOINT ["kvgate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
