# Image for the controller, the monitor daemon and the demo trainers (compose, deploy/k8s).
# The controller runs with --no-embedded here: the compose file provides the NATS server.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY marduk ./marduk
COPY agent ./agent
COPY monitor_cli ./monitor_cli
COPY examples ./examples
# The monitor extra: NVML (nvidia-ml-py) and tpu-info for marduk monitor run's probes.
RUN pip install --no-cache-dir '.[monitor]'
ENV PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["marduk", "--help"]
