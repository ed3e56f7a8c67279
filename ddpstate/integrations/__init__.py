"""ddpstate's guarantees inside training frameworks: one module per framework, each an extra."""
