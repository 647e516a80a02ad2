"""The serving side: config, the contract's dataset, gRPC servicer, workers."""
