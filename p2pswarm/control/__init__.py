"""The local control API: the CLI talks to its agent over a Unix socket in the state dir."""
