"""`python -m p2pswarm.cli`: the same as the `p2pswarm` command."""

from p2pswarm.cli import main

main()
