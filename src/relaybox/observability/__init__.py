"""What a running relay tells the outside: the JSON of `/api/outbox`, Prometheus metrics
and the HTTP endpoints that serve them with the health checks."""
