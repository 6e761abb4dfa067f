# One image for every merchant-tasks service: sandbox, worker, beat, flower and metrics.
# docker-compose.yml builds it once (the worker service) and every service runs it.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY merchant_tasks ./merchant_tasks
# the tools the services run are extras: the emulator, Flower and the metrics exporter
RUN pip install --no-cache-dir '.[sandbox,flower,metrics]' && useradd --create-home --uid 10001 merchant
# celery imports celeryconfig.py from the working directory (package defaults otherwise)
COPY deploy/celeryconfig.py ./celeryconfig.py
USER merchant
