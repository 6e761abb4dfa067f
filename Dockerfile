# One image for every merchant-tasks service: sandbox, worker, beat, flower and metrics.
# docker-compose.yml builds it once (the worker service) and every service runs it.
FROM python:3.11.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY merchant_tasks ./merchant_tasks
# the tools the services run are extras: the emulator, Flower and the metrics exporter.
# The user's uid and gid (10001) are the ones secret files must be readable by
# (docker-compose.yml says how).
RUN pip install --no-cache-dir '.[sandbox,flower,metrics]' \
    && groupadd --gid 10001 merchant \
    && useradd --create-home --uid 10001 --gid 10001 merchant
# celery imports celeryconfig.py from the working directory: the place to override the
# package defaults; Flower reads flowerconfig.py (basic auth from a secret file)
COPY celeryconfig.py deploy/flowerconfig.py ./
USER 10001:10001
