# One image for every merchant-tasks service: sandbox, worker, beat and flower.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md celeryconfig.py ./
COPY merchant_tasks ./merchant_tasks
RUN pip install --no-cache-dir . && useradd --create-home --uid 10001 merchant
USER merchant
# celery imports celeryconfig.py from the working directory
WORKDIR /app
