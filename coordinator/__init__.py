"""The FastAPI coordinator: plans jobs into shards, enqueues them, reports progress, requeues lost work."""
