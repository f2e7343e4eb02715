# Image for the controller and the demo trainers in docker-compose.yml.
# The controller runs with --no-embedded here: the compose file provides the NATS server.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY marduk ./marduk
COPY agent ./agent
COPY monitor_cli ./monitor_cli
COPY examples ./examples
RUN pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["marduk", "--help"]
