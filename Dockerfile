# turnstream's own services (proxy, pairer, judge, teacher, dispatcher, trainer, eval, console) for compose.yaml.
#
# Targets (compose.yaml builds TURNSTREAM_BUILD_TARGET, default runtime):
#   runtime  requirements-runtime.lock: the services' dependencies and nothing else (no pytest, mypy, playwright,
#            testcontainers: those are requirements.lock's dev extras). PyPI's torch 2.13.0 is a CUDA 13.0 build
#            (host driver R580 or newer). No Transformer Engine: the trainer uses Megatron-core's local layers, and
#            every memory figure in README/docs names the image it holds for.
#   te       runtime plus Transformer Engine 2.11 for torch (fused attention and norm+linear): the trainer then
#            plans and runs `trainer.layer_spec = te`. Its torch extension is compiled in the te-build stage
#            against torch 2.13.0 with CUDA 13.0's headers from PyPI (12 minutes on 2 cores, once); docs/gpu-host.md.
#
#   docker build -t turnstream:latest .                     # runtime (the default: the last stage)
#   docker build --target te -t turnstream:te .             # with Transformer Engine
#
# BASE_IMAGE is the only thing a build may change: `make rehearse` builds from a Debian stand-in for python:3.11-slim
# (Docker Hub cannot be reached there); everything after FROM is what ships.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS runtime
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_LINK_MODE=copy \
    TURNSTREAM_CACHE=/var/cache/turnstream \
    PYTHONPATH=/app
WORKDIR /app

RUN pip install --no-cache-dir uv==0.13.9
COPY requirements-runtime.lock ./
RUN uv pip sync --system --no-cache requirements-runtime.lock

COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY runtime ./runtime
COPY services ./services
COPY examples ./examples

# The mount points of compose's named volumes exist here, owned by the user: a new volume takes its owner from the
# image, and a root-owned one would be read-only to the services (the console's /console was, at first contact).
# /run/turnstream/keys holds the proxy's per-user keys file (compose's proxy-keys volume): the user's alone.
RUN useradd --create-home --uid 10001 turnstream \
    && mkdir -p /var/cache/turnstream /spool /weights /console /run/turnstream/keys /acl \
    && chown turnstream /var/cache/turnstream /spool /weights /console /run/turnstream/keys /acl \
    && chmod 700 /run/turnstream/keys
USER turnstream

ENTRYPOINT ["python", "-m", "services.cli"]
CMD ["--help"]

# Transformer Engine 2.11's torch extension is source only: 28 C++ files compiled against the installed torch (no
# .cu files), with CUDA 13.0's headers from PyPI and nvcc only for `nvcc -V`. Built in a stage of its own so the
# compiler stays out of the image. Versions: megatron-core 0.16.1's dev extra (transformer-engine[core_cu13,pytorch]
# >=2.9,<2.12); the three TE packages must be one version; onnx/onnxscript are imported by TE at start.
FROM runtime AS te-build
USER root
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN uv pip install --system --no-cache nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 \
        nvidia-cuda-cccl==13.0.85 ninja==1.13.0 wheel==0.45.1
RUN SP="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && CUDA_HOME="$SP/nvidia/cu13" CPATH="$SP/nvidia/cudnn/include:$SP/nvidia/nccl/include" \
       NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-8}" \
       pip wheel --no-build-isolation --no-deps --no-cache-dir -w /wheels transformer-engine-torch==2.11.0

FROM runtime AS te
USER root
COPY --from=te-build /wheels /tmp/wheels
RUN uv pip install --system --no-cache /tmp/wheels/transformer_engine_torch-2.11.0-*.whl \
        transformer-engine==2.11.0 transformer-engine-cu13==2.11.0 einops==0.8.2 onnx==1.23.2 \
        onnxscript==0.7.2 onnx-ir==1.1.0 ml-dtypes==0.7.0 protobuf==7.36.2 \
        nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 \
    && rm -rf /tmp/wheels
# TE's NVRTC kernels look for cuda_runtime.h where CUDA 12's wheels put it; CUDA 13's are under nvidia/cu13.
ENV NVTE_CUDA_INCLUDE_DIR=/usr/local/lib/python3.11/site-packages/nvidia/cu13/include
USER turnstream

FROM runtime
