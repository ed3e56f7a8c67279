"""The file commands' engine: ``convert``, ``inspect``, ``diff`` and ``verify``.

:mod:`ddpstate.convert` re-exports the public functions and result types; these
modules read every torch file through torch's own reader (:mod:`ddpstate._convert.source`)
and write through ``torch.save`` or the safetensors writer.
"""
