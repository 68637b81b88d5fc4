"""Adapters to the tools users already work with; each imports its extra only when used.

- :mod:`normlab.integrations.tensorboard`: the variance monitor in TensorBoard (``normlab[tensorboard]``).
- :mod:`normlab.integrations.lightning`: ``VarianceMonitorCallback`` for Lightning (``normlab[lightning]``).
- :mod:`normlab.integrations.timm`: normlab's norms as timm NormAct layers (``BatchRenormAct2d``, ...) for
  ``timm.create_model(name, norm_layer=...)`` (``normlab[timm]``).

Grids on Ray are the runner's (``normlab compare --backend ray``); ``normlab export`` writes ONNX and TorchScript.
"""
