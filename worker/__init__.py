"""The Celery worker: ``celery -A worker worker`` loads ``worker.celery:app`` (settings from ``LAYERTAP_*``).

Importing this package reads no settings; ``worker.celery`` does, once per process.
"""
