"""p2pswarm: pool mismatched machines into one swarm that serves and trains models."""

__version__ = "0.1.0"
