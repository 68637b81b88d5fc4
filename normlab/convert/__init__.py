"""Put an existing model on another normalization, and fold weight standardization / BatchNorm for inference.

Modules are recognized by what they compute (their ``forward``), not by their class:

* a **BatchNorm** is ``nn.BatchNorm{1,2,3}d``, ``nn.SyncBatchNorm`` or any subclass of them that keeps their
  ``forward``; a **BatchNorm + activation** is timm's ``BatchNormAct2d``/``SyncBatchNormAct`` (the BatchNorm, then
  its ``drop`` and ``act`` modules); a **frozen BatchNorm** is torchvision's ``FrozenBatchNorm2d`` (and timm's
  ``FrozenBatchNormAct2d``): an eval-mode BatchNorm whose ``weight``, ``bias``, ``running_mean``, ``running_var``
  are buffers and whose ``eps`` is a plain attribute; a **BatchRenorm** is normlab's
  :class:`~normlab.nn.BatchRenorm2d` (1d/3d), :class:`~normlab.nn.SyncBatchRenorm` or their timm NormAct versions
  (a ``_BatchNorm`` subclass that renormalizes in training and computes BatchNorm in eval: it is converted like a
  BatchNorm, keeping its schedule or limits for ``brn``, folded like one and removed by ``pws`` like one). A
  BatchNorm or BatchRenorm subclass with its own ``forward`` computes something unknown: it is never replaced or
  folded, and every such module is named in one ``UserWarning``.
* A module registered under several names or parents (an alias, a shared layer) is replaced by ONE new module,
  set under every name that held the old one (norms and convs alike).
* Every new layer is built before any is set, and an error of its constructor (a ``**kw`` it refuses, e.g.
  ``rmax`` for a BatchNorm without running statistics) names the layer it would replace; nothing is changed then.
* A new layer keeps the replaced layer's state (``normlab/convert/state.py``): device, dtype (those of the model's
  first floating-point tensor for a BatchNorm that has none: ``affine=False, track_running_stats=False``), memory
  format (channels_last kernels), the training flag and each parameter's ``requires_grad`` (a frozen layer stays frozen,
  parameters it lacked included). Module hooks are not carried over (as by torch's
  ``SyncBatchNorm.convert_sync_batchnorm``): every such layer is named in one ``UserWarning``.
* Warnings and refusals are one line each: each reason once, with the first few layers and their count. A model
  without anything to convert gets one ``UserWarning`` naming what was looked for.

:func:`convert_norm` ``(model, to, inplace=True, example_input=None)`` (``to`` has no default, since every target
replaces layers; ``inplace=False``: a deep copy is converted and the original is left as it is):

- ``to`` a norm name (``none``, ``bn``, ``brn``, ``gn``, ``ln``, ``in``, ``sn`` or a norm of
  :func:`normlab.nn.register_norm`; what is copied and what is refused follows its :class:`~normlab.nn.NormEntry`):
  each BatchNorm becomes :func:`normlab.nn.create_norm` ``(to, C, dim)`` (a synchronized BatchNorm becomes the entry's
  ``sync`` class where it has one: ``nn.SyncBatchNorm`` -> :class:`~normlab.nn.SyncBatchRenorm` for ``brn``,
  ``nn.SyncBatchNorm`` for ``bn``, and timm's ``SyncBatchNormAct`` ->
  :class:`~normlab.integrations.timm.SyncBatchRenormAct` / ``SyncBatchNormAct``; the others are per sample, and
  ``sn``'s BatchNorm branch uses the local batch); a BatchNorm + activation becomes the NormAct class of the target
  (:func:`normlab.integrations.timm.norm_act_class`; ``bn``: timm's ``BatchNormAct2d``) holding the ORIGINAL ``drop``
  and ``act`` modules (``none``: ``nn.Sequential(drop, act)``), so the activation is never lost and ``to="bn"``
  computes the same function. A frozen BatchNorm is converted like a BatchNorm (its buffers copied) and stays frozen
  (``requires_grad=False``; its running statistics update in training mode, so keep it in eval mode to keep them); its
  eval-mode output is unchanged for ``bn``/``brn``. Copied over: the affine ``weight``/``bias`` whenever the new layer
  has per-channel ones of the same size; the running statistics (``running_mean``, ``running_var``,
  ``num_batches_tracked``) for the norms that keep BatchNorm's (``running_stats``): ``brn`` and ``bn`` (whose state is
  BatchNorm's: ``eps``/``momentum``/``affine``/``track_running_stats`` are kept too) and ``sn`` (its BN branch
  estimates the same batch moments, with BatchNorm's ``momentum``). ``eps`` (and ``affine`` where the new layer takes
  it) follow the BatchNorm unless given in ``**kw``, as do ``bias=False`` and ``check_finite`` where the new layer
  takes them.
  **Refused** (``ValueError``, one line giving each reason once with the first few layers and their count, before
  anything is changed): a norm with per-sample statistics (``gn``, ``ln``, ``in``, ``sn``: ``statistics``
  ``instance``, ``group`` or ``layer``) for a ``BatchNorm1d`` unless it is known to see (N, C, L) input, since these
  norms need a length axis and over (N, C) they would normalize each sample over its features (or fail). Known means:
  every call on ``example_input`` had a 3-D input, or without ``example_input`` (or for a layer it does not reach) the
  ``torch.fx`` dataflow shows its input is a ``Conv1d``/``ConvTranspose1d`` output. Its input coming from
  ``nn.Linear``, or no way to tell, is refused. Also refused, where the statistics would be of a single value, so that
  the new layer would output its bias whatever the input: ``in``/``sn`` (instance statistics) for a layer that sees a
  single spatial position, ``gn``/``ln`` (group, layer) for a layer that sees a single value per group (a 1x1 map with
  one channel per group: the squeeze-excite and attention BatchNorms of rexnet or skresnet). "Sees" means on
  ``example_input``; without it, on default inputs (batch 2, the first conv's channels) of two sizes, a size and twice
  that, where a layer sees the same shape at both (fixed by the architecture, e.g. after global pooling; a stride-32
  stage that is 1x1 only on a small input is not refused). ``gn`` (a group norm) with a ``num_groups`` that does not
  divide a layer's channels is refused naming the layer, its channels and their divisors (without ``num_groups`` each
  layer takes the largest divisor of C that is <= 32). ``nn.SyncBatchNorm`` takes any rank: the new layer's dimension
  is the one it sees on ``example_input`` ((N, C) is refused as above), else 2.
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
  removed (warning); when it rests on one path of a data-dependent forward (see :func:`fold_for_inference` below),
  a warning names the norms removed.

:func:`fold_for_inference` ``(model)``: an inference copy in eval mode in which every WS/PWS conv, every conv with
a weight parametrization (``weight_norm``) and timm's ``StdConv2d``/``ScaledStdConv2d`` is a plain
``nn.Conv{d}d`` holding its effective kernel (always exact), and every eval-mode BatchNorm / BatchRenorm (with
running statistics; frozen ones too; the norm part of a BatchNorm + activation or of
:class:`~normlab.integrations.timm.BatchRenormAct2d`) whose only input is the output of a
conv or a transposed conv is folded into that conv's weight and bias and replaced by ``nn.Identity`` (a BatchNorm +
activation by ``nn.Sequential(drop, act)``). Folding follows the real dataflow, as above; a pair is folded only when
the BN's only input is that conv's output, the conv's output has no other consumer, both run once per forward,
nothing else reads their parameters and neither has hooks; every other BatchNorm (one whose input is not a conv's
output: an activation in between (conv -> ReLU -> BN), the model's input, a Linear, a sum; a BatchNorm subclass
with its own forward, a BatchNorm fed by a conv subclass with its own forward such as timm's ``Conv2dSame``, a
BatchNorm without running statistics, ``track_running_stats=False``, ...) is left unfolded and named, with the
reason (and what made its input, where ``torch.fx`` shows it), in one warning. When the dataflow cannot be
established no BatchNorm is folded (warning).
``torch.fx`` traces every path; a hook trace sees one: when it is used and the traced forward turned a tensor's
value into a Python value outside the convs and norms (``Tensor.__bool__``, ``item``, ...: data-dependent control
flow), a second warning says that the folds rest on the path that input took and names every folded pair (an
input taking another branch may call the modules differently). A forward whose path depends only on the input's
shape is not detected: its folds hold for inputs that take the traced path. Folding is computed in float64 and
cast back. Give
``example_input`` to check that the outputs agree (relative error <= ``rtol``, default 1e-5; a deep float32 model
whose own rounding error exceeds that passes when the folded output is as close to the model computed in float64
as the original is, up to ``rtol`` and twice the original's rounding error).

:meth:`SyncBatchRenorm.convert_sync_batchrenorm <normlab.nn.SyncBatchRenorm.convert_sync_batchrenorm>`
(``normlab/nn/_sync_convert.py``) follows the same rule: each layer computes what it computed, so timm's NormAct
:class:`~normlab.integrations.timm.BatchRenormAct2d` becomes
:class:`~normlab.integrations.timm.SyncBatchRenormAct` with its ``drop`` and ``act``, and a BatchRenorm subclass
with its own forward is left and named in one warning.
"""

from normlab.convert.fold import fold_for_inference
from normlab.convert.targets import CONVERT_TARGETS, convert_norm

__all__ = ["convert_norm", "fold_for_inference", "CONVERT_TARGETS"]
