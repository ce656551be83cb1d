"""How chunks get to the servers and their sums back (the worker's side).

- `base`: the interface every transport keeps (`Transport`, `Chunk`,
  `Credit`, `ChunkHandle`).
- `client`: the gRPC client of one server (hello, push, pull, deadlines and
  safe retries); every transport sends through one.
- `grpc`: payloads in the gRPC messages (`GrpcTransport`).
- `shm`: payloads in shared-memory slots, for a server on this host
  (`SlotPool`, `ShmTransport`; the server's side is `servers/_shm.py`).
- `data`: payloads on the server's data channel, TCP or TLS
  (`DataConnection`, `DataTransport`; the server's side is
  `servers/_data.py`).
- `failover`: reconnects to a restarted server and goes on
  (`RecoveringTransport`).

`runtime.make_transport` picks one per server client.
"""
