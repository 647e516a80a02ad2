"""How steps reach the trainer: connections to every replica and the
requests over them (the pool, retries and failover, the target grammar, the
gRPC and bulk connections, the receive buffers). Which module does what:
docs/design.md, "client/".
"""
