"""The client's options, where users have imported them from: `TransportOptions`,
`RetryPolicy` and `Security` live in client/transport/options.py, beside the
transport that reads them (which imports nothing above it)."""

from __future__ import annotations

from grain_elevator.client.transport.options import (TRANSPORT_KINDS, RetryPolicy, Security,
                                                     TransportOptions)

__all__ = ["TransportOptions", "RetryPolicy", "Security", "TRANSPORT_KINDS"]
