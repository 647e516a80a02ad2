"""The wire: elevator.proto, its generated stubs, and batch encoding."""
