"""A request's path, from authentication and admission to the batch cache
and the transports, with health and metrics beside it; and the options a
server runs with. Which module does what: docs/design.md, "server/"."""
