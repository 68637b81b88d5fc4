"""normlab: normalization in deep networks.

- :mod:`normlab.functional`: pure functions (moments, batch_renorm, switchable_norm, pws_weight, ...)
- :mod:`normlab.nn`: layers (BatchRenorm2d, SwitchableNorm2d, PWSConv2d, ...) and the ``create_norm`` registry
- :mod:`normlab.monitor`: variance-transmission monitor and signal propagation plots
- :mod:`normlab.convert`: swap a model's normalization, fold normalization for inference
- ``normlab`` command line: ``normlab train | compare | report | monitor | bench | export``
"""

__version__ = "0.1.0"
