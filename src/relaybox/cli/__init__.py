"""The `relaybox` command line: `relaybox.cli.main:main` is the entry point."""
