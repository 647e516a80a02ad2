"""A request's path: every request goes through request_path.py, which
authenticates and admits it (admission.py), validates it and produces its
steps (or takes them from batch_cache.py); the transports around it are
grpc_service.py and bulk.py; health.py says whether the worker can serve,
metrics.py what it served, auth.py reads the operator's secrets."""
