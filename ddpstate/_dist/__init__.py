"""The process side of :mod:`ddpstate.dist`: rank queries and starting the process group."""
