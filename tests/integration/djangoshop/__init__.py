"""A small Django app for the relaybox app's tests: orders, and a handler that makes one."""
