"""ddpstate's guarantees inside training frameworks, one module per framework.

``ddpstate.integrations.lightning`` (Lightning, ``pip install "ddpstate[lightning]"``) and
``ddpstate.integrations.transformers`` (the Hugging Face Trainer,
``pip install "ddpstate[transformers]"``). Importing this package imports no framework;
each module imports its own and says how to install it when it is missing.
"""
