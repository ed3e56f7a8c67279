"""ddpstate's benchmark suite: ``python -m benchmarks [--quick | --full]`` (see ``__main__``)."""
