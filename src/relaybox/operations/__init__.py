"""What operators do to an outbox table without a relay: read its counts, list the
abandoned messages, replay them."""
