"""How steps reach the trainer: connections to every replica and the
requests over them.

  pool.py             the ConnectionPool: opens connections, describes
                      datasets, fetches steps
  retry.py            where the client retries: backoff, failover, fallback
  slots.py            a connection's place in the pool: checkout, shunning,
                      which worker owns a chunk
  targets.py          the target grammar ("host:port", dns:///, local:)
  connection.py       the connection interface, its errors, a step's checks
  grpc_connection.py  over gRPC
  bulk_connection.py  over the bulk transport (plain TCP)
  buffers.py          the page-aligned receive buffers, reused once dropped
"""
