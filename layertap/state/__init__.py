"""Job, shard and sample state in Redis, and job planning (no FastAPI or Celery here).

``keys`` is the whole key schema; ``plan`` checks a job and creates its store; ``jobs`` holds the
coordinator's moves (create, dispatch, cancel, resume, reap); ``shards`` a worker's (claim, count,
complete); ``views`` the reads; ``rebuild`` recreates a job from its store when Redis lost it.
"""
