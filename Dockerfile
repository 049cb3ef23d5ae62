# titan-async training image: the pinned torch / torchtitan stack of pyproject.toml, the
# `titan-async` CLI as the entrypoint, run directories and caches on the volume /workspace.
#
#   docker build -t titan-async:0.1.0 .
#   docker run --rm --gpus all --shm-size=16g -v "$PWD/work:/workspace" titan-async:0.1.0 train --config debug_cpu
#
# Base image: python:3.11-slim rather than an nvidia/cuda runtime image. The torch 2.15.0 wheel
# on PyPI brings its own CUDA runtime, cuDNN and NCCL (the nvidia-* wheels it depends on), so a
# CUDA image would only add a second, unused copy of them; all the container needs from the host
# is the driver, which the NVIDIA container toolkit mounts (docker run --gpus, Kubernetes device
# plugin; it must support CUDA 13, i.e. R580 or newer). 3.11 is the Python the project is tested with.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

RUN useradd --create-home --uid 1000 --user-group titan \
    && mkdir /workspace \
    && chown titan:titan /workspace

WORKDIR /src

# The pinned dependencies first, in their own layer: rebuilt only when pyproject.toml changes.
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > requirements.txt \
    && pip install --no-cache-dir -r requirements.txt

# titan-async itself (a regular, non-editable install; the shipped configs become package data).
COPY README.md ./
COPY titan_async titan_async
COPY train_configs train_configs
RUN pip install --no-cache-dir --no-deps . \
    && rm -rf /src

# Runs (runs/<name>), the offline corpus and tokenizer, and Hugging Face downloads all land on the
# volume, so they outlive the container and work under `docker run --user` as well.
ENV TITAN_ASYNC_CACHE=/workspace/.cache/titan-async \
    HF_HOME=/workspace/.cache/huggingface \
    MPLCONFIGDIR=/tmp/matplotlib
# titan, by number so that Kubernetes runAsNonRoot can check it.
USER 1000:1000
WORKDIR /workspace
VOLUME ["/workspace"]

ENTRYPOINT ["titan-async"]
CMD ["--help"]
