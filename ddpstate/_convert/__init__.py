"""The file commands' engine: ``convert``, ``inspect``, ``diff`` and ``verify``, streaming.

:mod:`ddpstate.convert` re-exports the public functions and result types; these
modules sit on the torch-free streaming engine (:mod:`ddpstate._streaming`) and
import torch only inside the functions that need tensors.
"""
