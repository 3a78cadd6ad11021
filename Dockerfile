# turnstream's own services (proxy, pairer, judge, teacher, dispatcher, trainer) for compose.yaml.
# The locked dependencies include PyPI's torch 2.13.0, a CUDA build: the trainer uses the GPUs compose gives it.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_LINK_MODE=copy \
    TURNSTREAM_CACHE=/var/cache/turnstream \
    PYTHONPATH=/app
WORKDIR /app

RUN pip install --no-cache-dir uv==0.13.9
COPY requirements.lock ./
RUN uv pip sync --system --no-cache requirements.lock

COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY services ./services
COPY examples ./examples

RUN useradd --create-home --uid 10001 turnstream \
    && mkdir -p /var/cache/turnstream /spool /weights \
    && chown turnstream /var/cache/turnstream /spool /weights
USER turnstream

ENTRYPOINT ["python", "-m", "services.cli"]
CMD ["--help"]
