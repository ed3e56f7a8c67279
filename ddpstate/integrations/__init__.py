"""ddpstate's guarantees inside training frameworks, one module per framework.

``ddpstate.integrations.lightning`` (Lightning, the ``lightning`` extra),
``ddpstate.integrations.transformers`` (the Hugging Face Trainer, ``transformers``) and
``ddpstate.integrations.accelerate`` (Accelerate's ``save_state``/``load_state``,
``accelerate``): from a checkout ``pip install -e ".[lightning]"``, once ddpstate is on
PyPI ``pip install "ddpstate[lightning]"`` (``integrations`` installs all three).
Importing this package imports no framework; each module imports its own and says how to
install it when it is missing.
"""
