"""What the tests, benchmarks and demos stand up around a server: `elevator
serve` as a child process (launcher.py), object-storage servers on 127.0.0.1
(storage_servers.py), a latency- and fault-injecting HTTP proxy in front of
them (fault_proxy.py), and a raw HTTP/2 peer for the hostile-client tests
(h2peer.py). No worker imports it."""
