"""ddpstate's guarantees inside training frameworks, one module per framework.

``ddpstate.integrations.lightning`` (Lightning, ``pip install "ddpstate[lightning]"``),
``ddpstate.integrations.transformers`` (the Hugging Face Trainer,
``pip install "ddpstate[transformers]"``) and ``ddpstate.integrations.accelerate``
(Accelerate's ``save_state``/``load_state``, ``pip install "ddpstate[accelerate]"``).
Importing this package imports no framework; each module imports its own and says how to
install it when it is missing.
"""
