"""``marduk torchft-lighthouse``: a gRPC front for torchft's lighthouse that drops a replica
group's heartbeats the moment Marduk orders that group restarted or failed (docs/operations.md,
*torchft lighthouse front*). ``heartbeats`` and ``wire`` are pure; ``front`` is the gRPC and
NATS shell; ``supervisor`` runs torchft's lighthouse and the front, and starts the front again
when it dies; ``cli`` is the command. Only ``front`` imports grpcio (the ``torchft`` extra)."""
