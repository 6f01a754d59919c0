"""Tools around relaybox, not the library: `relaybox bench`, the raw broker loops it
measures against, `relaybox demo` and the private NATS server the demo starts. Nothing in
the library imports them; the CLI loads them only when their command runs."""
