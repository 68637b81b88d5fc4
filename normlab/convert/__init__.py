"""Put an existing model on another normalization, and fold weight standardization / BatchNorm for inference.

Modules are recognized by what they compute (their ``forward``), not by their class:

* a **BatchNorm** is ``nn.BatchNorm{1,2,3}d``, ``nn.SyncBatchNorm`` or any subclass of them that keeps their
  ``forward``; a **BatchNorm + activation** is timm's ``BatchNormAct2d``/``SyncBatchNormAct`` (the BatchNorm, then
  its ``drop`` and ``act`` modules); a **frozen BatchNorm** is torchvision's ``FrozenBatchNorm2d`` (and timm's
  ``FrozenBatchNormAct2d``): an eval-mode BatchNorm whose ``weight``, ``bias``, ``running_mean``, ``running_var``
  are buffers and whose ``eps`` is a plain attribute. A BatchNorm subclass with its own ``forward`` computes
  something unknown: it is never replaced or folded, and every such module is named in one ``UserWarning``.
* A module registered under several names or parents (an alias, a shared layer) is replaced by ONE new module,
  set under every name that held the old one (norms and convs alike).

:func:`convert_norm` ``(model, to=..., inplace=True, example_input=None)`` (``inplace=False``: a deep copy is
converted and the original is left as it is):

- ``to`` a norm name (``none``, ``bn``, ``brn``, ``gn``, ``ln``, ``in``, ``sn``): each BatchNorm becomes
  :func:`normlab.nn.create_norm` ``(to, C, dim)`` (``nn.SyncBatchNorm`` -> :class:`~normlab.nn.SyncBatchRenorm` for
  ``brn``); a BatchNorm + activation becomes the NormAct class of the target from
  :mod:`normlab.integrations.timm` (``bn``: timm's ``BatchNormAct2d``) holding the ORIGINAL ``drop`` and ``act``
  modules (``none``: ``nn.Sequential(drop, act)``), so the activation is never lost and ``to="bn"`` computes the
  same function. A frozen BatchNorm is converted like a BatchNorm (its buffers copied), i.e. it becomes trainable;
  its eval-mode output is unchanged for ``bn``/``brn``.
  Copied over: the affine ``weight``/``bias`` whenever the new layer has per-channel ones of the same size; the
  running statistics (``running_mean``, ``running_var``, ``num_batches_tracked``) for ``brn`` and ``bn`` (whose
  state is BatchNorm's: ``eps``/``momentum``/``affine``/``track_running_stats`` are kept too) and ``sn`` (its BN
  branch estimates the same batch moments). ``eps`` (and ``affine`` where the new layer takes it) follow the
  BatchNorm unless given in ``**kw``.
  **Refused** (``ValueError``, one line naming every such layer and why, before anything is changed): ``gn``,
  ``ln``, ``in``, ``sn`` for a ``BatchNorm1d`` unless it is known to see (N, C, L) input, since these norms need a
  length axis and over (N, C) they would normalize each sample over its features (or fail). Known means: every
  call on ``example_input`` had a 3-D input, or without ``example_input`` (or for a layer it does not reach) the
  ``torch.fx`` dataflow shows its input is a ``Conv1d``/``ConvTranspose1d`` output. Its input coming from
  ``nn.Linear``, or no way to tell, is refused. Also refused: ``in``/``sn`` for a layer that sees a single spatial
  position on ``example_input`` (instance statistics need more than one). ``nn.SyncBatchNorm`` takes any rank: the
  new layer's dimension is the one it sees on ``example_input`` ((N, C) is refused as above), else 2.
- ``to="pws"`` or ``"ws"``: every plain ``nn.Conv{1,2,3}d`` (exact type) becomes the matching
  ``PWSConv``/``WSConv`` with the same arguments, raw weight and bias; ``**kw`` go to the new conv (``gamma``,
  ``relative_gamma``, ``init_alpha``, ``eps`` ...). Left as they are, named in one warning: transposed convs
  (normlab has no weight-standardized transposed conv), timm's ``StdConv2d``/``ScaledStdConv2d`` (already
  weight-standardized) and other conv subclasses (their forward may differ).
  With ``remove_norm`` (default for ``pws``, not for ``ws``) each BatchNorm whose every input is a converted conv's
  output is removed (``nn.Identity``; a BatchNorm + activation keeps its ``drop`` and ``act``), and that conv gets
  a bias (zero-initialised if it had none), as in the authors' PWS networks. "Whose input" is the dataflow of
  ``normlab/convert/dataflow.py`` (a ``torch.fx`` trace, else hooks on one eval-mode forward of ``example_input``
  or of a default input), never the registration order; when the dataflow cannot be established, no norm is
  removed (warning).

:func:`fold_for_inference` ``(model)``: an inference copy in eval mode in which every WS/PWS conv, every conv with
a weight parametrization (``weight_norm``) and timm's ``StdConv2d``/``ScaledStdConv2d`` is a plain
``nn.Conv{d}d`` holding its effective kernel (always exact), and every eval-mode BatchNorm / BatchRenorm (with
running statistics; frozen ones too; the norm part of a BatchNorm + activation or of
:class:`~normlab.integrations.timm.BatchRenormAct2d`) whose only input is the output of a
conv or a transposed conv is folded into that conv's weight and bias and replaced by ``nn.Identity`` (a BatchNorm +
activation by ``nn.Sequential(drop, act)``). Folding follows the real dataflow, as above; a pair is folded only when
the BN's only input is that conv's output, the conv's output has no other consumer, both run once per forward,
nothing else reads their parameters and neither has hooks; every other conv/BN pair (a BatchNorm subclass with its
own forward fed by a conv, a BatchNorm fed by a conv subclass with its own forward such as timm's ``Conv2dSame``,
...) is left unfolded and named, with the reason, in one warning. When the dataflow
cannot be established no BatchNorm is folded (warning). Folding is computed in float64 and cast back. Give
``example_input`` to check that the outputs agree (relative error <= ``rtol``, default 1e-5; a deep float32 model
whose own rounding error exceeds that passes when the folded output is as close to the model computed in float64
as the original is, up to ``rtol`` and twice the original's rounding error).
"""

from normlab.convert.fold import fold_for_inference
from normlab.convert.targets import CONVERT_TARGETS, convert_norm

__all__ = ["convert_norm", "fold_for_inference", "CONVERT_TARGETS"]
