"""`python -m relaybox ...`: the `relaybox` command, for environments without its script
on PATH (a container's entry point, a virtual environment not activated)."""

from relaybox.cli.main import main

if __name__ == "__main__":
    main(prog_name="relaybox")
