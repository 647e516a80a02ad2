"""The shared core: what the server and the client both speak.

The wire (`elevator.proto`, its stubs, batch encoding, bulk framing,
varints), the contract (step -> record positions, host rows, steps, stream
fingerprint), the element spec and tree, the error family with its one
status table, and the allocator settings both ends use. It imports neither
`grain_elevator.server` nor `grain_elevator.client`.
"""
